#include "transport/tcp/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/check.h"
#include "common/env.h"
#include "common/logging.h"
#include "transport/tcp/auth.h"
#include "transport/tcp/transfer.h"
#include "transport/tcp/wire.h"

namespace resilient_comm::tcp {

namespace {

constexpr uint32_t kOfferMagic = 0x52434d32;  // "RCM2" (with the liveness lock)
constexpr uint64_t kRingMagic = 0x52434d52494e4731ULL;
constexpr size_t kDataOffset = 4096;
// Up to 8 MiB per direction, and in all at most ~64 MiB of rings per process in a large group
// (pages are touched only by the pairs that carry large messages; an all_to_all touches all).
constexpr uint64_t kMaxCapacity = 8u << 20;
constexpr uint64_t kMinCapacity = 1u << 20;
constexpr uint64_t kRingBudget = 64u << 20;
// Published (and freed) in pieces of this size, so the other side starts copying while this
// one goes on. Not less: a reader right behind the writer takes the lines out of the writer's
// cache one by one, several times slower than from the shared cache (measured on a 2-vCPU
// EPYC: 2 GB/s with 256 KiB pieces, 5-6 GB/s with 1 MiB; benchmarks/results/collectives.md).
constexpr size_t kChunk = 1024 * 1024;

// A quarter of the ring at most, so that the writer fills one piece while the reader empties
// another.
size_t chunkFor(uint64_t capacity) {
  return std::min<uint64_t>(kChunk, capacity / 4);
}
constexpr size_t kHdr = sizeof(WireHeader);
constexpr uint64_t kAlign = 64;

uint64_t alignUp(uint64_t v) {
  return (v + kAlign - 1) & ~(kAlign - 1);
}

std::string lastError(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

uint64_t inode(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

}  // namespace

struct ShmLink::Ring {
  uint64_t magic;
  uint64_t cookie;
  uint64_t capacity;
  uint64_t pad0[5];
  std::atomic<uint64_t> head;  // bytes published, written by the sender
  uint64_t pad1[7];
  std::atomic<uint64_t> tail;  // bytes consumed, written by the receiver
  uint64_t pad2[7];

  char* data() {
    return reinterpret_cast<char*>(this) + kDataOffset;
  }
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "ring counters are shared between processes");
static_assert(sizeof(ShmLink::Offer) == 112, "the offer is part of the wire format");

bool shmEnabled() {
  return env::getInt(env::Knob::kShm) != 0;
}

ShmLink::~ShmLink() {
  if (out_ != nullptr) {
    ::munmap(out_, kDataOffset + outCap_);
  }
  if (in_ != nullptr) {
    ::munmap(in_, kDataOffset + inCap_);
  }
  for (int fd : {memfd_, bellRead_, bellWrite_, peerBell_}) {
    if (fd >= 0) {
      ::close(fd);
    }
  }
}

uint64_t ringCapacity(int peers) {
  uint64_t cap = kMaxCapacity;
  while (cap > kMinCapacity && cap * static_cast<uint64_t>(std::max(peers, 1)) > kRingBudget) {
    cap /= 2;
  }
  return cap;
}

Result<std::unique_ptr<ShmLink>> ShmLink::create(uint64_t capacity) {
  if (capacity < kMinCapacity || (capacity & (capacity - 1)) != 0) {
    return Status(StatusCode::kInvalidArgument, "ring capacity " + std::to_string(capacity) +
                                                    " is not a power of two of at least 1 MiB");
  }
  std::unique_ptr<ShmLink> l(new ShmLink());
  l->memfd_ = ::memfd_create("resilient_comm-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (l->memfd_ < 0) {
    return Status(StatusCode::kInternal, lastError("memfd_create"));
  }
  const size_t len = kDataOffset + capacity;
  if (::ftruncate(l->memfd_, static_cast<off_t>(len)) != 0 ||
      ::fcntl(l->memfd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Status(StatusCode::kInternal, lastError("sizing the ring"));
  }
  void* m = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, l->memfd_, 0);
  if (m == MAP_FAILED) {
    return Status(StatusCode::kInternal, lastError("mmap"));
  }
  l->out_ = static_cast<Ring*>(m);
  l->outCap_ = capacity;
  l->cookie_ = randomNonce();
  l->out_->magic = kRingMagic;
  l->out_->cookie = l->cookie_;
  l->out_->capacity = capacity;
  l->out_->head.store(0);
  l->out_->tail.store(0);
  int fds[2];
  if (::pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0) {
    return Status(StatusCode::kInternal, lastError("pipe2"));
  }
  l->bellRead_ = fds[0];
  l->bellWrite_ = fds[1];
  return l;
}

ShmLink::Offer ShmLink::refusal() {
  Offer o{};
  o.magic = kOfferMagic;
  std::memcpy(o.bootId, bootId().data(), bootId().size());
  o.netns = netNamespace();
  o.liveFd = -1;
  if (const liveness::Held* me = liveness::hold()) {
    o.livePid = me->pid;
    o.liveFd = me->fd;
    o.liveIno = me->ino;
  }
  return o;
}

ShmLink::Offer ShmLink::offer() const {
  Offer o = refusal();
  o.willing = 1;
  o.pid = static_cast<int32_t>(::getpid());
  o.memfd = memfd_;
  o.bell = bellRead_;
  o.memfdIno = inode(memfd_);
  o.bellIno = inode(bellRead_);
  o.capacity = outCap_;
  o.cookie = cookie_;
  return o;
}

Status ShmLink::attach(const Offer& p) {
  auto fail = [](const std::string& why) { return Status(StatusCode::kInternal, why); };
  if (p.capacity < kMinCapacity || p.capacity > (1ULL << 30) || (p.capacity & (p.capacity - 1)) != 0) {
    return fail("its ring's capacity " + std::to_string(p.capacity) + " is invalid");
  }
  const std::string proc = "/proc/" + std::to_string(p.pid) + "/fd/";
  int fd = ::open((proc + std::to_string(p.memfd)).c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return fail(lastError(("open " + proc + std::to_string(p.memfd)).c_str()));
  }
  struct stat st {};
  const size_t len = kDataOffset + p.capacity;
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_ino) != p.memfdIno ||
      static_cast<size_t>(st.st_size) != len || seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    ::close(fd);
    return fail("its ring is not the file it offered (another process, or not sealed)");
  }
  void* m = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) {
    return fail(lastError("mmap"));
  }
  in_ = static_cast<Ring*>(m);
  inCap_ = p.capacity;
  if (in_->magic != kRingMagic || in_->cookie != p.cookie || in_->capacity != p.capacity) {
    return fail("its ring's header does not match its offer");
  }
  tail_ = in_->tail.load(std::memory_order_acquire);
  // Read and write: holding a read end of the peer's pipe ourselves, a write to it never
  // raises SIGPIPE, even once the peer is gone.
  peerBell_ = ::open((proc + std::to_string(p.bell)).c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (peerBell_ < 0) {
    return fail(lastError(("open " + proc + std::to_string(p.bell)).c_str()));
  }
  if (::fstat(peerBell_, &st) != 0 || !S_ISFIFO(st.st_mode) || static_cast<uint64_t>(st.st_ino) != p.bellIno) {
    return fail("its doorbell is not the pipe it offered");
  }
  return Status::ok();
}

void ShmLink::ring() const {
  const char c = 1;
  (void)!::write(peerBell_, &c, 1);  // a full pipe has rung already
}

void ShmLink::drainBell() const {
  char sink[256];
  while (::read(bellRead_, sink, sizeof(sink)) == static_cast<ssize_t>(sizeof(sink))) {
  }
}

Result<size_t> ShmLink::write(const char* src, size_t n) {
  const uint64_t cap = outCap_;  // never the shared copy: the peer can write that
  size_t done = 0;
  uint64_t tail = out_->tail.load(std::memory_order_acquire);
  while (done < n) {
    if (head_ - tail > cap || (tail & (kAlign - 1)) != 0) {
      return Status(StatusCode::kInternal, "corrupt shared-memory ring: the peer freed bytes never sent");
    }
    if (head_ - tail == cap) {
      tail = out_->tail.load(std::memory_order_acquire);
      if (head_ - tail == cap) {
        break;
      }
      continue;
    }
    // Every piece but a message's last is a multiple of kAlign, and the last is padded to one:
    // each message starts aligned, so a reduction can read it in place (consume).
    const size_t c = std::min<uint64_t>({n - done, cap - (head_ - tail), chunkFor(cap)});
    const size_t pos = head_ & (cap - 1);
    const size_t first = std::min<size_t>(c, cap - pos);
    std::memcpy(out_->data() + pos, src + done, first);
    std::memcpy(out_->data(), src + done + first, c - first);
    done += c;
    head_ += done == n ? alignUp(c) : c;
    out_->head.store(head_, std::memory_order_release);
    ring();
  }
  return done;
}

Result<size_t> ShmLink::consume(size_t n, const Sink& sink) {
  const uint64_t cap = inCap_;
  size_t done = 0;
  uint64_t head = in_->head.load(std::memory_order_acquire);
  while (done < n) {
    if (head - tail_ > cap || (head & (kAlign - 1)) != 0) {
      return Status(StatusCode::kInternal, "corrupt shared-memory ring: the peer published more than it holds");
    }
    if (head == tail_) {
      head = in_->head.load(std::memory_order_acquire);
      if (head == tail_) {
        break;
      }
      continue;
    }
    const size_t c = std::min<uint64_t>({n - done, head - tail_, chunkFor(cap)});
    const size_t pos = tail_ & (cap - 1);
    const size_t first = std::min<size_t>(c, cap - pos);
    if (sink) {
      sink(done, in_->data() + pos, first);
      if (c > first) {
        sink(done + first, in_->data(), c - first);
      }
    }
    done += c;
    tail_ += done == n ? alignUp(c) : c;
    in_->tail.store(tail_, std::memory_order_release);
    ring();
  }
  return done;
}

Result<size_t> ShmLink::read(char* dst, size_t n) {
  if (dst == nullptr) {
    return consume(n, nullptr);
  }
  return consume(n, [dst](size_t off, const char* p, size_t len) { std::memcpy(dst + off, p, len); });
}

std::string shmSelfTest() {
  if (!shmEnabled()) {
    return "turned off (RESILIENT_COMM_SHM=0)";
  }
  if (bootId().empty()) {
    return "no boot id (/proc/sys/kernel/random/boot_id)";
  }
  auto a = ShmLink::create(kMinCapacity);
  auto b = ShmLink::create(kMinCapacity);
  if (!a.isOk() || !b.isOk()) {
    return (a.isOk() ? b : a).status().message();
  }
  for (auto [x, y] : {std::pair{&a, &b}, std::pair{&b, &a}}) {
    Status st = x->value()->attach(y->value()->offer());
    if (!st.isOk()) {
      return st.message();
    }
  }
  const std::string msg = "resilient_comm";
  std::string got(msg.size(), '\0');
  auto w = a.value()->write(msg.data(), msg.size());
  auto r = b.value()->read(got.data(), got.size());
  if (!w.isOk() || !r.isOk() || got != msg) {
    return "a message through a ring came back wrong";
  }
  return "";
}

namespace {

WireHeader frame(MsgKind kind, uint64_t bytes, uint64_t tag) {
  WireHeader h{};
  h.magic = kWireMagic;
  h.kind = static_cast<uint8_t>(kind);
  h.bytes = bytes;
  h.tag = tag;
  return h;
}

// The next frame's header from peer `j`, which must be of `kind`: a kError in its place is the
// peer's failure.
Status readFrame(Peer& peer, int j, MsgKind kind, WireHeader* h, const Deadline& dl, const AbortToken& abort) {
  Status st = readAll(peer.sock, h, kHdr, dl, abort);
  if (!st.isOk()) {
    return Status(st.code() == StatusCode::kInternal ? StatusCode::kPeerFailure : st.code(),
                  "rank " + std::to_string(j) + " during the shared-memory setup: " + st.message());
  }
  if (h->magic == kWireMagic && h->kind == static_cast<uint8_t>(MsgKind::kError)) {
    bool clean = false;
    return peerErrorStatus(peer, j, *h, std::string(), &clean);
  }
  const uint64_t want = kind == MsgKind::kShmOffer ? sizeof(ShmLink::Offer) : 0;
  if (h->magic != kWireMagic || h->kind != static_cast<uint8_t>(kind) || h->bytes != want) {
    peer.dirty = true;
    return Status(StatusCode::kMismatch, "rank " + std::to_string(j) +
                                             " sent something else where its shared-memory " +
                                             (kind == MsgKind::kShmOffer ? "offer" : "verdict") + " was due");
  }
  return Status::ok();
}

}  // namespace

Status negotiateShm(std::vector<Peer>& peers, const std::vector<int>& fresh, std::mutex& mu, const Deadline& dl,
                    const AbortToken& abort) {
  struct Pair {
    int peer;
    std::unique_ptr<ShmLink> link;
    bool verdicts = false;  // both willing, on one host
    bool mine = false;      // we attached to the peer's
  };
  std::vector<Pair> pairs;
  const bool willing = shmEnabled() && !bootId().empty();
  const uint64_t capacity = ringCapacity(static_cast<int>(peers.size()) - 1);
  for (int j : fresh) {
    Pair p{j, nullptr};
    if (willing) {
      auto l = ShmLink::create(capacity);
      if (l.isOk()) {
        p.link = l.take();
      } else {
        RC_LOG(kWarning, "no shared memory with rank " << j << ": " << l.status().message());
      }
    }
    struct {
      WireHeader h;
      ShmLink::Offer o;
    } msg{frame(MsgKind::kShmOffer, sizeof(ShmLink::Offer), 0), p.link ? p.link->offer() : ShmLink::refusal()};
    RC_RETURN_IF_ERROR(writeAll(peers[j].sock, &msg, sizeof(msg), dl, abort));
    pairs.push_back(std::move(p));
  }
  for (Pair& p : pairs) {
    WireHeader h{};
    ShmLink::Offer o{};
    RC_RETURN_IF_ERROR(readFrame(peers[p.peer], p.peer, MsgKind::kShmOffer, &h, dl, abort));
    RC_RETURN_IF_ERROR(readAll(peers[p.peer].sock, &o, sizeof(o), dl, abort));
    o.bootId[sizeof(o.bootId) - 1] = '\0';
    const bool sameHost = o.magic == kOfferMagic && !bootId().empty() && bootId() == o.bootId &&
                          o.netns == netNamespace();
    if (sameHost && o.liveFd >= 0 && o.livePid > 0) {
      auto w = liveness::watchPeer(o.livePid, o.liveFd, o.liveIno);
      if (w.isOk()) {
        std::lock_guard<std::mutex> lock(mu);
        peers[p.peer].live = w.take();
      } else {
        RC_LOG(kInfo, "not watching rank " << p.peer << "'s liveness lock: " << w.status().message());
      }
    }
    p.verdicts = p.link != nullptr && o.willing == 1 && sameHost;
    if (p.verdicts) {
      Status st = p.link->attach(o);
      p.mine = st.isOk();
      if (!p.mine) {
        // Info, not a warning: containers on one host share the boot id but not their pid
        // namespaces, and every pair of them would say so (resilient-comm doctor tells why).
        RC_LOG(kInfo, "no shared memory with rank " << p.peer << " (same boot id): " << st.message());
      }
      WireHeader v = frame(MsgKind::kShmVerdict, 0, p.mine ? 1 : 0);
      RC_RETURN_IF_ERROR(writeAll(peers[p.peer].sock, &v, kHdr, dl, abort));
    }
  }
  for (Pair& p : pairs) {
    if (!p.verdicts) {
      continue;
    }
    WireHeader v{};
    RC_RETURN_IF_ERROR(readFrame(peers[p.peer], p.peer, MsgKind::kShmVerdict, &v, dl, abort));
    if (p.mine && v.tag == 1) {
      RC_LOG(kDebug, "shared-memory rings with rank " << p.peer);
      std::lock_guard<std::mutex> lock(mu);
      peers[p.peer].shm = std::move(p.link);
    }
  }
  return Status::ok();
}

}  // namespace resilient_comm::tcp
