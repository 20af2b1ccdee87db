// NcclHandle: one ncclComm_t and the rules for calling into it, shared by its communicator and
// the threads that may outlive it (the reaper running ncclCommAbort, the watchdog polling the
// async error, a shrink's child settling its parent).
//
// [Note: every NCCL call is settled before the next]
// On a non-blocking communicator a call may return ncclInProgress and finish on NCCL's own
// thread; until ncclCommGetAsyncError leaves ncclInProgress, any other call on the communicator
// fails with ncclInvalidArgument (init.cc, ncclCommEnsureReady) and leaves that error behind.
// So a call that returned ncclInProgress leaves the handle unsettled, and the next call first
// polls the async error until it is settled (bounded by the caller's deadline and abort token),
// answering its error if it failed. settle() does the same on demand.
//
// [Note: an abort never waits for a caller, and no caller waits for an abort]
// NCCL calls on one communicator must not overlap, so calls take turns. The turn is a flag
// under a mutex held only to flip it, never across a vendor call. ncclCommAbort, which may block
// for long (or forever on a wedged device), runs on a reaper thread once the turn is free, with
// no lock held; a call arriving after an abort began answers kAborted at once instead of
// queueing behind it, and the watchdog's poll skips a handle that is busy.
//
// [Note: handles NCCL writes late]
// ncclCommSplit and ncclCommShrink write the child's handle from NCCL's own thread when the
// child is ready (init.cc, ncclCommInitRankFunc): the child's slot() is the target, on the heap
// inside the child's handle, and the parent handle keeps the child alive (adopt()) until the
// parent has settled or been aborted, after which NCCL writes nothing more.
//
// Threads: any.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "transport/nccl/nccl_api.h"

namespace resilient_comm::nccl {

class NcclHandle : public std::enable_shared_from_this<NcclHandle> {
 public:
  NcclHandle(std::shared_ptr<NcclApi> api, std::string name) : api_(std::move(api)), name_(std::move(name)) {}

  // The handle NCCL filled in (null until then, and for a split's NOCOLOR).
  ncclComm_t comm() const {
    return __atomic_load_n(&comm_, __ATOMIC_ACQUIRE);
  }
  // The handle, read in turn: no call that may write it runs meanwhile (NCCL's write at the
  // call is a plain store). Null if the turn cannot be had (aborting, or busy past dl).
  ncclComm_t commInTurn(const Deadline& dl, AbortToken& abort);
  // Where NCCL writes this handle (init, or the child of a split, shrink or grow).
  ncclComm_t* slot() {
    return &comm_;
  }

  // Runs fn(comm) in turn, after settling the previous call; kAborted once an abort began.
  // ncclInProgress from fn leaves the handle unsettled. The result is fn's, or the async error
  // of a previous call that failed (unless `evenAfterError`: the calls meant for a failed
  // communicator, revoke and shrink, run all the same).
  Result<ncclResult_t> call(const std::function<ncclResult_t(ncclComm_t)>& fn, const Deadline& dl, AbortToken& abort,
                            bool evenAfterError = false);
  // Settles the previous call: its result (ncclSuccess, or its error).
  Result<ncclResult_t> settle(const Deadline& dl, AbortToken& abort);
  // The async error if the handle is free right now (the watchdog's poll); nullopt when it is
  // busy, aborted or empty.
  std::optional<ncclResult_t> tryAsyncError();
  // ncclCommRevoke, once: the first caller issues it (after the previous call settled, whatever
  // its result), later ones get ncclSuccess. Decided in turn, so a failure noticed by the
  // watchdog and a shrink on the caller's thread never revoke twice (the second would be an
  // ncclInvalidArgument) and the shrink's call always comes after the revoke.
  Result<ncclResult_t> revokeOnce(const Deadline& dl);

  // Starts ncclCommAbort once (later calls do nothing and answer false). With `wait`, waits up
  // to `bound` for it (true if it returned); else returns at once (a stuck abort taints the
  // process either way).
  bool abort(bool wait, std::chrono::milliseconds bound);
  // The owner is done with a healthy communicator: on a reaper thread, ncclCommFinalize, settled
  // within `bound` (peers that are gone never let it settle), then ncclCommDestroy; ncclCommAbort
  // instead if it does not settle or fails. Returns at once; like abort(), only once.
  void finalize(std::chrono::milliseconds bound);
  bool aborting() const;
  // Aborts whatever communicator NCCL wrote into the slot and empties the handle for a fresh
  // init (a child whose native shrink was given up). Only while no other thread uses the handle.
  Status reset(std::chrono::milliseconds bound);
  // Keeps `child` alive until this handle settled or was aborted (see the note above).
  void adopt(std::shared_ptr<NcclHandle> child);

  NcclApi& api() const {
    return *api_;
  }
  const std::string& name() const {
    return name_;
  }

 private:
  // Takes the turn (waiting at most until dl); false with a Status if it cannot.
  Status acquire(const Deadline& dl, AbortToken& abort);
  void releaseTurn();
  // Waits for the turn and keeps it (the abort and finalize jobs).
  void takeTurnForGood();
  // Polls the async error in turn until it leaves ncclInProgress.
  Result<ncclResult_t> settleInTurn(const Deadline& dl, AbortToken& abort);

  std::shared_ptr<NcclApi> api_;
  const std::string name_;
  ncclComm_t comm_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool busy_ = false;
  bool aborting_ = false;
  bool unsettled_ = false;  // the last call returned ncclInProgress and nobody settled it yet
  bool revoked_ = false;    // ncclCommRevoke was issued (in turn)
  std::vector<std::shared_ptr<NcclHandle>> children_;
};

}  // namespace resilient_comm::nccl
