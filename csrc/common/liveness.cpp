#include "common/liveness.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <climits>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>

#include "common/env.h"
#include "common/logging.h"

namespace resilient_comm::liveness {

namespace {

constexpr uint64_t kSlotMagic = 0x52434c4956453031ULL;  // "RCLIVE01"
constexpr size_t kSlotBytes = 4096;
constexpr uint32_t kFree = 0;
constexpr uint32_t kHeld = 1;
constexpr uint32_t kReleasedState = 2;
// How long a watcher looks for signs of the process's exit after the holder ended (the signs
// follow within microseconds of a kill; only an exec lets the whole wait pass).
constexpr int64_t kConfirmNs = 5'000'000;
// Task flags (include/linux/sched.h), shown in /proc/PID/stat's 9th field.
constexpr unsigned long kPfExiting = 0x4;
constexpr unsigned long kPfDumpcore = 0x200;
constexpr unsigned long kPfSignaled = 0x400;
constexpr unsigned long long kSigkillBit = 1ULL << (9 - 1);

// The shared page. Everything in it can be written by any process that maps it: read with care.
struct Slot {
  uint64_t magic;
  std::atomic<uint32_t> word;   // the robust futex: the holder's tid | FUTEX_WAITERS | FUTEX_OWNER_DIED
  std::atomic<uint32_t> state;  // kFree, kHeld, kReleasedState
  std::atomic<int32_t> pid;     // the holder's process
  std::atomic<int32_t> tid;     // the holder thread
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the futex word is shared between processes");

int64_t monoNs() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t val) {
  // Shared (no FUTEX_PRIVATE_FLAG): the word lives in a mapping of several processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, nullptr, nullptr, 0);
}

void wakeAll(Slot* s) {
  (void)futex(&s->word, FUTEX_WAKE, INT_MAX);
}

std::string lastError(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

// Maps the slot in `fd` after checking it is one (a sealed page); nullptr and `why` if not.
Slot* mapSlot(int fd, std::string* why) {
  struct stat st {};
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != kSlotBytes || seals < 0 ||
      (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    *why = "not a liveness slot (a sealed page)";
    return nullptr;
  }
  void* m = ::mmap(nullptr, kSlotBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    *why = lastError("mmap");
    return nullptr;
  }
  auto* s = static_cast<Slot*>(m);
  if (s->magic != kSlotMagic) {
    ::munmap(m, kSlotBytes);
    *why = "not a liveness slot (its magic)";
    return nullptr;
  }
  return s;
}

uint64_t inodeOf(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// --- the holder --------------------------------------------------------------------------------

// The kernel's robust list ABI (include/uapi/linux/futex.h), for the holder thread alone.
struct RobustEntry {
  RobustEntry* next;
};
struct RobustHead {
  RobustEntry list;
  long futexOffset;
  RobustEntry* pending;
};

struct Holder {
  std::mutex mu;
  std::condition_variable cv;
  Held held;
  Slot* slot = nullptr;
  bool valid = false;     // `held` is this process's (pid checked: a fork's child is not)
  bool releasing = false; // release() asked the holder thread to end
  RobustHead head{};
  RobustEntry entry{};
};

Holder& holder() {
  static Holder* h = new Holder();  // never destroyed: the holder thread may outlive main()
  return *h;
}

// The slot a node agent handed us (kSlotEnv), if it is a fresh slot; else -1.
int inheritedSlot() {
  const char* v = std::getenv(kSlotEnv);
  if (v == nullptr || *v == '\0') {
    return -1;
  }
  int fd = -1;
  unsigned long long ino = 0;
  if (std::sscanf(v, "%d:%llu", &fd, &ino) != 2 || fd < 0 || ::fcntl(fd, F_GETFD) < 0 || inodeOf(fd) != ino) {
    return -1;  // not ours (a process spawned by the worker: the fd is not inherited)
  }
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return fd;
}

// Runs on the holder thread: registers the robust list, takes the word, waits for release().
void holdOn(Holder* h, Slot* s, const std::shared_ptr<std::promise<bool>>& taken) {
  h->entry.next = &h->head.list;
  h->head.list.next = &h->entry;
  h->head.futexOffset = reinterpret_cast<char*>(&s->word) - reinterpret_cast<char*>(&h->entry);
  h->head.pending = nullptr;
  // Replaces glibc's list for this thread alone; it never locks a pthread robust mutex.
  if (::syscall(SYS_set_robust_list, &h->head, sizeof(h->head)) != 0) {
    RC_LOG(kWarning, "no liveness lock: " << lastError("set_robust_list"));
    taken->set_value(false);
    return;
  }
  const auto tid = static_cast<uint32_t>(::syscall(SYS_gettid));
  uint32_t expected = 0;
  if (s->state.load() != kFree || !s->word.compare_exchange_strong(expected, tid)) {
    taken->set_value(false);
    return;
  }
  s->pid.store(static_cast<int32_t>(::getpid()));
  s->tid.store(static_cast<int32_t>(tid));
  s->state.store(kHeld);
  wakeAll(s);  // watchers that started before us
  taken->set_value(true);
  std::unique_lock<std::mutex> lock(h->mu);
  h->cv.wait(lock, [h] { return h->releasing; });
  // release() cleared the word: this thread's exit walks the list and finds nothing of its own.
}

bool takeSlot(Holder* h, int fd) {
  std::string why;
  Slot* s = mapSlot(fd, &why);
  if (s == nullptr) {
    RC_LOG(kWarning, "liveness slot " << fd << ": " << why);
    return false;
  }
  auto taken = std::make_shared<std::promise<bool>>();
  auto done = taken->get_future();
  std::thread(holdOn, h, s, taken).detach();
  if (!done.get()) {
    ::munmap(s, kSlotBytes);
    return false;
  }
  h->slot = s;
  h->held = Held{static_cast<int>(::getpid()), fd, inodeOf(fd)};
  return true;
}

// --- the watcher -------------------------------------------------------------------------------

std::mutex& registryMu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::map<std::pair<int, uint64_t>, std::weak_ptr<Watch>>& registry() {
  static auto* r = new std::map<std::pair<int, uint64_t>, std::weak_ptr<Watch>>();
  return *r;
}

}  // namespace

struct Watch::State {
  Slot* slot = nullptr;
  int pid = 0;
  int efd = -1;
  std::atomic<int> verdict{0};
  std::atomic<int64_t> noticedNs{0};
  std::atomic<bool> stop{false};
  ~State() {
    ::munmap(slot, kSlotBytes);
    ::close(efd);
  }
  void decide(Verdict v, int64_t at) {
    noticedNs.store(at);
    verdict.store(static_cast<int>(v));
    const uint64_t one = 1;
    (void)!::write(efd, &one, sizeof(one));
  }
};

namespace {

// The watch thread: waits on the word until the holder releases it or its thread ends.
void watchOn(std::shared_ptr<Watch::State> st) {
  Slot* s = st->slot;
  while (!st->stop.load()) {
    const uint32_t w = s->word.load();
    if (s->state.load() == kReleasedState) {
      st->decide(Verdict::kReleased, monoNs());
      return;
    }
    if ((w & FUTEX_OWNER_DIED) != 0) {
      const int64_t woke = monoNs();
      wakeAll(s);  // the kernel woke one watcher: this one wakes the others
      const int pid = st->pid;
      while (!exiting(pid)) {
        if (monoNs() - woke > kConfirmNs) {
          st->decide(Verdict::kLost, monoNs());
          return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      st->decide(Verdict::kDied, woke);
      return;
    }
    uint32_t expect = w;
    if ((w & FUTEX_TID_MASK) != 0 && (w & FUTEX_WAITERS) == 0) {
      // Held: ask the kernel to wake us when the holder dies.
      if (!s->word.compare_exchange_strong(expect, w | FUTEX_WAITERS)) {
        continue;
      }
      expect = w | FUTEX_WAITERS;
    }
    // Not yet held (0), or held with waiters: sleep until the word changes.
    (void)futex(&s->word, FUTEX_WAIT, expect);
  }
}

}  // namespace

Result<int> makeSlot() {
  int fd = ::memfd_create("resilient-comm-liveness", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return Status(StatusCode::kInternal, lastError("memfd_create"));
  }
  if (::ftruncate(fd, kSlotBytes) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    Status st(StatusCode::kInternal, lastError("liveness slot"));
    ::close(fd);
    return st;
  }
  void* m = ::mmap(nullptr, kSlotBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    Status st(StatusCode::kInternal, lastError("mmap"));
    ::close(fd);
    return st;
  }
  static_cast<Slot*>(m)->magic = kSlotMagic;
  ::munmap(m, kSlotBytes);
  return fd;
}

const Held* hold() {
  Holder& h = holder();
  std::lock_guard<std::mutex> lock(h.mu);
  const int pid = static_cast<int>(::getpid());
  if (h.valid && h.held.pid == pid) {
    return &h.held;
  }
  if (h.held.pid == pid) {
    return nullptr;  // tried in this process already
  }
  h.held = Held{pid, -1, 0};  // a fork's child forgets its parent's (it holds nothing)
  h.valid = false;
  h.releasing = false;
  if (env::getInt(env::Knob::kLiveness) == 0) {
    return nullptr;
  }
  int fd = inheritedSlot();
  if (fd >= 0 && takeSlot(&h, fd)) {
    h.valid = true;
    return &h.held;
  }
  auto own = makeSlot();
  if (!own.isOk()) {
    RC_LOG(kWarning, "no liveness lock: " << own.status().message());
    return nullptr;
  }
  if (!takeSlot(&h, own.value())) {
    ::close(own.value());
    return nullptr;
  }
  h.valid = true;
  return &h.held;
}

void release() {
  Holder& h = holder();
  {
    std::lock_guard<std::mutex> lock(h.mu);
    if (!h.valid || h.held.pid != static_cast<int>(::getpid())) {
      return;
    }
    h.valid = false;
    h.releasing = true;
    Slot* s = h.slot;
    s->state.store(kReleasedState);  // first: a watcher woken by the cleared word sees why
    s->word.store(0);
    wakeAll(s);
  }
  h.cv.notify_all();
}

const char* verdictName(Verdict v) {
  switch (v) {
    case Verdict::kWatching:
      return "watching";
    case Verdict::kDied:
      return "died";
    case Verdict::kReleased:
      return "released";
    case Verdict::kLost:
      return "lost";
  }
  return "?";
}

Result<std::shared_ptr<Watch>> Watch::open(int fd, int pid) {
  std::string why;
  Slot* s = mapSlot(fd, &why);
  if (s == nullptr) {
    return Status(StatusCode::kInvalidArgument, why);
  }
  auto st = std::make_shared<State>();
  st->slot = s;
  st->pid = pid;
  st->efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (st->efd < 0) {
    return Status(StatusCode::kInternal, lastError("eventfd"));
  }
  std::thread(watchOn, st).detach();
  return std::shared_ptr<Watch>(new Watch(std::move(st)));
}

Watch::~Watch() {
  s_->stop.store(true);
  wakeAll(s_->slot);  // a spurious wake-up for other watchers of the slot, who wait again
}

int Watch::fd() const {
  return s_->efd;
}

int Watch::pid() const {
  return s_->pid;
}

Verdict Watch::verdict() const {
  return static_cast<Verdict>(s_->verdict.load());
}

int64_t Watch::noticedNs() const {
  return s_->noticedNs.load();
}

Deadline Watch::deadAfter(std::chrono::nanoseconds grace) const {
  if (verdict() != Verdict::kDied) {
    return Deadline::never();
  }
  // CLOCK_MONOTONIC, the steady clock's
  return Deadline(Deadline::Clock::time_point(std::chrono::nanoseconds(noticedNs())) + grace);
}

std::string Watch::why() const {
  const std::string who = "process " + std::to_string(s_->pid);
  switch (verdict()) {
    case Verdict::kDied:
      return who + " died: the kernel released its liveness lock as the process exited";
    case Verdict::kReleased:
      return who + " released its liveness lock (a normal exit)";
    case Verdict::kLost:
      return who + "'s liveness lock was released but the process lives on (an exec?)";
    case Verdict::kWatching:
      break;
  }
  return who + " holds its liveness lock (alive)";
}

Result<std::shared_ptr<Watch>> watchPeer(int pid, int fd, uint64_t ino) {
  std::lock_guard<std::mutex> lock(registryMu());
  auto& r = registry();
  const auto key = std::make_pair(pid, ino);
  auto it = r.find(key);
  if (it != r.end()) {
    if (auto w = it->second.lock()) {
      return w;
    }
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int f = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f < 0) {
    return Status(StatusCode::kInternal, lastError("open " + path));
  }
  if (inodeOf(f) != ino) {
    ::close(f);
    return Status(StatusCode::kInternal, path + " is not the liveness slot offered");
  }
  auto w = Watch::open(f, pid);
  ::close(f);
  if (!w.isOk()) {
    return w.status();
  }
  for (auto i = r.begin(); i != r.end();) {  // drop watches nobody holds any more
    i = i->second.expired() ? r.erase(i) : std::next(i);
  }
  r[key] = w.value();
  return w;
}

bool exiting(int pid) {
  const std::string dir = "/proc/" + std::to_string(pid);
  std::ifstream stat(dir + "/stat");
  std::string line;
  if (!std::getline(stat, line)) {
    return true;  // gone (reaped)
  }
  const size_t close = line.rfind(')');
  if (close == std::string::npos) {
    return false;
  }
  std::istringstream rest(line.substr(close + 1));
  std::string state;
  std::string skip;
  unsigned long flags = 0;
  rest >> state >> skip >> skip >> skip >> skip >> skip >> flags;  // ppid pgrp session tty tpgid
  if (state == "Z" || state == "X" || state == "x" || (flags & (kPfExiting | kPfSignaled | kPfDumpcore)) != 0) {
    return true;
  }
  std::ifstream status(dir + "/status");
  while (std::getline(status, line)) {
    if (line.rfind("SigPnd:", 0) == 0 || line.rfind("ShdPnd:", 0) == 0) {
      if ((std::strtoull(line.c_str() + 7, nullptr, 16) & kSigkillBit) != 0) {
        return true;
      }
    }
  }
  return false;
}

const std::string& bootId() {
  static const std::string id = [] {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string s;
    std::getline(f, s);
    return s.size() <= 36 ? s : std::string();  // a UUID
  }();
  return id;
}

uint32_t netNamespace() {
  static const uint32_t ns = [] {
    struct stat st {};
    return ::stat("/proc/self/ns/net", &st) == 0 ? static_cast<uint32_t>(st.st_ino) : 0U;
  }();
  return ns;
}

std::string hostTag() {
  return bootId().empty() ? std::string() : bootId() + "." + std::to_string(netNamespace());
}

std::string entry(int rank) {
  const Held* me = hold();
  if (me == nullptr) {
    return "";
  }
  return std::to_string(rank) + ":" + std::to_string(me->pid) + ":" + std::to_string(me->fd) + ":" +
         std::to_string(me->ino) + ";";
}

Members parse(const std::string& value, int self, int size) {
  Members m;
  m.byRank.resize(static_cast<size_t>(std::max(size, 0)));
  std::istringstream in(value);
  std::string item;
  while (std::getline(in, item, ';')) {
    int rank = -1;
    int pid = 0;
    int fd = -1;
    unsigned long long ino = 0;
    if (std::sscanf(item.c_str(), "%d:%d:%d:%llu", &rank, &pid, &fd, &ino) != 4 || rank < 0 || rank >= size ||
        rank == self || pid <= 0 || fd < 0) {
      continue;  // malformed, or ours: not watched (the transport's own signs still hold)
    }
    auto w = watchPeer(pid, fd, ino);
    if (w.isOk()) {
      m.byRank[static_cast<size_t>(rank)] = w.take();
    } else {
      RC_LOG(kInfo, "not watching rank " << rank << "'s liveness lock: " << w.status().message());
    }
  }
  return m;
}

int Members::died() const {
  for (size_t r = 0; r < byRank.size(); ++r) {
    if (byRank[r] != nullptr && byRank[r]->verdict() == Verdict::kDied) {
      return static_cast<int>(r);
    }
  }
  return -1;
}

Members Members::subset(const std::vector<int>& members) const {
  Members m;
  for (int r : members) {
    m.byRank.push_back(r >= 0 && static_cast<size_t>(r) < byRank.size() ? byRank[static_cast<size_t>(r)] : nullptr);
  }
  return m;
}

}  // namespace resilient_comm::liveness
