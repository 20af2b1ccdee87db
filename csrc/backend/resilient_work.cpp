#include "backend/resilient_work.h"

#include <c10/util/Exception.h>

namespace resilient_comm {

ResilientWork::ResilientWork(int rank, c10d::OpType opType, uint64_t seq, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, opType),
      seq_(seq),
      outputs_(std::move(outputs)),
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

bool ResilientWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [this] { return completed_; });
  } else if (!cv_.wait_for(lock, timeout, [this] { return completed_; })) {
    C10_THROW_ERROR(DistBackendError, "Work.wait(" + std::to_string(timeout.count()) +
                                          " ms) timed out; the operation is still pending (sequence number " +
                                          std::to_string(seq_) + ")");
  }
  if (exception_) {
    std::rethrow_exception(exception_);
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> ResilientWork::getFuture() {
  return future_;
}

void ResilientWork::complete(const Status& status) {
  std::exception_ptr err;
  if (!status.isOk()) {
    try {
      C10_THROW_ERROR(DistBackendError, status.toString());
    } catch (...) {
      err = std::current_exception();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
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
