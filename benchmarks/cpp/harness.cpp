#include "harness.h"

#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/check.h"

namespace resilient_comm::bench {

namespace {

void closeQuietly(int& fd) {
  if (fd >= 0) {
    ::close(fd);
    fd = -1;
  }
}

// [Note: pre-sized fd table]
// The kernel grows a process's fd table when an fd number outgrows it (first at 64); in a
// multithreaded process the growth waits for an RCU grace period. Here that cost 10-100 ms,
// once per process, and with 16 ranks it fell inside a measured rebuild (whose process then
// held ~64 sockets), or not, depending on the fds the launcher left open. Growing the table
// while the child is still single-threaded keeps that one-off cost out of every measurement.
void presizeFdTable(int fds) {
  int fd = ::dup2(STDERR_FILENO, fds - 1);
  if (fd >= 0) {
    ::close(fd);
  }
}

// The child's side: wait for the port, run the body, exit without running the parent's
// atexit handlers or flushing its copies of the parent's stdio buffers twice.
[[noreturn]] void runChild(int index, int readFd, pid_t parent, const Brood::Body& body) {
  presizeFdTable(1024);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) {
    ::_exit(3);  // the parent died before prctl took effect
  }
  uint16_t port = 0;
  size_t got = 0;
  while (got < sizeof(port)) {
    ssize_t n = ::read(readFd, reinterpret_cast<char*>(&port) + got, sizeof(port) - got);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n == 0 || errno != EINTR) {
      ::_exit(4);  // the parent gave up on this repetition before starting it
    }
  }
  ::close(readFd);
  int rc = body(index, port);
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(rc);
}

}  // namespace

Status blockChildSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  if (::sigprocmask(SIG_BLOCK, &set, nullptr) != 0) {
    return RC_SYS_ERROR("sigprocmask");
  }
  return Status::ok();
}

int threadCount() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) {
    return -1;
  }
  int n = 0;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') {
      ++n;
    }
  }
  ::closedir(dir);
  return n;
}

Result<Brood> Brood::spawn(int count, const Body& body) {
  int threads = threadCount();
  if (threads != 1) {
    return Status(StatusCode::kInternal, "refusing to fork with " + std::to_string(threads) +
                                             " threads in the parent (fork before starting any thread)");
  }
  std::vector<int> readFds(count, -1);
  Brood b;
  b.pipes_.assign(count, -1);
  auto closeAll = [&] {
    for (int i = 0; i < count; ++i) {
      closeQuietly(readFds[i]);
      closeQuietly(b.pipes_[i]);
    }
  };
  for (int i = 0; i < count; ++i) {
    int fds[2];
    if (::pipe(fds) != 0) {
      Status st = RC_SYS_ERROR("pipe");
      closeAll();
      return st;
    }
    readFds[i] = fds[0];
    b.pipes_[i] = fds[1];
  }
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = ::getpid();
  for (int i = 0; i < count; ++i) {
    pid_t pid = ::fork();
    if (pid < 0) {
      Status st = RC_SYS_ERROR("fork");
      closeAll();  // children already forked read EOF and exit; the destructor reaps them
      return st;
    }
    if (pid == 0) {
      for (int j = 0; j < count; ++j) {
        closeQuietly(b.pipes_[j]);
        if (j != i) {
          closeQuietly(readFds[j]);
        }
      }
      runChild(i, readFds[i], parent, body);
    }
    b.pids_.push_back(pid);
    b.reaped_.push_back(false);
  }
  for (int& fd : readFds) {
    closeQuietly(fd);
  }
  return b;
}

Brood::Brood(Brood&& other) noexcept
    : pids_(std::move(other.pids_)), pipes_(std::move(other.pipes_)), reaped_(std::move(other.reaped_)) {
  other.pids_.clear();
  other.pipes_.clear();
  other.reaped_.clear();
}

Brood::~Brood() {
  for (int& fd : pipes_) {
    closeQuietly(fd);
  }
  killAll();
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (!reaped_[i]) {
      int status = 0;
      // Bounded: every child still running was just sent SIGKILL.
      while (::waitpid(pids_[i], &status, 0) < 0 && errno == EINTR) {
      }
      reaped_[i] = true;
    }
  }
}

void Brood::killAll() {
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (!reaped_[i]) {
      ::kill(pids_[i], SIGKILL);
    }
  }
}

Status Brood::release(uint16_t port) {
  for (int& fd : pipes_) {
    ssize_t n = 0;
    do {
      n = ::write(fd, &port, sizeof(port));
    } while (n < 0 && errno == EINTR);
    if (n != static_cast<ssize_t>(sizeof(port))) {
      return RC_SYS_ERROR("write to a child's pipe");
    }
    closeQuietly(fd);
  }
  return Status::ok();
}

Brood::Outcome Brood::wait(const Deadline& dl, const std::function<bool(int, int)>& expected) {
  Outcome out;
  const size_t n = pids_.size();
  out.status.assign(n, 0);
  out.exited.assign(n, false);
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  for (;;) {
    size_t running = 0;
    for (size_t i = 0; i < n; ++i) {
      if (reaped_[i]) {
        continue;
      }
      int status = 0;
      pid_t r = ::waitpid(pids_[i], &status, WNOHANG);
      if (r == pids_[i]) {
        reaped_[i] = true;
        out.exited[i] = true;
        out.status[i] = status;
        if (out.firstUnexpected < 0 && !expected(static_cast<int>(i), status)) {
          out.firstUnexpected = static_cast<int>(i);
        }
      } else {
        ++running;
      }
    }
    if (running == 0) {
      return out;
    }
    if (out.firstUnexpected >= 0 || dl.passed()) {
      out.timedOut = out.firstUnexpected < 0;
      killAll();
      for (size_t i = 0; i < n; ++i) {
        if (!reaped_[i]) {
          int status = 0;
          while (::waitpid(pids_[i], &status, 0) < 0 && errno == EINTR) {
          }
          reaped_[i] = true;
        }
      }
      return out;
    }
    // Sleep until some child changes state (or the deadline); SIGCHLD is blocked, so one
    // that exited between the waitpid() above and here is still pending and wakes us at once.
    int ms = dl.remainingMs(1000);
    timespec ts{ms / 1000, (ms % 1000) * 1000000L};
    ::sigtimedwait(&chld, nullptr, &ts);
  }
}

std::string describeExit(int status) {
  if (WIFEXITED(status)) {
    return "exit " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return std::string("killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           ::strsignal(WTERMSIG(status)) + ")";
  }
  return "status " + std::to_string(status);
}

}  // namespace resilient_comm::bench
