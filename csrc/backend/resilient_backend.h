// ResilientBackend: the c10d::Backend behind "resilient_tcp", "resilient_nccl" and
// "resilient_hccl". The host communicator is the TCP transport's; the device communicator comes
// from the device transport registered for the backend's name and the tensors' device type
// (comm/device_transport.h): this file names no vendor library.
//
// Every collective torch dispatches is checked here (tensor lists, dtypes, devices,
// contiguity, reduction ops) and then run with a deadline of the op's timeout measured from
// the call:
// - on a host communicator (TCP), queued in call order on this backend's worker thread; a
//   synchronous op (async_op=False) on an idle group runs on the calling thread instead (same
//   order, two thread hand-offs fewer). The Work completes when the op does.
// - on a device communicator (NCCL, HCCL), launched on the calling thread, async ops included, as
//   ProcessGroupNCCL does: the op follows the caller's current stream at the call and is in
//   flight when the Work is returned (resilient_work.h); several may be in flight.
// A Work's error is the communicator's Status turned into a CommException (see comm_error.h).
// Ops issued between startCoalescing() and endCoalescing() (batch_isend_irecv) run together
// at the end: as one NCCL group on a device, as one send/recv group on the worker.
//
// With RESILIENT_COMM_NCCL_EMULATE=1 a device transport is registered for resilient_nccl's CPU
// tensors (the NCCL emulator, csrc/emulation/nccl): they go through an NCCL communicator
// instead of TCP, so the whole stack runs on the NCCL code path without a GPU.
//
// Threads: any Python thread may issue ops (host ops are serialised by the queue, device ops by
// the calling threads, as with ProcessGroupNCCL); abort() may be called from any thread and
// returns at once; the destructor drains nothing: it aborts pending ops if the communicator is
// unhealthy, then joins the worker.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/resilient_work.h"
#include "comm/communicator.h"
#include "watchdog/watchdog.h"

namespace resilient_comm {

struct OpSite;  // backend/tensor_args.h

struct DeviceTransport;  // comm/device_transport.h
namespace tcp {
class Listener;
class TcpCommunicator;
}  // namespace tcp

// A grown group's name: kGrownPrefix + the join key, on members and joiners alike.
inline constexpr const char* kGrownPrefix = "grown:";
// Under the join key: what the members' rank 0 says about the group ("<backend> <library>" where
// its device communicator grows with it, "<backend> none" where not), and the prefix of the
// grown device communicator's bootstrap keys.
inline constexpr const char* kGrowDeviceKey = "device";
inline constexpr const char* kGrowDevicePrefix = "device/";

struct BackendOptions {
  std::string backendName;  // "resilient_tcp", "resilient_nccl", "resilient_hccl"
  std::string groupName;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // torch's init_process_group(..., enable_reconfigure=True): the group connects nothing until
  // its first reconfigure() (backend_reconfigure.cpp); ops before it are refused.
  bool enableReconfigure = false;
};

// Aborts `comm` through the Reaper: bounded even if the transport's abort blocks.
void abortComm(const std::shared_ptr<Communicator>& comm, const std::string& why);

// Abort hooks registered through torch (registerAbortHook, torch >= 2.14), shared with the
// watchdog's callbacks, which may outlive a call into the backend. Each abort of the group runs
// every hook once, on the aborting thread, before the communicators are aborted; a hook that
// throws is logged and the rest still run.
class AbortHooks {
 public:
  void add(int64_t id, std::function<void()> hook);
  void remove(int64_t id);
  void run(const std::string& why);

 private:
  std::mutex mu_;
  std::map<int64_t, std::function<void()>> hooks_;
};

class ResilientBackend : public c10d::Backend {
 public:
  ResilientBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size, BackendOptions opts);
  // Wraps a communicator made by shrink, split, grow or join (it may still be building).
  ResilientBackend(std::shared_ptr<Communicator> comm, BackendOptions opts);
  ~ResilientBackend() override;

  // A hot spare's side of a grow: rank in [existingSize, newSize), meeting the members that
  // call grow(newSize, store, joinKey). The group's backend comes from the members (as does
  // whether their NCCL communicator grows; the joiner then joins it on `device`, which must be
  // a CUDA device unless emulating); opts.backendName is ignored.
  static c10::intrusive_ptr<ResilientBackend> join(const c10::intrusive_ptr<c10d::Store>& store,
                                                   const std::string& joinKey, int rank, int newSize,
                                                   int existingSize, BackendOptions opts,
                                                   std::optional<at::Device> device = std::nullopt);

  bool supportsShrinking() const override {
    return true;
  }
  bool supportsSplitting() const override {
    return true;
  }
  bool supportsCoalescing() const override {
    return true;
  }
#ifdef C10D_BACKEND_HAS_RECONFIGURE
  // torch's reconfigure API (backend_reconfigure.cpp; [Note: reconfigure handles] in
  // reconfigure_plan.h): a handle naming this process's endpoint, and a reconfigure that
  // shrinks the current communicator when the handles allow it, else builds a fresh one.
  bool supportsReconfigure() const override {
    return true;
  }
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif
#ifdef C10D_BACKEND_HAS_HOOKS
  void registerAbortHook(int64_t hookId, c10d::AbortHook hook) override {
    hooks_->add(hookId, std::move(hook));
  }
  void unregisterAbortHook(int64_t hookId) override {
    hooks_->remove(hookId);
  }
  // torch 2.15's capability query (its Backend declares it virtual; no `override` here, so that
  // 2.14's headers, which lack it, still compile): torch's flight-recorder hook registers its
  // abort hook, through which it dumps, only on a backend that says it runs them (#192234,
  // torch/csrc/distributed/c10d/hooks/FlightRecorderHook.cpp). Ours runs them on every failure
  // and abort.
  bool supportsAbortHooks() const {  // NOLINT(modernize-use-override)
    return true;
  }
#endif
#ifdef C10D_BACKEND_HAS_RECONFIGURE
  // reconfigure() with its options unpacked: `handles` a list (`ordered`) or a set; timeout < 0:
  // the group's; `forceFresh` (hint resilient_comm.path=fresh): never the shrink fast path.
  c10::intrusive_ptr<c10d::Work> reconfigureWith(int64_t uuid, const std::vector<std::string>& handles, bool ordered,
                                                 std::chrono::milliseconds timeout, bool forceFresh = false);
  std::string reconfigureHandle() const;
#endif
  // The kind of the last reconfigure's plan ("shrink" or "fresh", then "+fallback" where a
  // shrink failed and the members built afresh); empty before any.
  std::string lastReconfigure() const;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  // Survivors only. shrinkFlags & 1 (SHRINK_ABORT), or a failed group, aborts this group first.
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                           const c10::intrusive_ptr<Options>& optsOverride) override;
  // Every member calls it; `ranks` is the sorted list of this rank's new group (parent ranks),
  // or a list without this rank to take part without joining a group (returns null).
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  // Every member calls it; members with the same color form a group ordered by key (ties by
  // rank). A negative color takes part without joining: returns null.
  c10::intrusive_ptr<ResilientBackend> splitByColor(int color, int key);
  // Every member calls it, while the joiners call join(); members keep their ranks. The grown
  // group is named kGrownPrefix + joinKey on every rank (the name its device communicator
  // bootstraps under), and its NCCL communicator, if any, grows with it.
  c10::intrusive_ptr<ResilientBackend> grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::string& joinKey);

  const std::string getBackendName() const override {
    return opts_.backendName;
  }
  // The group's name in errors and in its device communicator's bootstrap keys.
  const std::string& groupName() const {
    return opts_.groupName;
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<Options> getBackendOptions() override;
  c10d::ErrorType getError() override;
  void abort() override;
  void shutdown() override;
  uint64_t getSequenceNumberForGroup() override;
  void setSequenceNumberForGroup() override {}

  // Aborts with a reason (the Python API's resilient_comm.abort()); returns within
  // RESILIENT_COMM_ABORT_BOUND_MS even if the transport's abort blocks (see reaper.h).
  void abortWithReason(const std::string& reason);
  // The group's first error (its host or its device communicator's) as a CommErrorInfo, or
  // nullopt while it is healthy.
  std::optional<CommErrorInfo> errorInfo() const;
  // Barrier that names the ranks which did not arrive by the deadline (rank 0 collects).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  // The first error of the group's communicators (host, then device), or Ok.
  Status commError() const;
  // The host communicator (TCP); a reconfigure replaces it.
  std::shared_ptr<Communicator> cpuComm() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cpu_;
  }
  // The device communicator, if one was made (for tests).
  std::shared_ptr<Communicator> deviceComm() const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // Sparse COO tensors (SUM, host tensors), as gloo: sparse_allreduce.cpp. all_reduce sends
  // them here too.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

 private:
  using Body = std::function<Status(Communicator&, const Deadline&)>;

  c10::intrusive_ptr<c10d::Work> allreduceSparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);

  // Runs `body` on `comm`: launched on a device communicator, else queued on the worker (a
  // synchronous op, mayRunInline, on an idle group runs on the calling thread instead). The
  // Work completes with its Status.
  c10::intrusive_ptr<c10d::Work> enqueue(std::shared_ptr<Communicator> comm, c10d::OpType type, const char* opName,
                                         std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
                                         bool mayRunInline, Body body);
  // The communicator for these tensors' device: TCP for CPU tensors; for device tensors the
  // device communicator (deviceCommFor).
  std::shared_ptr<Communicator> commFor(const std::vector<at::Tensor>& tensors, const char* op);
  // The device communicator for `dev` (for CPU tensors when emulating), made on first use by
  // the device transport registered for this backend and that device type
  // (comm/device_transport.h).
  std::shared_ptr<Communicator> deviceCommFor(const at::Device& dev, const char* op);
  // After a reconfigure, how the members make their device communicator, as rank 0 says over
  // the host communicator: grow the old one (its newcomers joining) or build afresh, and the id.
  struct DeviceBootstrap {
    bool grow = false;
    std::vector<uint8_t> id;
  };
  DeviceBootstrap bootstrapOverHost(const DeviceTransport& t, const at::Device& dev, const OpSite& site);
  // Called with mu_ held. `how`: what bootstrapOverHost agreed (nothing before any reconfigure:
  // the id goes through the store).
  Result<std::shared_ptr<Communicator>> makeDevice(const DeviceTransport& t, const at::Device& dev,
                                                   DeviceBootstrap how);
  // The device communicator's bootstrap keys in this configuration.
  std::string devicePrefix(const DeviceTransport& t) const;
  void workerLoop();

  // A child backend named `name` over `r`, or the error of the move as an exception.
  c10::intrusive_ptr<ResilientBackend> adopt(Result<std::shared_ptr<Communicator>> r, const char* move,
                                             const std::string& name);
  [[noreturn]] void throwMoveError(const char* move, const Status& st) const;
  std::pair<std::shared_ptr<Communicator>, at::Device> deviceSnapshot() const;
  // Gives `child` the device communicator a move of this group's made (`r`, on `dev`), or
  // raises the move's error.
  void handDevice(ResilientBackend* child, Result<std::shared_ptr<Communicator>> r, const at::Device& dev,
                  const char* move) const;

  // Fails the queued ops and stops the running one (aborting `old`), for a reconfigure; then
  // nothing runs on the group until the caller swaps its communicators.
  void supersede(const std::shared_ptr<Communicator>& old, const std::string& why);
  // The communicator this process last built (shrinkable, its listener reused), or null;
  // rcMu_ held.
  std::shared_ptr<tcp::TcpCommunicator> refreshBase() const;
  // Fixes handle_ (and what it names) if it is not yet; rcMu_ held.
  void fixHandle() const;
  // Throws for an op on a group in the reconfigure regime that has not been configured yet.
  void checkConfigured(const char* op) const;

  const BackendOptions opts_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Communicator> cpu_;  // guarded by mu_ where a reconfigure may replace it
  std::shared_ptr<AbortHooks> hooks_ = std::make_shared<AbortHooks>();
  // Reconfigure state, guarded by rcMu_ (a reconfigure at a time).
  std::atomic<bool> configured_{true};  // false from enable_reconfigure until the first reconfigure
  mutable std::mutex rcMu_;
  mutable std::shared_ptr<tcp::TcpCommunicator> base_;  // see refreshBase()
  // Former bases' identities -> the addresses of the members of every base since (a handle of
  // one is stale only where its process took part in a later one: reconfigure_plan.h).
  mutable std::map<uint64_t, std::set<std::string>> replaced_;
  mutable std::shared_ptr<tcp::Listener> ownListener_;  // where no base has one
  mutable std::string ownAddr_;
  // The handle handed out (and the base and listener it names), fixed until the next
  // reconfigure; empty until asked for.
  mutable std::string handle_;
  mutable std::shared_ptr<tcp::TcpCommunicator> handleBase_;
  mutable std::shared_ptr<tcp::Listener> handleListener_;
  std::set<int64_t> uuids_;
  // Names the device communicator's bootstrap keys per configuration ("" before any
  // reconfigure, then "u<uuid>/"): every member of a reconfigure has the same; guarded by mu_.
  std::string configTag_;
  std::string lastPlan_;  // guarded by mu_ (a fallback sets it from the worker)
  c10::intrusive_ptr<c10d::Store> store_;  // for the device communicator's bootstrap
  // The device communicator (NCCL for resilient_nccl's CUDA tensors, HCCL for
  // resilient_hccl's NPU tensors: whichever device transport is registered), made on first
  // use; guarded by mu_.
  std::shared_ptr<Communicator> device_;
  // After a reconfigure that grew the group: the old device communicator, grown at the first
  // device op (deviceCommFor), and the old size (the newcomers' ranks start there; 0: no grow).
  std::shared_ptr<Communicator> growFrom_;
  int grownFrom_ = 0;
  at::Device deviceOf_{at::kCPU};
  std::atomic<int> splits_{0};  // splits of this group so far (every member splits in the same order)

  // A task runs `body`, or, for send/recv, contributes `p2p`: consecutive queued send/recv
  // tasks run as one group so that two ranks exchanging large messages do not deadlock.
  struct Task {
    std::shared_ptr<Communicator> comm;
    c10::intrusive_ptr<ResilientWork> work;
    Deadline deadline;
    Body body;
    std::optional<P2POp> p2p;
    Watchdog::Id watchId;
  };
  c10::intrusive_ptr<c10d::Work> enqueueP2P(std::shared_ptr<Communicator> comm, c10d::OpType type, const char* opName,
                                            const at::Tensor& t, P2POp op);
  // Creates the Work, arms the watchdog and queues the task.
  c10::intrusive_ptr<c10d::Work> push(std::shared_ptr<Communicator> comm, c10d::OpType type, const char* opName,
                                      std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
                                      bool mayRunInline, Body body, std::optional<P2POp> p2p);
  void runTask(Task& task);
  c10::intrusive_ptr<ResilientWork> makeWork(const std::shared_ptr<Communicator>& comm, c10d::OpType type,
                                             const char* opName, std::vector<at::Tensor> outputs);
  // A device communicator's op: launched now (see the class comment), or kept for
  // endCoalescing(). `followers` complete with it (the ops of a coalesced group).
  c10::intrusive_ptr<c10d::Work> launchOnDevice(std::shared_ptr<Communicator> comm, c10d::OpType type,
                                                const char* opName, std::vector<at::Tensor> outputs,
                                                std::chrono::milliseconds timeout, Body body, bool hostWaits,
                                                std::vector<c10::intrusive_ptr<ResilientWork>> followers = {});
  // A device op issued while coalescing.
  struct DeviceOp {
    std::shared_ptr<Communicator> comm;
    c10::intrusive_ptr<ResilientWork> work;
    std::vector<at::Tensor> outputs;
    std::chrono::milliseconds timeout;
    Body body;
  };
  void startWorker();
  void finishTask(Task& task, const Status& st);
  void runP2PGroup(std::vector<Task>& group);
  CommErrorInfo site(const char* op) const;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  bool running_ = false;  // an op is running (on the worker or inline); guarded by mu_
  bool p2pRunning_ = false;     // the worker runs a send/recv group; guarded by mu_
  std::shared_ptr<Communicator> p2pComm_;  // that group's communicator; guarded by mu_
  std::vector<Task> p2pJoin_;   // send/recv handed to that group; guarded by mu_
  int p2pWake_ = -1;            // eventfd: wakes the running group for p2pJoin_
  uint64_t enqueued_ = 0;
  std::thread worker_;
  bool emulate_ = false;  // a device transport carries this backend's CPU tensors (the NCCL emulator)
  bool coalescing_ = false;                  // between startCoalescing and endCoalescing; guarded by mu_
  std::vector<Task> coalescedHost_;          // guarded by mu_
  std::vector<DeviceOp> coalescedDevice_;    // guarded by mu_
};

}  // namespace resilient_comm
