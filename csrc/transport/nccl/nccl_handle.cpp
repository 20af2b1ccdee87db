#include "transport/nccl/nccl_handle.h"

#include <chrono>
#include <thread>

#include "comm/poll_loop.h"
#include "common/check.h"
#include "watchdog/reaper.h"

namespace resilient_comm::nccl {

Status NcclHandle::acquire(const Deadline& dl, AbortToken& abort) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (aborting_) {
      return Status(StatusCode::kAborted, "the NCCL communicator of " + name_ + " is being aborted");
    }
    if (!busy_) {
      busy_ = true;
      return Status::ok();
    }
    if (abort.aborted()) {
      return Status(StatusCode::kAborted, "communicator aborted: " + abort.reason());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout, "the NCCL communicator of " + name_ + " stayed busy until the deadline");
    }
    cv_.wait_for(lock, std::chrono::milliseconds(1));
  }
}

ncclComm_t NcclHandle::commInTurn(const Deadline& dl, AbortToken& abort) {
  if (!acquire(dl, abort).isOk()) {
    return nullptr;
  }
  ncclComm_t c = comm();
  releaseTurn();
  return c;
}

void NcclHandle::takeTurnForGood() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  busy_ = true;  // never released: nothing may call in after an abort or a finalize
}

void NcclHandle::releaseTurn() {
  std::lock_guard<std::mutex> lock(mu_);
  busy_ = false;
  cv_.notify_all();
}

Result<ncclResult_t> NcclHandle::settleInTurn(const Deadline& dl, AbortToken& abort) {
  ncclResult_t async = ncclInProgress;
  ncclResult_t queried = ncclSuccess;
  Status st = pollUntil(
      [&]() -> Result<bool> {
        queried = api_->commGetAsyncError(comm(), &async);
        if (queried != ncclSuccess || async != ncclInProgress) {
          return true;
        }
        if (aborting()) {
          return Status(StatusCode::kAborted, "the NCCL communicator of " + name_ + " is being aborted");
        }
        return false;
      },
      // A launch settles in tens of microseconds (NCCL's launch thread): yield through the first
      // 200 us, then back off.
      dl, abort, Backoff{std::chrono::microseconds(50), std::chrono::microseconds(2000), std::chrono::microseconds(200)},
      "an NCCL call on " + name_ + " did not settle before the deadline");
  if (!st.isOk()) {
    return st;
  }
  if (queried != ncclSuccess) {
    return queried;
  }
  unsettled_ = false;
  std::vector<std::shared_ptr<NcclHandle>> settledChildren;
  {
    std::lock_guard<std::mutex> lock(mu_);
    settledChildren.swap(children_);  // written by now: NCCL is done with their slots
  }
  return async;
}

Result<ncclResult_t> NcclHandle::call(const std::function<ncclResult_t(ncclComm_t)>& fn, const Deadline& dl,
                                      AbortToken& abort, bool evenAfterError) {
  RC_RETURN_IF_ERROR(acquire(dl, abort));
  Result<ncclResult_t> previous = unsettled_ ? settleInTurn(dl, abort) : Result<ncclResult_t>(ncclSuccess);
  if (!previous.isOk() || (previous.value() != ncclSuccess && !evenAfterError)) {
    releaseTurn();
    return previous;
  }
  ncclResult_t r = fn(comm());
  if (r == ncclInProgress) {
    unsettled_ = true;
  }
  releaseTurn();
  return r;
}

Result<ncclResult_t> NcclHandle::revokeOnce(const Deadline& dl) {
  AbortToken none;  // the communicator's own token fired when it failed; the revoke still goes out
  return call(
      [this](ncclComm_t c) {
        if (revoked_ || c == nullptr) {
          return ncclSuccess;
        }
        revoked_ = true;  // in turn: call() holds it
        return api_->commRevoke(c, kNcclRevokeDefault);
      },
      dl, none, /*evenAfterError=*/true);
}

Result<ncclResult_t> NcclHandle::settle(const Deadline& dl, AbortToken& abort) {
  RC_RETURN_IF_ERROR(acquire(dl, abort));
  Result<ncclResult_t> r = comm() == nullptr ? Result<ncclResult_t>(ncclSuccess) : settleInTurn(dl, abort);
  releaseTurn();
  return r;
}

std::optional<ncclResult_t> NcclHandle::tryAsyncError() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ || aborting_ || comm() == nullptr) {
      return std::nullopt;
    }
    busy_ = true;
  }
  ncclResult_t async = ncclSuccess;
  ncclResult_t r = api_->commGetAsyncError(comm(), &async);
  releaseTurn();
  if (r != ncclSuccess) {
    return std::nullopt;
  }
  return async;
}

bool NcclHandle::aborting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return aborting_;
}

Status NcclHandle::reset(std::chrono::milliseconds bound) {
  ncclComm_t c = comm();
  if (c != nullptr && !Reaper::run([api = api_, c] { api->commAbort(c); }, bound, "ncclCommAbort of " + name_)) {
    return Status(StatusCode::kInternal, "ncclCommAbort of the abandoned child of " + name_ + " did not return");
  }
  std::lock_guard<std::mutex> lock(mu_);
  __atomic_store_n(&comm_, static_cast<ncclComm_t>(nullptr), __ATOMIC_RELEASE);
  unsettled_ = false;
  busy_ = false;
  aborting_ = false;
  return Status::ok();
}

void NcclHandle::adopt(std::shared_ptr<NcclHandle> child) {
  std::lock_guard<std::mutex> lock(mu_);
  children_.push_back(std::move(child));
}

bool NcclHandle::abort(bool wait, std::chrono::milliseconds bound) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborting_) {
      return false;
    }
    aborting_ = true;
    cv_.notify_all();
  }
  auto job = [self = shared_from_this()] {
    self->takeTurnForGood();
    if (ncclComm_t c = self->comm()) {
      self->api_->commAbort(c);
    }
    std::vector<std::shared_ptr<NcclHandle>> children;
    std::lock_guard<std::mutex> lock(self->mu_);
    children.swap(self->children_);
  };
  const std::string what = "ncclCommAbort of " + name_;
  if (wait) {
    return Reaper::run(job, bound, what);
  }
  Reaper::start(job, bound, what);
  return true;
}

void NcclHandle::finalize(std::chrono::milliseconds bound) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborting_) {
      return;
    }
    aborting_ = true;
    cv_.notify_all();
  }
  auto job = [self = shared_from_this(), bound] {
    self->takeTurnForGood();
    ncclComm_t c = self->comm();
    if (c == nullptr) {
      return;
    }
    NcclApi& api = *self->api_;
    ncclResult_t r = api.commFinalize(c);
    Deadline dl = Deadline::after(bound);
    while (r == ncclInProgress || r == ncclSuccess) {
      ncclResult_t async = ncclSuccess;
      if (api.commGetAsyncError(c, &async) != ncclSuccess) {
        r = ncclInternalError;
        break;
      }
      if (async != ncclInProgress) {
        r = async;
        break;
      }
      if (dl.passed()) {
        r = ncclInProgress;  // peers gone: it will never settle
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (r == ncclSuccess) {
      api.commDestroy(c);
    } else {
      api.commAbort(c);
    }
  };
  Reaper::start(job, 2 * bound, "finalizing the NCCL communicator of " + name_);
}

}  // namespace resilient_comm::nccl
