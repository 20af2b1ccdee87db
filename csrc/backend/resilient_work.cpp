#include "backend/resilient_work.h"

namespace resilient_comm {

ResilientWork::ResilientWork(CommErrorInfo site, c10d::OpType opType, std::vector<at::Tensor> outputs,
                             std::function<void(const std::string&)> abortComm)
    : c10d::Work(site.rank, opType),
      site_(std::move(site)),
      outputs_(std::move(outputs)),
      abortComm_(std::move(abortComm)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

bool ResilientWork::isCompleted() {
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

void ResilientWork::setSeq(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  site_.seq = seq;
}

bool ResilientWork::wait(std::chrono::milliseconds timeout) {
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
  std::string why = "Work.wait(timeout=" + std::to_string(timeout.count()) +
                    " ms) expired before the op finished; the group was aborted";
  complete(Status(StatusCode::kTimeout, why));
  abortComm_(why);
  std::lock_guard<std::mutex> lock(mutex_);
  std::rethrow_exception(exception_);
}

void ResilientWork::abort() {
  std::string why = "Work.abort() called";
  complete(Status(StatusCode::kAborted, why));
  abortComm_(why);
}

c10::intrusive_ptr<c10::ivalue::Future> ResilientWork::getFuture() {
  return future_;
}

void ResilientWork::complete(const Status& status) {
  std::exception_ptr err;
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
  }
  cv_.notify_all();
  if (err) {
    future_->setError(err);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

}  // namespace resilient_comm
