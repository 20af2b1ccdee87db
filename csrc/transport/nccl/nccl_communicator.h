// NcclCommunicator: the Communicator contract over NCCL (DESIGN.md §3, NCCL transport).
//
// Lifecycle: create() returns at once in Initializing. An init thread exchanges the unique id
// through the store (rank 0 makes it), calls ncclCommInitRankConfig on a non-blocking config
// and polls ncclCommGetAsyncError until the communicator is ready, the deadline passes or
// abort() is called; then the communicator is Ready, or Error/Aborted with the NCCL message.
//
// Ops: enqueued on this communicator's stream after the caller's current stream, then waited
// for by polling the stream event and ncclCommGetAsyncError, bounded by the op's deadline and
// the abort token. A remote error is a PeerFailure; a deadline a Timeout; both abort the
// communicator. Data-movement ops travel as bytes, so every dtype works; reductions map
// dtypes and ops onto NCCL's (int16 has no NCCL type; bool reduces as uint8 max/min).
//
// [Note: NCCL calls on one communicator are serialized]
// Every call on the handle takes its mutex. ncclCommAbort blocks, so abort() runs it on the Reaper
// with a bounded wait: a stuck abort marks the process tainted and never holds the caller.
// A communicator that saw an error, or whose parent role ended in an abortive shrink, is
// aborted, never Finalized or Destroyed.
//
// Moves: shrink with ncclCommShrink (NCCL_SHRINK_ABORT after an error; the parent is aborted
// afterwards), split with ncclCommSplit, grow with ncclCommGrow; where the library lacks one
// (features()), a fresh init among the new members with a new unique id from the store.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <c10/util/intrusive_ptr.h>

#include "common/abort_token.h"
#include "comm/comm_lifecycle.h"
#include "comm/communicator.h"
#include "transport/nccl/nccl_api.h"
#include "transport/nccl/stream_ops.h"

namespace c10d {
class Store;
}

namespace resilient_comm::nccl {

struct NcclOptions {
  std::string name;
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;  // store key prefix; init adds an incarnation to it
  int rank = 0;
  int size = 1;
};

class NcclCommunicator : public CommLifecycle, public std::enable_shared_from_this<NcclCommunicator> {
 public:
  // Fails at once if the library cannot do non-blocking init and abort (NCCL < 2.14).
  static Result<std::shared_ptr<NcclCommunicator>> create(std::shared_ptr<NcclApi> api,
                                                          std::shared_ptr<StreamOps> streams, NcclOptions opts,
                                                          const Deadline& initDeadline);
  // A joiner of a grow (see Communicator::grow): opts.prefix is the join key, opts.rank and
  // opts.size its rank in and the size of the grown communicator.
  static Result<std::shared_ptr<NcclCommunicator>> join(std::shared_ptr<NcclApi> api,
                                                        std::shared_ptr<StreamOps> streams, NcclOptions opts,
                                                        const Deadline& dl);
  ~NcclCommunicator() override;

  Caps caps() const override;
  uint64_t nextSeq() const override {
    return seq_;
  }

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
  Status gather(const void* send, void* recv, size_t count, DataType dt, int root, const Deadline& dl) override;
  Status scatter(const void* send, void* recv, size_t count, DataType dt, int root, const Deadline& dl) override;
  Status barrier(const Deadline& dl) override;
  Status sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed* feed = nullptr) override;

  Result<std::shared_ptr<Communicator>> shrink(const std::vector<int>& exclude, bool afterError,
                                               const Deadline& dl) override;
  Result<std::shared_ptr<Communicator>> split(int color, int key, const Deadline& dl) override;
  Result<std::shared_ptr<Communicator>> grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                             const std::string& joinKey, const Deadline& dl) override;

 private:
  NcclCommunicator(std::shared_ptr<NcclApi> api, std::shared_ptr<StreamOps> streams, NcclOptions opts);

  // Runs `plan` on a detached thread (it ends with comm_ set, or an error), then polls the
  // communicator ready; moves to Ready, or Error with the failure.
  void start(std::function<Status(NcclCommunicator&, const Deadline&)> plan, const Deadline& dl);
  // Exchanges a unique id under `key` (rank 0 of the new communicator makes it) and starts
  // a non-blocking init.
  Status initWithId(const std::string& key, const Deadline& dl);
  // Polls ncclCommGetAsyncError until it leaves ncclInProgress.
  Status settle(const char* what, const Deadline& dl);
  // One NCCL call on this communicator, serialized, with its error mapped to a Status.
  Status call(const char* what, const std::function<ncclResult_t()>& fn);
  Status mapError(const char* what, ncclResult_t r);
  // Checks, enqueues `launch` (a group of NCCL calls) and waits for it.
  Status run(OpKind op, const Deadline& dl, const std::function<Status()>& launch);
  Status waitDone(uint64_t token, const Deadline& dl);
  Status fail(const Status& st);
  void abortNccl();
  // A child around a communicator NCCL made (split, shrink, grow); `prefix` is its own store
  // key prefix.
  Result<std::shared_ptr<Communicator>> adopt(ncclComm_t child, int rank, int size, const std::string& prefix,
                                              const Deadline& dl);
  // A child by fresh init with a unique id under `prefix` of `store` (where NCCL lacks the move).
  Result<std::shared_ptr<Communicator>> reinit(int rank, int size, const c10::intrusive_ptr<c10d::Store>& store,
                                               const std::string& prefix, const Deadline& dl);

  std::shared_ptr<NcclApi> api_;
  std::shared_ptr<StreamOps> streams_;
  NcclOptions opts_;
  AbortToken abort_;
  // The NCCL handle, shared with reaper threads that may outlive this object.
  struct Handle {
    std::mutex mu;  // serializes NCCL calls on comm
    ncclComm_t comm = nullptr;
    bool aborted = false;  // ncclCommAbort was called; guarded by mu
  };
  std::shared_ptr<Handle> handle_ = std::make_shared<Handle>();
  ncclComm_t& comm_ = handle_->comm;
  uint64_t seq_ = 0;
  int derived_ = 0;
};

}  // namespace resilient_comm::nccl
