// Watchdog: one thread per process that watches the deadline of every in-flight op.
//
// Transports enforce their own deadlines (every TCP wait is bounded), so for them the
// watchdog is a backstop; for device transports (NCCL, HCCL), whose kernels cannot poll
// anything, it is the enforcement. An op is watched from the moment it is queued; when its
// deadline plus RESILIENT_COMM_WATCHDOG_GRACE_MS passes before the op is unwatched, the
// watchdog calls the op's expiry callback (which fails the Work and aborts the communicator
// through the Reaper) on its own thread, never on the training thread.
//
// Threads: watch()/unwatch() from any thread; callbacks run on the watchdog thread, without
// the watchdog's lock held.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "common/deadline.h"

namespace resilient_comm {

class Watchdog {
 public:
  using Id = uint64_t;

  static Watchdog& instance();

  Id watch(const Deadline& deadline, std::function<void()> onExpire);
  // No-op if the entry already fired or was removed.
  void unwatch(Id id);
  // Ops watched right now (for tests and diagnostics).
  size_t watching() const;

 private:
  Watchdog();
  void loop();

  struct Entry {
    Deadline::Clock::time_point fireAt;
    std::function<void()> onExpire;
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<Id, Entry> entries_;
  Id next_ = 1;
  std::chrono::milliseconds grace_;
  std::thread thread_;
};

}  // namespace resilient_comm
