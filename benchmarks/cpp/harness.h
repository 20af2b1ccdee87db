// Brood: the processes of one benchmark repetition, forked from a single-threaded parent.
//
// Why fork first: the children inherit the parent's address space, so they start in
// microseconds with torch already loaded, and no thread of the parent (the store server's,
// say) is duplicated half-way through a lock. spawn() therefore refuses to run unless the
// calling process has exactly one thread; the parent creates its store only afterwards and
// hands each child the port through its own pipe (release()).
//
// Waiting never hangs: wait() returns when every child has exited, or kills the rest with
// SIGKILL when one exits unexpectedly or the deadline passes. SIGCHLD must be blocked in the
// parent (blockChildSignals(), before any thread exists) so that wait() can sleep in
// sigtimedwait() until the next child exits instead of polling on a timer.
//
// Threads: one thread of the parent owns a Brood and calls everything on it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/status.h"

namespace resilient_comm::bench {

// Blocks SIGCHLD in the calling thread (call once, first thing in main()).
Status blockChildSignals();

// Number of threads of this process, from /proc/self/task.
int threadCount();

class Brood {
 public:
  // What child `index` runs once released; its return value is its exit code.
  using Body = std::function<int(int index, uint16_t port)>;

  // Forks `count` children, each blocked until release(). Children die with the parent.
  static Result<Brood> spawn(int count, const Body& body);

  Brood(Brood&& other) noexcept;
  Brood& operator=(Brood&&) = delete;
  Brood(const Brood&) = delete;
  ~Brood();  // kills and reaps any child still running

  // Hands every child the store's port. A child whose pipe closes without it exits.
  Status release(uint16_t port);

  struct Outcome {
    std::vector<int> status;  // waitpid status per child (valid where exited[i])
    std::vector<bool> exited;
    bool timedOut = false;
    int firstUnexpected = -1;  // index of the child whose exit stopped the wait, or -1
  };
  // Waits for every child. `expected(index, status)` says whether an exit is part of the
  // script; the first one that is not, or the deadline, kills the children still running.
  Outcome wait(const Deadline& dl, const std::function<bool(int, int)>& expected);

 private:
  Brood() = default;
  void killAll();

  std::vector<pid_t> pids_;
  std::vector<int> pipes_;  // write end per child; -1 once released
  std::vector<bool> reaped_;
};

// "exit 0", "killed by SIGKILL", ... for messages.
std::string describeExit(int status);

}  // namespace resilient_comm::bench
