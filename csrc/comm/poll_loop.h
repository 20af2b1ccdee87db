// pollUntil: the one back-off loop behind every "wait until the library or the device says so"
// of the vendor transports (op completion, init settling, waitReady, a contended handle).
//
// Threads: any; it only sleeps on the AbortToken, so abort() wakes it at once.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"

namespace resilient_comm {

struct Backoff {
  std::chrono::microseconds first;  // the first pause
  std::chrono::microseconds cap;    // pauses double up to this
  // Yield instead of sleeping for this long first: for results that usually come within a
  // timed sleep's slack (~50 us), such as an NCCL launch settling.
  std::chrono::microseconds spin{0};
};

// Calls `step` until it returns true (-> Ok) or fails (-> its Status). The step runs before abort
// and the deadline are checked, so a result that is already there wins over both. An abort
// returns kAborted ("communicator aborted: <reason>"), the deadline kTimeout with `timeoutText`.
inline Status pollUntil(const std::function<Result<bool>()>& step, const Deadline& dl, AbortToken& abort,
                        Backoff backoff, const std::string& timeoutText) {
  std::chrono::microseconds pause = backoff.first;
  const auto spinUntil = std::chrono::steady_clock::now() + backoff.spin;
  for (;;) {
    Result<bool> r = step();
    if (!r.isOk()) {
      return r.status();
    }
    if (r.value()) {
      return Status::ok();
    }
    if (abort.aborted()) {
      return Status(StatusCode::kAborted, "communicator aborted: " + abort.reason());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout, timeoutText);
    }
    if (backoff.spin.count() > 0 && std::chrono::steady_clock::now() < spinUntil) {
      std::this_thread::yield();
      continue;
    }
    abort.waitFor(pause);
    pause = std::min(pause * 2, backoff.cap);
  }
}

}  // namespace resilient_comm
