#include "common/backstop.h"

#include <pthread.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace resilient_comm {

namespace {

struct Entry {
  std::function<bool()> claimed;
  std::function<void()> run;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::multimap<Backstop::Clock::time_point, Entry> pending;
};

// The live state, created with its thread on first use. Replaced (the old one leaked: its
// lock may be held, and its tasks belong to the parent) in a child after fork().
std::mutex g_mu;
State* g_state = nullptr;

void atforkPrepare() {
  g_mu.lock();
  if (g_state != nullptr) {
    g_state->mu.lock();  // so that the child never inherits a half-updated queue
  }
}

void atforkParent() {
  if (g_state != nullptr) {
    g_state->mu.unlock();
  }
  g_mu.unlock();
}

void atforkChild() {
  g_state = nullptr;  // no thread serves it in the child
  g_mu.unlock();
}

void serve(State* s) {
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    if (s->pending.empty()) {
      s->cv.wait(lock);
      continue;
    }
    auto first = s->pending.begin();
    if (Backstop::Clock::now() < first->first) {
      s->cv.wait_until(lock, first->first);
      continue;
    }
    Entry e = std::move(first->second);
    s->pending.erase(first);
    lock.unlock();
    if (!e.claimed()) {
      std::thread(std::move(e.run)).detach();
    }
    e = Entry{};  // release what the functions hold before taking the lock again
    lock.lock();
  }
}

State* state() {
  static bool registered = false;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!registered) {
    registered = true;
    ::pthread_atfork(atforkPrepare, atforkParent, atforkChild);
  }
  if (g_state == nullptr) {
    g_state = new State();
    std::thread(serve, g_state).detach();
  }
  return g_state;
}

}  // namespace

void Backstop::schedule(Clock::time_point at, std::function<bool()> claimed, std::function<void()> run) {
  State* s = state();
  bool soonest = false;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    auto it = s->pending.emplace(at, Entry{std::move(claimed), std::move(run)});
    soonest = it == s->pending.begin();
  }
  if (soonest) {
    s->cv.notify_one();
  }
}

}  // namespace resilient_comm
