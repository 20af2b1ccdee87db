#include "comm/pending_op.h"

#include <algorithm>
#include <thread>
#include <utility>

namespace resilient_comm {

PendingOp::PendingOp(uint64_t seq, std::string what, std::shared_ptr<device::DeviceEvent> end, Deadline deadline,
                     std::shared_ptr<void> keep)
    : seq_(seq), what_(std::move(what)), end_(std::move(end)), deadline_(deadline), keep_(std::move(keep)) {}

Status PendingOp::poll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (retired_) {
      return outcome_;
    }
  }
  Result<bool> done = end_->query();
  if (!done.isOk()) {
    settle(done.status().withContext(what_), /*retire=*/true);  // the device will not finish it
  } else if (done.value()) {
    settle(Status::ok(), /*retire=*/true);
  }
  return outcome();
}

void PendingOp::fail(const Status& st) {
  settle(st, /*retire=*/false);
}

Status PendingOp::outcome() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outcome_;
}

bool PendingOp::retired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return retired_;
}

Result<bool> PendingOp::blockCurrentStream() {
  return end_->blockCurrentStream();
}

Status PendingOp::hostWait(const Deadline& dl, AbortToken* abort) {
  // pollUntil's loop (poll_loop.h), but sleeping on the op's own condition variable, so that the
  // watchdog's settle wakes it at once (and with no abort token to wait on for host-only waits).
  // Short ops end within a timed sleep's slack (50 us): yield for the first 200 us, then back off.
  const auto spinUntil = Deadline::Clock::now() + std::chrono::microseconds(200);
  std::chrono::microseconds pause(50);
  for (;;) {
    Status st = poll();
    if (st.code() != StatusCode::kInProgress) {
      return st;
    }
    if (abort != nullptr && abort->aborted()) {
      return Status(StatusCode::kAborted, "communicator aborted: " + abort->reason());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout, what_ + " did not complete on the device before its deadline");
    }
    if (Deadline::Clock::now() < spinUntil) {
      std::this_thread::yield();
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, pause, [&] { return outcome_.code() != StatusCode::kInProgress; });
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void PendingOp::onDone(std::function<void(const Status&)> fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (outcome_.code() == StatusCode::kInProgress) {
    callbacks_.push_back(std::move(fn));
    return;
  }
  Status st = outcome_;
  lock.unlock();
  fn(st);
}

void PendingOp::settle(const Status& st, bool retire) {
  std::vector<std::function<void(const Status&)>> run;
  std::shared_ptr<void> released;
  Status outcome;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (outcome_.code() == StatusCode::kInProgress) {
      outcome_ = st;
      run.swap(callbacks_);
    }
    if (retire && !retired_) {
      retired_ = true;
      released = std::move(keep_);
    }
    outcome = outcome_;
    cv_.notify_all();
  }
  for (auto& fn : run) {
    fn(outcome);
  }
}

}  // namespace resilient_comm
