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
  entries_.emplace(id, Entry{fireAt, std::move(onExpire)});
  if (fireAt < wakeAt_) {  // only an earlier wake-up needs the thread now (a wake costs the caller)
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

void Watchdog::poll(std::weak_ptr<Polled> p) {
  std::lock_guard<std::mutex> lock(mu_);
  polled_.push_back(std::move(p));
  nextPoll_ = Deadline::Clock::now();
  cv_.notify_one();
}

void Watchdog::kick() {
  std::lock_guard<std::mutex> lock(mu_);
  auto soon = Deadline::Clock::now() + std::chrono::duration_cast<Deadline::Clock::duration>(kBusyPoll);
  if (soon < nextPoll_) {
    nextPoll_ = soon;
    if (soon < wakeAt_) {
      cv_.notify_one();
    }
  }
}

void Watchdog::drain(std::function<bool()> retired) {
  std::lock_guard<std::mutex> lock(mu_);
  draining_.push_back(std::move(retired));
  nextPoll_ = Deadline::Clock::now();
  cv_.notify_one();
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto next = nextPoll_;
    for (const auto& [_, e] : entries_) {
      next = std::min(next, e.fireAt);
    }
    wakeAt_ = next;
    if (next == Deadline::Clock::time_point::max()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, next);
    }
    wakeAt_ = Deadline::Clock::time_point::min();  // awake: nobody needs to wake it
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
    const bool pollDue = now >= nextPoll_;
    std::vector<std::weak_ptr<Polled>> polled;
    std::vector<std::function<bool()>> draining;
    if (pollDue) {
      polled.swap(polled_);
      draining.swap(draining_);
      nextPoll_ = Deadline::Clock::time_point::max();  // a kick() or a registration while polling moves it
    }
    lock.unlock();
    for (auto& fn : fired) {
      fn();
    }
    bool busy = false;
    std::vector<std::weak_ptr<Polled>> keep;
    std::vector<std::function<bool()>> stillDraining;
    for (auto& weak : polled) {
      if (std::shared_ptr<Polled> p = weak.lock()) {
        busy = p->watchdogPoll() || busy;
        keep.push_back(std::move(weak));
      }
    }
    for (auto& retired : draining) {
      if (!retired()) {
        stillDraining.push_back(std::move(retired));
      }
    }
    lock.lock();
    if (pollDue) {
      // Registered while polling: poll them next time too.
      keep.insert(keep.end(), polled_.begin(), polled_.end());
      polled_.swap(keep);
      stillDraining.insert(stillDraining.end(), draining_.begin(), draining_.end());
      draining_.swap(stillDraining);
      const bool busyNow = busy || !draining_.empty();
      if (!polled_.empty() || !draining_.empty()) {
        auto period = busyNow ? std::chrono::duration_cast<Deadline::Clock::duration>(kBusyPoll)
                              : std::chrono::duration_cast<Deadline::Clock::duration>(kIdlePoll);
        nextPoll_ = std::min(nextPoll_, Deadline::Clock::now() + period);
      }
    }
  }
}

}  // namespace resilient_comm
