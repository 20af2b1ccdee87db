// A process's death, known before the kernel has torn the process down.
//
// [Note: the liveness lock]
// A SIGKILLed process's sockets close, and its parent's pidfd fires, only at the end of the
// kernel's teardown: do_exit unmaps the whole address space (exit_mm -> mmput -> exit_mmap)
// before it closes a single file (exit_files), and for a process that imported torch that
// unmapping alone takes 40-100 ms (longer with a CUDA context). Earlier in the same exit, each
// dying thread's exit_mm_release walks the thread's robust futex list (futex_exit_release ->
// exit_robust_list): every futex word on it that still holds the thread's id gets
// FUTEX_OWNER_DIED, and a waiter is woken. That is the notice used here: ~1 ms after the kill.
//
// - Each process holds one lock: a futex word in a slot (one sealed memfd page). A thread of
//   our own (the holder) registers a robust list whose one entry points at the word, writes
//   its thread id into the word and then only waits; it never exits while holding it.
// - Watchers (the node agent for its workers, same-host peers for each other) map the slot,
//   set FUTEX_WAITERS and FUTEX_WAIT on the word. The kernel wakes one of them; it wakes the
//   rest. A clean exit (release(), from Python's atexit) marks the slot released first and
//   clears the word, so a normal end is never taken for a death.
// - A released word proves only that the holder *thread* ended without releasing. Which is a
//   death unless the process execs (exec kills the other threads, whose robust lists are walked
//   too). So a watcher checks the process before it says "died": gone, a zombie, a thread of it
//   exiting (PF_EXITING, PF_SIGNALED, PF_DUMPCORE in /proc/PID/stat) or SIGKILL pending for it
//   (/proc/PID/status) -- within a few ms, else "lost": the process lives on (exec), and the
//   watcher falls back to the ordinary signs (pidfd, hang-ups).
// - A SIGSTOPped process stops every thread; nothing is released. A fork's child has no holder
//   thread and its own thread ids: its exit never touches the word, and release() in it is a
//   no-op. A process spawned by a worker takes a slot of its own.
// - Limits: a host that loses power, a kernel that hangs, or a peer on another host release
//   nothing here: the node lease and the transports' own signs still cover those.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/status.h"

namespace resilient_comm::liveness {

// The environment variable through which a node agent hands a worker the slot to hold:
// "FD:INODE" (an inherited fd and the memfd's inode, so a stale or reused fd is never taken).
constexpr const char* kSlotEnv = "RESILIENT_COMM_LIVENESS_SLOT";

// A fresh slot (a memfd of one page, sealed against resizing, close-on-exec): its fd.
Result<int> makeSlot();

// This process's lock, as its peers find it: /proc/<pid>/fd/<fd>, whose inode is `ino`.
struct Held {
  int pid = 0;
  int fd = -1;
  uint64_t ino = 0;
};

// Takes this process's lock, once per process (a fork's child takes its own): in the slot
// named by kSlotEnv when that slot is fresh, else in one of its own. Null where it cannot
// (RESILIENT_COMM_LIVENESS=0, no memfd); the reason is logged once.
const Held* hold();
// Releases it as at a normal exit (watchers see "released"). Only in the process that holds
// it; idempotent.
void release();

enum class Verdict : int {
  kWatching = 0,
  kDied = 1,      // the holder ended without releasing and the process is exiting or gone
  kReleased = 2,  // released by release(): a normal end
  kLost = 3,      // the holder ended but the process lives on (an exec): no verdict here
};
const char* verdictName(Verdict v);

// A watch on one process's lock, by one thread of its own (blocked on the futex). Its fd (an
// eventfd) becomes readable once the verdict is in, and stays so.
class Watch {
 public:
  // Watches the slot in `fd` (mapped here; the caller keeps or closes the fd) held, or to be
  // held, by process `pid`.
  static Result<std::shared_ptr<Watch>> open(int fd, int pid);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  int fd() const;
  int pid() const;
  Verdict verdict() const;
  // CLOCK_MONOTONIC nanoseconds at which the futex woke with the verdict (0 before).
  int64_t noticedNs() const;
  // Once it died: `grace` after the notice (what the process sent before it died may still be
  // arriving until then); never while it has not died.
  Deadline deadAfter(std::chrono::nanoseconds grace) const;
  // What the verdict means, for an error message.
  std::string why() const;

  struct State;

 private:
  explicit Watch(std::shared_ptr<State> s) : s_(std::move(s)) {}
  std::shared_ptr<State> s_;
};

// The one watch of this process on a same-host peer's lock (shared by every communicator that
// talks to that peer): `pid`'s fd `fd`, opened through /proc, which must be inode `ino`.
Result<std::shared_ptr<Watch>> watchPeer(int pid, int fd, uint64_t ino);

// Whether process `pid` is exiting or gone, by /proc (see the note).
bool exiting(int pid);

// This host's boot id ("" if unknown) and this process's network namespace (its inode; 0 if
// unknown). Two processes are on one host for the lock (and the TCP transport's rings) when
// both match: a namespace stands for a host of its own (containers, the tests' "nodes").
const std::string& bootId();
uint32_t netNamespace();

// The watched locks of a communicator's same-host members, by rank (null: another host, no
// lock, or this process), for transports that exchange them through a store (NCCL): each
// member appends its entry() to the key named by hostTag() before the communicator's init;
// once the init completed every member had, and parse() reads the key.
struct Members {
  std::vector<std::shared_ptr<Watch>> byRank;
  // The first member whose lock says it died, or -1.
  int died() const;
  // Those of a communicator derived from this one whose rank i is `members[i]` here.
  Members subset(const std::vector<int>& members) const;
};
std::string hostTag();  // "" when the host cannot be told
std::string entry(int rank);  // "" without a lock
Members parse(const std::string& value, int self, int size);

}  // namespace resilient_comm::liveness
