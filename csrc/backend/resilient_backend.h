// ResilientBackend: the c10d::Backend behind "resilient_tcp" and "resilient_nccl".
//
// Every collective torch dispatches is checked here (tensor lists, dtypes, devices,
// contiguity, reduction ops) and then run with a deadline of the op's timeout measured from
// the call:
// - on a host communicator (TCP), queued in call order on this backend's worker thread; a
//   synchronous op (async_op=False) on an idle group runs on the calling thread instead (same
//   order, two thread hand-offs fewer). The Work completes when the op does.
// - on a device communicator (NCCL), launched on the calling thread, async ops included, as
//   ProcessGroupNCCL does: the op follows the caller's current stream at the call and is in
//   flight when the Work is returned (resilient_work.h); several may be in flight.
// A Work's error is the communicator's Status turned into a CommException (see comm_error.h).
// Ops issued between startCoalescing() and endCoalescing() (batch_isend_irecv) run together
// at the end: as one NCCL group on a device, as one send/recv group on the worker.
//
// With RESILIENT_COMM_NCCL_EMULATE=1, resilient_nccl sends CPU tensors through its NCCL
// communicator on the NCCL emulator (transport/nccl/emulator) instead of TCP, so the whole
// stack runs on the NCCL code path without a GPU.
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
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/resilient_work.h"
#include "comm/communicator.h"
#include "watchdog/watchdog.h"

namespace resilient_comm {

namespace nccl {
class NcclApi;
}
namespace device {
class StreamOps;
}

// A grown group's name: kGrownPrefix + the join key, on members and joiners alike.
inline constexpr const char* kGrownPrefix = "grown:";
// Under the join key: what the members' rank 0 says about the group ("<backend> nccl|none"),
// and the prefix of the grown NCCL communicator's bootstrap keys.
inline constexpr const char* kGrowDeviceKey = "device";
inline constexpr const char* kGrowNcclPrefix = "nccl/";

struct BackendOptions {
  std::string backendName;  // "resilient_tcp" or "resilient_nccl"
  std::string groupName;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
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
  std::shared_ptr<Communicator> cpuComm() const {
    return cpu_;
  }
  // The device communicator, if one was made (for tests).
  std::shared_ptr<Communicator> deviceComm() const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
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

  // Runs `body` on `comm`: launched on a device communicator, else queued on the worker (a
  // synchronous op, mayRunInline, on an idle group runs on the calling thread instead). The
  // Work completes with its Status.
  c10::intrusive_ptr<c10d::Work> enqueue(std::shared_ptr<Communicator> comm, c10d::OpType type, const char* opName,
                                         std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
                                         bool mayRunInline, Body body);
  // The communicator for these tensors' device: TCP for CPU tensors; for CUDA tensors
  // (resilient_nccl) an NCCL communicator, for NPU tensors (resilient_hccl) an HCCL one,
  // made on first use for that device.
  std::shared_ptr<Communicator> commFor(const std::vector<at::Tensor>& tensors, const char* op);
  // The device communicator for `dev`, made on first use (for CPU tensors when emulating).
  std::shared_ptr<Communicator> deviceCommFor(const at::Device& dev, const char* op);
  struct NcclRuntime {
    std::shared_ptr<nccl::NcclApi> api;
    std::shared_ptr<device::StreamOps> streams;
  };
  // The NCCL library (the emulator for a CPU device) and the device's streams.
  static Result<NcclRuntime> ncclRuntime(const at::Device& dev);
  Result<std::shared_ptr<Communicator>> makeNccl(const at::Device& dev);
  Result<std::shared_ptr<Communicator>> makeHccl(const at::Device& dev);
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

  const BackendOptions opts_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Communicator> cpu_;
  c10::intrusive_ptr<c10d::Store> store_;  // for the NCCL communicator's bootstrap
  // The device communicator (NCCL for resilient_nccl's CUDA tensors, HCCL for
  // resilient_hccl's NPU tensors), made on first use; guarded by mu_.
  std::shared_ptr<Communicator> device_;
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
  bool emulate_ = false;  // RESILIENT_COMM_NCCL_EMULATE=1 on resilient_nccl
  bool coalescing_ = false;                  // between startCoalescing and endCoalescing; guarded by mu_
  std::vector<Task> coalescedHost_;          // guarded by mu_
  std::vector<DeviceOp> coalescedDevice_;    // guarded by mu_
};

}  // namespace resilient_comm
