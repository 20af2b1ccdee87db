// NcclCommunicator: the Communicator contract over NCCL (docs/architecture.md).
//
// Lifecycle: create() returns at once in Initializing. An init thread binds the device, exchanges
// the unique id through the store (rank 0 makes it), calls ncclCommInitRankConfig on a
// non-blocking config and settles it (nccl_handle.h) until the communicator is ready, the
// deadline passes or abort() is called; then the communicator is Ready, or Error/Aborted with
// the NCCL message.
//
// Ops are stream-ordered (communicator.h, [Note: stream-ordered communicators]): launch() runs
// on the caller's thread with the communicator's device current (the caller's is restored):
// the communicator's own stream waits for the caller's current stream, the body's NCCL calls go
// into one NCCL group (host work before the first call runs first, after it once the group is
// on the stream), the group is settled, an end event recorded, and the op returned in flight
// (a PendingOp, which holds the op's tensors until the event completes). Several ops may be in
// flight. The watchdog polls them (watchdogPoll): the async error first (an op that "finished"
// on a communicator with a remote error has no trustworthy result), then each end event and
// deadline. A remote error is a PeerFailure, an expired deadline a Timeout, a device error an
// Internal error; each fails the communicator, and every op still in flight gets the error.
// Outside launch() every collective is launched and waited for on the host, so the
// Communicator contract ("returns when done") holds for direct callers.
//
// [Note: a failed NCCL communicator is kept for the shrink]
// A failure (or abort()) ends the communicator for its users at once: every op in flight and
// later fails with the first error. The NCCL communicator itself is not aborted yet, because a
// shrink may follow and needs a parent that is not aborted (ncclCommAbort of a parent also kills
// a child's init through the shared abort flag). Where the library has ncclCommRevoke (2.28.7+)
// it is revoked at once (its kernels stop); with shrink but no revoke (2.27-2.28.6), shrink uses
// NCCL_SHRINK_ABORT, which stops them then; without shrink it is aborted at once. Otherwise it
// is aborted once a shrink's child is ready, or when the communicator is destroyed. A
// communicator that saw an error is never finalized or destroyed, only aborted.
//
// Moves: shrink with ncclCommShrink (after an error: revoke then NCCL_SHRINK_DEFAULT, or
// NCCL_SHRINK_ABORT), split with ncclCommSplit, grow with ncclCommGrow; each child has its own
// stream and handle, its handle written by NCCL into the child's heap slot and settled (parent,
// then child) by the child's init thread, which also holds the parent until the child is ready.
// Where the library lacks a move (features()), a fresh init among the new members with a unique
// id from the store. If a native shrink after an error fails on any survivor, every survivor
// falls back to that fresh init (they agree through a store key), so no survivor waits for a
// shrink the others gave up.
//
// Threads: one thread at a time calls ops, launch() and the moves; abort() from any thread;
// watchdogPoll() from the watchdog's.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "comm/comm_lifecycle.h"
#include "comm/communicator.h"
#include "common/abort_token.h"
#include "common/liveness.h"
#include "device/stream_ops.h"
#include "transport/nccl/nccl_api.h"
#include "transport/nccl/nccl_handle.h"
#include "watchdog/watchdog.h"

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
  // The ncclUniqueId every member already holds (the backend agrees on it over its host
  // communicator after torch's reconfigure, where members share handles, not a store). Empty:
  // rank 0 makes one and the members read it through `store`. Used by create() only.
  std::vector<uint8_t> bootstrapId{};
};

class NcclCommunicator : public CommLifecycle, public Polled, public std::enable_shared_from_this<NcclCommunicator> {
 public:
  // Fails at once if the library cannot do non-blocking init and abort (NCCL < 2.14).
  static Result<std::shared_ptr<NcclCommunicator>> create(std::shared_ptr<NcclApi> api,
                                                          std::shared_ptr<device::StreamOps> streams, NcclOptions opts,
                                                          const Deadline& initDeadline);
  // A joiner of a grow (see Communicator::grow): opts.prefix is the join key, opts.rank and
  // opts.size its rank in and the size of the grown communicator. With opts.bootstrapId (rank
  // 0's growId(), handed over by the caller) it reads nothing from the store.
  static Result<std::shared_ptr<NcclCommunicator>> join(std::shared_ptr<NcclApi> api,
                                                        std::shared_ptr<device::StreamOps> streams, NcclOptions opts,
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
  // Every op of the list in one NCCL group. NCCL has no tags: messages between two ranks match
  // in call order, as on TCP; `feed` is not needed (the group is on the device already).
  Status sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed* feed = nullptr) override;

  Result<std::shared_ptr<Communicator>> shrink(const std::vector<int>& exclude, bool afterError,
                                               const Deadline& dl) override;
  Result<std::shared_ptr<Communicator>> split(int color, int key, const Deadline& dl) override;
  Result<std::shared_ptr<Communicator>> grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                             const std::string& joinKey, const Deadline& dl) override;
  // grow() in two steps, for a caller that hands the id to the joiners itself (the backend,
  // over its host communicator, after torch's reconfigure): rank 0 makes the id
  // (ncclCommGetUniqueId), then every member grows with it (only rank 0's is read). Where the
  // library has no ncclCommGrow (nativeGrow() false) the caller builds afresh instead.
  bool nativeGrow() const {
    return features_.grow;
  }
  Result<std::vector<uint8_t>> growId(const Deadline& dl);
  // `prefix` and `store`: the grown communicator's, for its own later moves.
  Result<std::shared_ptr<Communicator>> growWithId(int newSize, const std::vector<uint8_t>& id,
                                                   const std::string& prefix,
                                                   const c10::intrusive_ptr<c10d::Store>& store, const Deadline& dl);

  bool streamOrdered() const override {
    return true;
  }
  Result<std::shared_ptr<PendingOp>> launch(const std::string& what, const Deadline& dl, std::shared_ptr<void> keep,
                                            const std::function<Status()>& body) override;
  Status onStream(std::function<void()> fn) override;
  bool watchdogPoll() override;

  // Ops launched and not yet retired (for tests).
  size_t inFlight() const;

 private:
  using Plan = std::function<Status(NcclCommunicator&, const Deadline&)>;
  NcclCommunicator(std::shared_ptr<NcclApi> api, std::shared_ptr<device::StreamOps> streams, NcclOptions opts);
  // Another communicator of this library and device, with a stream of its own.
  Result<std::shared_ptr<NcclCommunicator>> makeChild(int rank, int size, std::string prefix,
                                                      c10::intrusive_ptr<c10d::Store> store);
  // Runs `plan` (it ends with the handle filled in, or an error) on a detached init thread with
  // the device bound, settles the handle, moves to Ready or Error, then runs `whenDone`.
  void start(Plan plan, const Deadline& dl, std::function<void()> whenDone = nullptr);
  // A child's plan after its parent's split/shrink call returned: settles the parent (NCCL then
  // wrote the child's handle) and the child. With a `fallbackKey`, a shrink after an error: if
  // another survivor wrote that key (its native shrink failed), gives up the native child
  // (kAborted) so that this survivor falls back with it.
  Status settleChild(NcclCommunicator& parent, const std::string& fallbackKey, const Deadline& dl);
  // Exchanges a unique id under `key` (rank 0 of the new communicator makes it) and starts a
  // non-blocking init.
  Status initWithId(const std::string& key, const Deadline& dl);
  // One NCCL call on this communicator's handle (settling the previous one first), mapped.
  Status call(const char* what, const std::function<ncclResult_t(ncclComm_t)>& fn, const Deadline& dl);
  Status mapError(const char* what, ncclResult_t r);
  // A collective: `calls` inside launch(); outside it, launched and waited for on the host.
  Status collective(const char* op, const Deadline& dl, const std::function<Status()>& calls);
  // One NCCL call of a collective, into launch()'s group (opened by the first one).
  Status enqueue(const char* what, const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& fn, const Deadline& dl);
  // Ends launch()'s group and settles it.
  Status closeGroup(const Deadline& dl);
  Status ready(const Deadline& dl);
  Status fail(const Status& st);
  // Fails every op in flight with the communicator's error and stops issuing (see the Note).
  void finish();
  // The NCCL communicator of a failed or aborted communicator: revoked, kept for a shrink, or
  // aborted (see [Note: a failed NCCL communicator is kept for the shrink]).
  void disposeHandle();
  // A child by a fresh init with a unique id under `prefix` of `store` (where NCCL lacks the move).
  Result<std::shared_ptr<Communicator>> reinit(int rank, int size, const c10::intrusive_ptr<c10d::Store>& store,
                                               const std::string& prefix, const Deadline& dl);

  std::shared_ptr<NcclApi> api_;
  std::shared_ptr<device::StreamOps> streams_;
  NcclOptions opts_;
  NcclFeatures features_;
  AbortToken abort_;
  std::shared_ptr<NcclHandle> handle_;
  std::atomic<bool> disposed_{false};  // disposeHandle() ran
  std::atomic<uint64_t> seq_{0};
  int derived_ = 0;

  // One launch at a time (threads may issue ops on one group, as with ProcessGroupNCCL; NCCL
  // forbids concurrent calls on a communicator). The state below belongs to the launch in
  // progress, on the thread that holds launchMu_ (launchingHere()).
  // Same-host members' liveness locks ([Note: the liveness lock]): the host key written by
  // initWithId, read once the init completed (watchMembers); a native shrink's or grow's child
  // takes its members' from the parent. Read by the watchdog's thread only after that.
  void watchMembers();
  // A PeerFailure once an op is in flight and a member's lock said it died 1 ms ago.
  Status membersAlive(bool busy);
  std::string liveKey_;
  liveness::Members live_;

  std::mutex launchMu_;
  bool groupOpen_ = false;
  std::vector<std::function<void()>> afterGroup_;
  bool launchingHere() const;

  mutable std::mutex opsMu_;
  std::vector<std::shared_ptr<PendingOp>> inflight_;  // guarded by opsMu_
};

}  // namespace resilient_comm::nccl
