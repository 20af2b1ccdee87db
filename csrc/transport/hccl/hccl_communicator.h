// HcclCommunicator: the Communicator contract over HCCL, for Ascend NPUs (docs/architecture.md).
// Nothing here has run on Ascend hardware; docs/hccl.md says what to check first.
//
// HCCL has neither a non-blocking init nor an abort, so:
//
// [Note: HCCL init runs on an abandoned-able thread]
// create() returns at once in Initializing. A build thread exchanges the root info through the
// store (rank 0 makes it) and calls HcclCommInitRootInfoConfig, which blocks until every rank
// joined. poll() moves the communicator to Ready (or Error) when the thread is done, and to
// Error when the init deadline passes first; waitReady() aborts it at its own deadline. The
// build thread holds only shared state (the CommHandle, the store, the abort token), never the
// communicator: on a timeout or abort it is abandoned, never joined, and whatever HcclComm it
// returns later is destroyed by that thread itself. The caller is never held by it.
//
// [Note: "abort" on HCCL]
// abort() and the first error stop this communicator from issuing (every later call returns the
// recorded error), mark it Aborted/Error, wake its waits, and destroy its HcclComm on the Reaper
// with a bounded wait (HcclCommSuspend first where the library has it): a destroy that never
// returns taints the process and never blocks the caller. In-flight device work cannot be
// cancelled: each communicator gets a stream of its own, so a failed one's stuck work never sits
// in front of its successor's.
//
// [Note: the world communicator outlives its failure]
// A communicator made by root-info init is a world. Shrink and split build a sub-communicator
// with HcclCreateSubCommConfig from the world (no socket setup), naming the members by their
// world ranks; a sub-communicator's own shrink/split also goes to the world. So a world's
// HcclComm is not destroyed when the world communicator fails or is aborted (it stops issuing
// ops all the same): it lives while any communicator derived from it does, and the last one
// destroys it on the Reaper. Where the library lacks HcclCreateSubCommConfig, shrink and split
// build a fresh world through the store, as grow always does (HCCL has no grow).
//
// Threads: as for every Communicator; every HCCL call on one HcclComm is serialized by its
// handle's mutex, taken with the caller's deadline and abort token.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/comm_lifecycle.h"
#include "comm/communicator.h"
#include "comm/device_transport.h"
#include "comm/store_util.h"
#include "common/abort_token.h"
#include "transport/hccl/hccl_api.h"
#include "device/stream_ops.h"

namespace resilient_comm::hccl {

using StreamOps = device::StreamOps;

struct HcclOptions {
  std::string name;
  StorePtr store;
  std::string prefix;  // store key prefix; init adds an incarnation to it
  int rank = 0;
  int size = 1;
  // Makes the stream a communicator enqueues on; every communicator (a shrunk or split one too)
  // takes its own.
  std::function<Result<std::shared_ptr<StreamOps>>()> makeStreams;
  // Binds the calling thread to this communicator's NPU (HCCL's device context is per thread):
  // called on the build thread, on reaper threads before a destroy, and before every op. Must
  // not throw. Empty: nothing to bind (tests).
  std::function<void()> bindDevice;
  // The root info, handed over by the caller (sizeof(HcclRootInfo) bytes, every member the same):
  // create() inits with it and uses no store. Empty: rank 0 makes one and publishes it in the
  // store. After torch's reconfigure the backend broadcasts it over the host communicator.
  std::vector<uint8_t> rootInfo;
};

struct CommHandle;  // one HcclComm, shared with the threads that may outlive its communicator

// What a build thread produces: the HcclComm and, for a world, the hash of its root info.
struct BuiltComm {
  HcclComm comm = nullptr;
  uint64_t worldId = 0;
};

class HcclCommunicator : public CommLifecycle {
 public:
  static Result<std::shared_ptr<HcclCommunicator>> create(std::shared_ptr<HcclApi> api, HcclOptions opts,
                                                          const Deadline& initDeadline);
  // A joiner of a grow (see Communicator::grow): opts.prefix is the join key, opts.rank and
  // opts.size its rank in and the size of the grown communicator.
  static Result<std::shared_ptr<HcclCommunicator>> join(std::shared_ptr<HcclApi> api, HcclOptions opts,
                                                        const Deadline& dl);
  ~HcclCommunicator() override;

  Caps caps() const override;
  uint64_t nextSeq() const override {
    return seq_;
  }

  // Moves an init whose build thread finished, or whose deadline passed, out of Initializing.
  Status poll() override;
  void abort(const std::string& reason) override;

  Status allReduce(void* buf, size_t count, DataType dt, RedOp op, const Deadline& dl) override;
  Status broadcast(void* buf, size_t count, DataType dt, int root, const Deadline& dl) override;
  Status reduce(void* buf, size_t count, DataType dt, RedOp op, int root, const Deadline& dl) override;
  Status allGather(const void* send, void* recv, size_t count, DataType dt, const Deadline& dl) override;
  Status reduceScatter(const void* send, void* recv, size_t count, DataType dt, RedOp op,
                       const Deadline& dl) override;
  Status allToAll(const void* send, const std::vector<size_t>& sendCounts, const std::vector<size_t>& sendDispls,
                  void* recv, const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                  DataType dt, const Deadline& dl) override;
  // All-gather into a scratch buffer on the non-roots (HCCL has no gather): size() times the
  // traffic of a real gather, but no device copy and no send/recv ordering to get wrong.
  Status gather(const void* send, void* recv, size_t count, DataType dt, int root, const Deadline& dl) override;
  Status scatter(const void* send, void* recv, size_t count, DataType dt, int root, const Deadline& dl) override;
  Status barrier(const Deadline& dl) override;
  // One op: HcclSend/HcclRecv. More: HcclBatchSendRecv (kNotSupported without it: HCCL's send
  // and recv block in stream order, so issuing them one by one can deadlock two peers).
  Status sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed* feed = nullptr) override;

  Result<std::shared_ptr<Communicator>> shrink(const std::vector<int>& exclude, bool afterError,
                                               const Deadline& dl) override;
  Result<std::shared_ptr<Communicator>> split(int color, int key, const Deadline& dl) override;
  Result<std::shared_ptr<Communicator>> grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                             const std::string& joinKey, const Deadline& dl) override;

  // The id HcclCreateSubCommConfig gets for a sub-communicator: the same on every member, distinct
  // for every derivation of one world (it hashes the world's root info and the derivation's path).
  static uint64_t subCommId(uint64_t worldId, const std::string& path);

 private:
  HcclCommunicator(std::shared_ptr<HcclApi> api, std::shared_ptr<StreamOps> streams, HcclOptions opts,
                   const Deadline& initDeadline);
  static Result<std::shared_ptr<HcclCommunicator>> make(std::shared_ptr<HcclApi> api, HcclOptions opts,
                                                        const Deadline& initDeadline);

  using Plan = std::function<Result<BuiltComm>(const Deadline&)>;
  // Runs `plan` on a detached build thread that holds only shared state (see the Note above).
  void startBuild(Plan plan);
  // A fresh world of `size` ranks through the root info published under `key`.
  Plan rootInfoPlan(const std::string& key, int rank, int size, StorePtr store) const;
  // A communicator of the world ranks `worldRanks` (this rank is `newRank` of them), from the world.
  Result<std::shared_ptr<Communicator>> derive(int newRank, std::vector<uint32_t> worldRanks, const std::string& tag,
                                               const Deadline& dl);
  // A fresh world through `store`: the child's key prefix is `prefix`, its root info goes under
  // prefix + "uid".
  Result<std::shared_ptr<Communicator>> reinit(int newRank, int newSize, StorePtr store, const std::string& prefix,
                                               const Deadline& dl);
  // True when shrink and split can use HcclCreateSubCommConfig.
  bool canDerive() const;

  // One HCCL call on this communicator's HcclComm, serialized, with its error mapped to a Status.
  Status call(const char* what, const Deadline& dl, const std::function<HcclResult(HcclComm)>& fn);
  // Checks, enqueues `launch` and waits for it.
  Status run(OpKind op, const Deadline& dl, const std::function<HcclResult(HcclComm, aclrtStream)>& launch,
             const char* what);
  Status waitDone(device::DeviceEvent& end, const Deadline& dl);
  Status fail(const Status& st);
  // Gives up this communicator's own HcclComm (see the Notes above); the world's stays.
  void release();

  std::shared_ptr<HcclApi> api_;
  std::shared_ptr<StreamOps> streams_;
  aclrtStream stream_ = nullptr;
  HcclOptions opts_;
  Deadline initDeadline_;
  std::shared_ptr<AbortToken> abort_ = std::make_shared<AbortToken>();  // shared with the build thread
  std::shared_ptr<CommHandle> own_;    // this communicator's HcclComm
  std::shared_ptr<CommHandle> world_;  // the world own_ belongs to (own_ itself for a world)
  std::vector<uint32_t> worldRanks_;   // the world rank of each of this communicator's ranks
  uint64_t seq_ = 0;
  int derived_ = 0;
};

// A fresh root info from `api` (HcclGetRootInfo), as the bytes HcclOptions::rootInfo takes.
Result<std::vector<uint8_t>> makeRootInfo(HcclApi& api);

// The registry entry for `backend`'s NPU tensors: HCCL through libhccl, on the NPU streams c10
// gives (torch_npu must have been imported: it registers the "npu" device). A communicator's
// bootstrap keys are the spec's prefix; its root info the spec's id where the members agreed
// on one (HcclOptions::rootInfo), else rank 0's, through the store.
DeviceTransport hcclTransport(std::string backend);

}  // namespace resilient_comm::hccl
