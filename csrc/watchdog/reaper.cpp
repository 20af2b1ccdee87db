#include "watchdog/reaper.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "common/env.h"
#include "common/logging.h"
#include "watchdog/watchdog.h"

namespace resilient_comm {

namespace {

struct TaintState {
  std::mutex mu;
  std::string reason;
};

TaintState& taint() {
  static TaintState* s = new TaintState();  // leaked: reaper threads may outlive statics
  return *s;
}

struct Completion {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};

void markTainted(const std::string& what, std::chrono::milliseconds bound) {
  std::string reason = what + " did not return within " + std::to_string(bound.count()) + " ms";
  {
    std::lock_guard<std::mutex> tl(taint().mu);
    if (taint().reason.empty()) {
      taint().reason = reason;
    }
  }
  RC_LOG(kError, "process tainted: " << reason << "; leaving it running and carrying on");
}

}  // namespace

std::chrono::milliseconds Reaper::abortBound() {
  return std::chrono::milliseconds(env::getInt(env::Knob::kAbortBoundMs));
}

void Reaper::start(std::function<void()> fn, std::chrono::milliseconds bound, const std::string& what) {
  auto c = std::make_shared<Completion>();
  std::thread([c, fn = std::move(fn)] {
    fn();
    std::lock_guard<std::mutex> lock(c->mu);
    c->done = true;
  }).detach();
  Watchdog::instance().watch(Deadline::after(bound), [c, bound, what] {
    std::lock_guard<std::mutex> lock(c->mu);
    if (!c->done) {
      markTainted(what, bound);
    }
  });
}

bool Reaper::run(std::function<void()> fn, std::chrono::milliseconds bound, const std::string& what) {
  auto c = std::make_shared<Completion>();
  std::thread([c, fn = std::move(fn)] {
    fn();
    std::lock_guard<std::mutex> lock(c->mu);
    c->done = true;
    c->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(c->mu);
  if (c->cv.wait_for(lock, bound, [&] { return c->done; })) {
    return true;
  }
  markTainted(what, bound);
  return false;
}

bool Reaper::tainted() {
  std::lock_guard<std::mutex> lock(taint().mu);
  return !taint().reason.empty();
}

std::string Reaper::taintReason() {
  std::lock_guard<std::mutex> lock(taint().mu);
  return taint().reason;
}

}  // namespace resilient_comm
