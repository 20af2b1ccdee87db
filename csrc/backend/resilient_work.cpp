#include "backend/resilient_work.h"

#include "common/env.h"

namespace resilient_comm {

ResilientWork::ResilientWork(CommErrorInfo site, c10d::OpType opType, std::vector<at::Tensor> outputs,
                             std::function<void(const std::string&)> abortComm, std::vector<c10::Device> devices)
    : c10d::Work(site.rank, opType),
      site_(std::move(site)),
      outputs_(std::move(outputs)),
      abortComm_(std::move(abortComm)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::move(devices))) {}

void ResilientWork::attach(std::shared_ptr<PendingOp> op, bool hostWaits) {
  op_ = std::move(op);
  hostWaits_ = hostWaits || env::getString(env::Knob::kBlockingWait) == "1";
}

bool ResilientWork::isCompleted() {
  if (op_) {
    Status st = op_->poll();
    if (st.code() != StatusCode::kInProgress) {
      complete(st);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool ResilientWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr ResilientWork::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_;
}

std::vector<at::Tensor> ResilientWork::result() {
  return outputs_;
}

uint64_t ResilientWork::getSequencenumber() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return site_.seq.value_or(0);
}

int ResilientWork::sourceRank() const {
  if (source_ == nullptr) {
    return c10d::Work::sourceRank();  // torch's error: only a recv from any source has one
  }
  int src = source_->load();
  TORCH_CHECK(src >= 0, site_.backend, ": the source rank of a recv from any source is known once it completed; ",
              "wait() for it first");
  return src;
}

void ResilientWork::setSeq(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  site_.seq = seq;
}

void ResilientWork::raiseIfFailed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) {
    std::rethrow_exception(exception_);
  }
}

void ResilientWork::expire(std::chrono::milliseconds timeout) {
  std::string why = "Work.wait(timeout=" + std::to_string(timeout.count()) +
                    " ms) expired before the op finished; the group was aborted";
  complete(Status(StatusCode::kTimeout, why));
  abortComm_(why);
}

void ResilientWork::hostWait(std::chrono::milliseconds timeout) {
  Deadline dl = timeout == kNoTimeout ? Deadline::never() : Deadline::after(timeout);
  Status st = op_->hostWait(dl, nullptr);
  if (st.code() == StatusCode::kTimeout && op_->outcome().code() == StatusCode::kInProgress) {
    expire(timeout);
    return;
  }
  complete(st);
}

bool ResilientWork::wait(std::chrono::milliseconds timeout) {
  // A bad argument is the caller's, not the op's: it must not expire (abort) the group.
  TORCH_CHECK_VALUE(timeout == kNoTimeout || timeout.count() >= 0, "Work.wait: timeout must not be negative, got ",
                    timeout.count(), " ms");
  if (op_) {
    raiseIfFailed();
    if (!hostWaits_) {
      Result<bool> ordered = op_->blockCurrentStream();
      if (!ordered.isOk()) {
        complete(ordered.status());
      } else if (ordered.value()) {
        raiseIfFailed();
        return true;  // the caller's stream waits for the op; the host does not
      }
    }
    hostWait(timeout);
    raiseIfFailed();
    return true;
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    bool done = timeout == kNoTimeout ? (cv_.wait(lock, [this] { return completed_; }), true)
                                      : cv_.wait_for(lock, timeout, [this] { return completed_; });
    if (done) {
      if (exception_) {
        std::rethrow_exception(exception_);
      }
      return true;
    }
  }
  expire(timeout);
  raiseIfFailed();
  return true;
}

void ResilientWork::synchronize() {
  if (op_) {
    hostWait(kNoTimeout);
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return completed_; });
}

void ResilientWork::blockCurrentStream() {
  if (op_) {
    Result<bool> ordered = op_->blockCurrentStream();
    if (ordered.isOk() && ordered.value()) {
      return;
    }
  }
  synchronize();
}

void ResilientWork::abort() {
  std::string why = "Work.abort() called";
  complete(Status(StatusCode::kAborted, why));
  abortComm_(why);
}

c10::intrusive_ptr<c10::ivalue::Future> ResilientWork::getFuture() {
  return future_;
}

void ResilientWork::markFutureReady() {
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (futureSet_) {
      return;
    }
    futureSet_ = true;
    err = exception_;
  }
  if (err) {
    future_->setError(err);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

void ResilientWork::complete(const Status& status) {
  std::exception_ptr err;
  bool setFuture = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) {
      return;
    }
    if (!status.isOk()) {
      CommErrorInfo info = site_;
      info.code = status.code();
      info.cause = status.message();
      err = std::make_exception_ptr(CommException(std::move(info)));
    }
    completed_ = true;
    exception_ = err;
    // A host op's Future completes with it; a device op's is marked from its stream, unless
    // the op failed first.
    setFuture = !futureSet_ && (!op_ || err);
    futureSet_ = futureSet_ || setFuture;
  }
  cv_.notify_all();
  if (!setFuture) {
    return;
  }
  if (err) {
    future_->setError(err);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

}  // namespace resilient_comm
