// AbortToken: the one flag every blocking loop of a communicator polls.
//
// Any thread may call abort(); the first reason wins and is kept. Waiters that sleep on
// something other than a socket (store polls, the backend's queue) use waitFor(), which
// returns early when the token fires. Sockets are woken by the communicator, which shuts
// them down when it aborts.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <mutex>
#include <string>

namespace resilient_comm {

class AbortToken {
 public:
  // Returns true if this call was the one that fired the token.
  bool abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.load(std::memory_order_relaxed)) {
      return false;
    }
    reason_ = reason;
    aborted_.store(true, std::memory_order_release);
    cv_.notify_all();
    return true;
  }
  bool aborted() const {
    return aborted_.load(std::memory_order_acquire);
  }
  std::string reason() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }
  // Sleeps up to `d`; returns true at once if the token fired. Not a synchronisation
  // primitive: callers re-check their own condition after it returns.
  bool waitFor(std::chrono::microseconds d) const {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, d, [this] { return aborted_.load(std::memory_order_relaxed); });
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::atomic<bool> aborted_{false};
  std::string reason_;
};

// StateSignal: wakes threads waiting for a communicator's state to change (waitReady), instead
// of having them poll. A waiter reads generation(), checks the state, then waitChange()s; a
// change made in between is not missed.
class StateSignal {
 public:
  uint64_t generation() const {
    std::lock_guard<std::mutex> lock(mu_);
    return gen_;
  }
  void notify() {
    std::lock_guard<std::mutex> lock(mu_);
    ++gen_;
    cv_.notify_all();
  }
  // Returns when the generation moved past `seen`, or after `d`.
  void waitChange(uint64_t seen, std::chrono::microseconds d) const {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, d, [&] { return gen_ != seen; });
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t gen_ = 0;
};

}  // namespace resilient_comm
