// Watchdog: one thread per process that watches the deadline of every in-flight op, and polls
// the device communicators.
//
// Transports enforce their own deadlines (every TCP wait is bounded), so for them the
// watchdog is a backstop; for device transports (NCCL, HCCL), whose kernels cannot poll
// anything, it is the enforcement. An op is watched from the moment it is queued; when its
// deadline plus RESILIENT_COMM_WATCHDOG_GRACE_MS passes before the op is unwatched, the
// watchdog calls the op's expiry callback (which fails the Work and aborts the communicator
// through the Reaper) on its own thread, never on the training thread.
//
// Device communicators (NCCL) register as Polled: the watchdog calls their watchdogPoll() every
// kBusyPoll while they have ops in flight (it queries each op's end event, the communicator's
// async error and the ops' deadlines, and fails the communicator on an error or an expiry),
// and every kIdlePoll when they have none (the async error still: a peer's failure is noticed
// while the group is idle). drain() polls a failed op of a communicator that is gone until its
// device work retires, so that its buffers are held until then.
//
// Threads: watch()/unwatch()/poll()/drain() from any thread; callbacks and polls run on the
// watchdog thread, without the watchdog's lock held.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/deadline.h"

namespace resilient_comm {

class Polled {
 public:
  virtual ~Polled() = default;
  // On the watchdog thread; true while there is work in flight (polled again soon).
  virtual bool watchdogPoll() = 0;
};

class Watchdog {
 public:
  using Id = uint64_t;
  static constexpr std::chrono::microseconds kBusyPoll{500};
  static constexpr std::chrono::milliseconds kIdlePoll{20};

  static Watchdog& instance();

  Id watch(const Deadline& deadline, std::function<void()> onExpire);
  // No-op if the entry already fired or was removed.
  void unwatch(Id id);
  // Ops watched right now (for tests and diagnostics).
  size_t watching() const;
  // Polls `p` until it expires.
  void poll(std::weak_ptr<Polled> p);
  // Calls `retired` at every poll until it answers true.
  void drain(std::function<bool()> retired);
  // Work was just put in flight: poll within kBusyPoll even if the last poll found none.
  void kick();

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
  std::vector<std::weak_ptr<Polled>> polled_;
  std::vector<std::function<bool()>> draining_;
  Deadline::Clock::time_point nextPoll_ = Deadline::Clock::time_point::max();
  // When the sleeping thread wakes up by itself (min while it is awake): a registration due
  // later needs no notify.
  Deadline::Clock::time_point wakeAt_ = Deadline::Clock::time_point::min();
  Id next_ = 1;
  std::chrono::milliseconds grace_;
  std::thread thread_;
};

}  // namespace resilient_comm
