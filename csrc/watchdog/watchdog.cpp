#include "watchdog/watchdog.h"

#include <vector>

#include "common/env.h"

namespace resilient_comm {

Watchdog& Watchdog::instance() {
  // Leaked on purpose: the thread must outlive every backend, including ones torn down
  // during interpreter exit.
  static Watchdog* w = new Watchdog();
  return *w;
}

Watchdog::Watchdog() : grace_(std::chrono::milliseconds(env::getInt(env::Knob::kWatchdogGraceMs))) {
  thread_ = std::thread([this] { loop(); });
  thread_.detach();
}

Watchdog::Id Watchdog::watch(const Deadline& deadline, std::function<void()> onExpire) {
  std::lock_guard<std::mutex> lock(mu_);
  Id id = next_++;
  auto fireAt = deadline.isNever() ? Deadline::Clock::time_point::max() : deadline.at() + grace_;
  bool earliest = true;
  for (const auto& [_, e] : entries_) {
    if (e.fireAt <= fireAt) {
      earliest = false;
      break;
    }
  }
  entries_.emplace(id, Entry{fireAt, std::move(onExpire)});
  if (earliest) {
    cv_.notify_one();
  }
  return id;
}

void Watchdog::unwatch(Id id) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(id);
}

size_t Watchdog::watching() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto next = Deadline::Clock::time_point::max();
    for (const auto& [_, e] : entries_) {
      next = std::min(next, e.fireAt);
    }
    if (next == Deadline::Clock::time_point::max()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, next);
    }
    auto now = Deadline::Clock::now();
    std::vector<std::function<void()>> fired;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.fireAt <= now) {
        fired.push_back(std::move(it->second.onExpire));
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
    lock.unlock();
    for (auto& fn : fired) {
      fn();
    }
    lock.lock();
  }
}

}  // namespace resilient_comm
