// Reaper: runs a possibly-blocking teardown (a vendor abort, a destroy) with a bounded wait.
//
// [Note: a stuck abort never blocks training]
// ncclCommAbort and HcclCommDestroy can block for a long time (or forever on a wedged
// device). Each call runs on its own detached thread; the caller waits at most `bound`.
// If the call has not returned by then it is left running, the process is marked tainted
// (tainted() says why) and the caller goes on. A tainted process should be replaced at the
// next opportunity, but it is never held hostage.
#pragma once

#include <chrono>
#include <functional>
#include <string>

namespace resilient_comm {

class Reaper {
 public:
  // RESILIENT_COMM_ABORT_BOUND_MS: how long an abort is waited for before the caller goes on.
  static std::chrono::milliseconds abortBound();
  // True if fn returned within `bound`.
  static bool run(std::function<void()> fn, std::chrono::milliseconds bound, const std::string& what);
  // Starts fn on its own thread and returns at once (for the watchdog's thread, and destructors,
  // which must not wait at all); if fn has not returned within `bound`, the process is tainted.
  static void start(std::function<void()> fn, std::chrono::milliseconds bound, const std::string& what);
  static bool tainted();
  static std::string taintReason();
};

}  // namespace resilient_comm
