// NcclCommunicator's moves: shrink, split, grow, and the fresh init they fall back to. See
// [Note: a failed NCCL communicator is kept for the shrink] in nccl_communicator.h.
//
// The NCCL call of a move is made on the caller's thread, in the order the members call their
// ops (NCCL requires the same order on every rank); the child's init thread then settles the
// parent (NCCL writes the child's handle into the child's slot by then) and the child.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <cstring>

#include "comm/bootstrap_id.h"
#include "comm/group_moves.h"
#include "comm/store_util.h"
#include "common/check.h"
#include "transport/nccl/nccl_communicator.h"
#include "watchdog/reaper.h"

namespace resilient_comm::nccl {

namespace {

// How often a survivor settling a native shrink looks for another's fall-back.
constexpr std::chrono::milliseconds kFallbackCheck{10};

}  // namespace

Status NcclCommunicator::settleChild(NcclCommunicator& parent, const std::string& fallbackKey, const Deadline& dl) {
  for (NcclHandle* h : {parent.handle_.get(), handle_.get()}) {
    for (;;) {
      Deadline step = fallbackKey.empty() ? dl : dl.earliest(Deadline::after(kFallbackCheck));
      Result<ncclResult_t> r = h->settle(step, abort_);
      if (r.isOk()) {
        RC_RETURN_IF_ERROR(mapError(h == handle_.get() ? "the child's init" : "the parent's move", r.value()));
        break;
      }
      if (r.status().code() != StatusCode::kTimeout || dl.passed()) {
        return r.status();
      }
      Result<bool> fellBack = storeCheck(opts_.store, fallbackKey);
      if (fellBack.isOk() && fellBack.value()) {
        return Status(StatusCode::kAborted, "another survivor's native shrink failed; falling back with it");
      }
    }
    if (h == parent.handle_.get() && handle_->comm() == nullptr) {
      return Status(StatusCode::kInternal, "NCCL settled the move without writing the child's communicator");
    }
  }
  return Status::ok();
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::reinit(int rank, int size,
                                                               const c10::intrusive_ptr<c10d::Store>& store,
                                                               const std::string& prefix, const Deadline& dl) {
  std::shared_ptr<NcclCommunicator> c;
  RC_ASSIGN_OR_RETURN(c, makeChild(rank, size, prefix, store));
  c->start([](NcclCommunicator& self, const Deadline& d) { return self.initWithId(self.opts_.prefix + "uid", d); },
           dl);
  return std::shared_ptr<Communicator>(c);
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::shrink(const std::vector<int>& exclude, bool afterError,
                                                               const Deadline& dl) {
  ShrinkPlan plan;
  RC_ASSIGN_OR_RETURN(plan, planShrink(exclude, opts_.rank, opts_.size));
  const std::string prefix = opts_.prefix + "shrink" + std::to_string(derived_++) + "/" + plan.survivorList() + "/";
  const bool failed = afterError || state() != CommState::kReady;
  if (failed && markAborted("shrunk after an error")) {
    abort_.abort("shrunk after an error");
    finish();  // its users are done with it; NCCL's communicator is kept for the shrink
  }
  std::shared_ptr<NcclCommunicator> self = shared_from_this();
  AbortToken look;  // this communicator's own token fired if it failed; the look still happens
  const bool native = features_.shrink && handle_->commInTurn(dl, look) != nullptr && !handle_->aborting();
  if (!native) {
    if (failed) {
      disposed_ = true;
      handle_->abort(/*wait=*/false, Reaper::abortBound());
    }
    return reinit(plan.newRank, plan.newSize, opts_.store, prefix, dl);
  }
  std::shared_ptr<NcclCommunicator> child;
  RC_ASSIGN_OR_RETURN(child, makeChild(plan.newRank, plan.newSize, prefix, opts_.store));
  child->live_ = live_.subset(plan.survivors);
  AbortToken none;  // this communicator's own token fired when it failed; its shrink goes ahead
  Status st = Status::ok();
  if (failed && features_.revoke) {  // (the watchdog may have revoked it already: then a no-op)
    Result<ncclResult_t> r = handle_->revokeOnce(dl);
    st = r.isOk() ? mapError("ncclCommRevoke", r.value()) : r.status();
  }
  const int flags = failed && !features_.revoke ? kNcclShrinkAbort : kNcclShrinkDefault;
  if (st.isOk()) {
    handle_->adopt(child->handle_);
    std::vector<int> ex(exclude.begin(), exclude.end());
    ncclConfig_t cfg = nonBlockingConfig();
    Result<ncclResult_t> r = handle_->call(
        [&](ncclComm_t c) {
          return api_->commShrink(c, ex.data(), static_cast<int>(ex.size()), child->handle_->slot(), &cfg, flags);
        },
        dl, failed ? none : abort_, /*evenAfterError=*/failed);
    st = r.isOk() ? mapError("ncclCommShrink", r.value()) : r.status();
  }
  if (!st.isOk() && !failed) {
    return st;  // a healthy group's shrink: the caller sees why
  }
  const std::string fallbackKey = failed ? prefix + "fallback" : "";
  if (!st.isOk()) {
    (void)storeSet(opts_.store, fallbackKey, st.message());  // every survivor falls back with this one
  }
  const bool started = st.isOk();
  child->start(
      [self, started, fallbackKey](NcclCommunicator& c, const Deadline& d) -> Status {
        Status s = started ? c.settleChild(*self, fallbackKey, d) : Status(StatusCode::kAborted, "native shrink failed");
        if (s.isOk() || fallbackKey.empty() || d.passed() || c.abort_.aborted()) {
          return s;
        }
        // The native child is given up on every survivor: aborting the parent stops its init.
        self->disposed_ = true;
        self->handle_->abort(/*wait=*/true, Reaper::abortBound());
        RC_RETURN_IF_ERROR(c.handle_->reset(Reaper::abortBound()));
        return c.initWithId(c.opts_.prefix + "fallback/uid", d);
      },
      dl,
      [self, failed] {
        if (failed) {  // the parent's last use: its NCCL communicator goes now that the child is ready
          self->disposed_ = true;
          self->handle_->abort(/*wait=*/false, Reaper::abortBound());
        }
      });
  return std::shared_ptr<Communicator>(child);
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::split(int color, int key, const Deadline& dl) {
  const std::string prefix = opts_.prefix + "split" + std::to_string(derived_++) + "/";
  RC_RETURN_IF_ERROR(ready(dl));
  std::vector<int> members;
  RC_ASSIGN_OR_RETURN(members, agreeOnMembers(opts_.store, prefix + "ck/", opts_.rank, opts_.size, color, key, dl,
                                              abort_));
  const int newRank = static_cast<int>(std::find(members.begin(), members.end(), opts_.rank) - members.begin());
  const int newSize = static_cast<int>(members.size());
  if (!features_.split) {
    if (color < 0) {
      return std::shared_ptr<Communicator>();
    }
    return reinit(newRank, newSize, opts_.store, prefix + std::to_string(color) + "/", dl);
  }
  std::shared_ptr<NcclCommunicator> child;
  std::shared_ptr<NcclHandle> into;
  if (color >= 0) {
    RC_ASSIGN_OR_RETURN(child, makeChild(newRank, newSize, prefix, opts_.store));
    into = child->handle_;
  } else {
    into = std::make_shared<NcclHandle>(api_, "a split's NOCOLOR");  // NCCL writes NULL there
  }
  handle_->adopt(into);
  ncclConfig_t cfg = nonBlockingConfig();
  RC_RETURN_IF_ERROR(call(
      "ncclCommSplit",
      [&](ncclComm_t c) { return api_->commSplit(c, color >= 0 ? color : kNcclSplitNoColor, key, into->slot(), &cfg); },
      dl));
  if (!child) {
    return std::shared_ptr<Communicator>();  // this rank's next call settles the split
  }
  std::shared_ptr<NcclCommunicator> self = shared_from_this();
  child->start([self](NcclCommunicator& c, const Deadline& d) { return c.settleChild(*self, "", d); }, dl);
  return std::shared_ptr<Communicator>(child);
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                                             const std::string& joinKey, const Deadline& dl) {
  if (newSize <= opts_.size) {
    return Status(StatusCode::kInvalidArgument, "grow: the new size must exceed the current size");
  }
  if (!features_.grow) {
    ++derived_;
    return reinit(opts_.rank, newSize, store, joinKey, dl);  // the joiners init under joinKey too
  }
  std::vector<uint8_t> id;
  if (opts_.rank == 0) {
    RC_ASSIGN_OR_RETURN(id, growId(dl));
    RC_RETURN_IF_ERROR(storeSet(store, joinKey + "uid", hexEncode(id.data(), id.size())));
  }
  return growWithId(newSize, id, joinKey, store, dl);
}

Result<std::vector<uint8_t>> NcclCommunicator::growId(const Deadline& dl) {
  RC_RETURN_IF_ERROR(ready(dl));
  ncclUniqueId id{};
  RC_RETURN_IF_ERROR(call("ncclCommGetUniqueId", [&](ncclComm_t c) { return api_->commGetUniqueId(c, &id); }, dl));
  return std::vector<uint8_t>(id.internal, id.internal + sizeof(id.internal));
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::growWithId(int newSize, const std::vector<uint8_t>& idBytes,
                                                                   const std::string& prefix,
                                                                   const c10::intrusive_ptr<c10d::Store>& store,
                                                                   const Deadline& dl) {
  if (newSize <= opts_.size) {
    return Status(StatusCode::kInvalidArgument, "grow: the new size must exceed the current size");
  }
  if (!features_.grow) {
    return Status(StatusCode::kNotSupported, "NCCL " + api_->versionString() + " has no ncclCommGrow");
  }
  ncclUniqueId id{};
  if (opts_.rank == 0) {
    if (idBytes.size() != sizeof(id.internal)) {
      return Status(StatusCode::kInvalidArgument, "grow: an id of " + std::to_string(idBytes.size()) + " bytes");
    }
    std::memcpy(id.internal, idBytes.data(), sizeof(id.internal));
  }
  ++derived_;
  RC_RETURN_IF_ERROR(ready(dl));
  std::shared_ptr<NcclCommunicator> child;
  RC_ASSIGN_OR_RETURN(child, makeChild(opts_.rank, newSize, prefix, store));
  child->live_ = live_;  // the members it had (the joiners' locks are not known here)
  ncclConfig_t cfg = nonBlockingConfig();
  RC_RETURN_IF_ERROR(call(
      "ncclCommGrow",
      [&](ncclComm_t c) {
        return api_->commGrow(c, newSize, opts_.rank == 0 ? &id : nullptr, -1, child->handle_->slot(), &cfg);
      },
      dl));
  // ncclCommGrow writes the child's handle at the call and finishes it on the child: start()
  // settles it. The child's bootstrap goes through the parent's (bootstrap.cc bootstrapInit), and
  // NCCL's guide destroys the parent only once the grow completed: the plan holds the parent
  // until then, though its group is destroyed as soon as grow() returns.
  std::shared_ptr<NcclCommunicator> self = shared_from_this();
  child->start([self](NcclCommunicator&, const Deadline&) { return Status::ok(); }, dl);
  return std::shared_ptr<Communicator>(child);
}

}  // namespace resilient_comm::nccl
