// Backstop: runs, on a thread of its own, the work that no caller claimed in time.
//
// [Note: a build runs on the first thread that needs it]
// Creating, shrinking, splitting or growing a communicator returns at once; connecting its
// mesh (the build) happens later. The first thread that needs the communicator and will wait
// for the whole build (an op, or waitReady() with a deadline no earlier than the build's)
// runs the build itself, so the common path (shrink, then the first collective) starts no
// thread and hands nothing between threads. A communicator nobody waits on must still get
// built, because its peers are waiting for it: so every build is also handed to the backstop,
// which starts a thread for it if it is still unclaimed after a short grace. A waiter with an
// earlier deadline than the build's starts that thread at once instead, and waits on it.
//
// One process-wide thread keeps the timers; it only ever starts threads, never runs a task
// itself, so one long build cannot hold up another. A forked child starts afresh: the parent's
// pending tasks are not its own.
#pragma once

#include <chrono>
#include <functional>

namespace resilient_comm {

class Backstop {
 public:
  using Clock = std::chrono::steady_clock;

  // At `at`, unless `claimed()` holds by then, calls `run` on a new detached thread. Both
  // functions are called without any lock held; `claimed` on the backstop's own thread.
  // Until `at` the backstop holds both (and what they capture: a communicator lives at
  // least that long).
  static void schedule(Clock::time_point at, std::function<bool()> claimed, std::function<void()> run);
};

}  // namespace resilient_comm
