// The shared-memory rings of the TCP transport (transport/tcp/shm.h) on their own: messages of
// every size through a ring that wraps, offers that must be refused (a file that is not the
// one offered, a capacity out of range, a doorbell that is not a pipe), and counters a broken
// or hostile peer scribbled on, which are errors and never a read or write out of the ring.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "transport/tcp/shm.h"

using namespace resilient_comm;
using namespace resilient_comm::tcp;

namespace {

struct Pair {
  std::unique_ptr<ShmLink> a, b;  // a sends to b through a's ring
};

Pair attached() {
  auto a = ShmLink::create(ringCapacity(1));
  auto b = ShmLink::create(ringCapacity(1));
  CHECK(a.isOk() && b.isOk());
  Pair p{a.take(), b.take()};
  Status st = p.b->attach(p.a->offer());
  CHECK(st.isOk()) << st.toString();
  st = p.a->attach(p.b->offer());
  CHECK(st.isOk()) << st.toString();
  return p;
}

// The header words of the ring behind `offer` (magic, cookie, capacity, ..., head at word 8,
// tail at word 16), mapped through /proc like a peer would.
struct Scribbler {
  explicit Scribbler(const ShmLink::Offer& o) {
    int fd = ::open(("/proc/self/fd/" + std::to_string(o.memfd)).c_str(), O_RDWR);
    CHECK(fd >= 0);
    words = static_cast<std::atomic<uint64_t>*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    ::close(fd);
  }
  ~Scribbler() {
    ::munmap(words, 4096);
  }
  std::atomic<uint64_t>* words;
};

}  // namespace

TEST(shm_messages_of_every_size_cross_a_wrapping_ring_intact) {
  Pair p = attached();
  std::mt19937 gen(7);
  std::vector<char> src(3 << 20), dst(3 << 20);
  for (char& c : src) {
    c = static_cast<char>(gen());
  }
  size_t moved = 0;
  const std::vector<size_t> sizes = {1, 63, 64, 65, 4097, 1 << 20, 3 << 20, 777777, 5};
  for (size_t i = 0; i < 3 * sizes.size(); ++i) {  // 14.7 MiB: the 8 MiB ring wraps
    const size_t n = sizes[i % sizes.size()];
    size_t sent = 0, got = 0;
    while (got < n) {  // the writer runs ahead as far as the ring lets it
      auto w = p.a->write(src.data() + sent, n - sent);
      CHECK(w.isOk()) << w.status().toString();
      sent += w.value();
      auto r = p.b->read(dst.data() + got, n - got);
      CHECK(r.isOk()) << r.status().toString();
      got += r.value();
      CHECK(w.value() + r.value() > 0) << "no progress at " << got << " of " << n;
    }
    CHECK(std::memcmp(src.data(), dst.data(), n) == 0) << "message of " << n << " bytes came out wrong";
    moved += n;
  }
  CHECK(moved > (8u << 20)) << "the ring never wrapped";
}

TEST(shm_pieces_handed_to_a_sink_are_aligned_to_elements) {
  Pair p = attached();
  std::vector<float> src(300001), sum(300001, 1.0f);
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<float>(i % 97);
  }
  const size_t bytes = src.size() * sizeof(float);
  // A 1-byte message first: the next one still starts aligned.
  char one = 'x';
  CHECK(p.a->write(&one, 1).value() == 1);
  CHECK(p.b->read(&one, 1).value() == 1);
  size_t sent = 0, got = 0;
  while (got < bytes) {
    sent += p.a->write(reinterpret_cast<const char*>(src.data()) + sent, bytes - sent).value();
    auto r = p.b->consume(bytes - got, [&](size_t off, const char* ptr, size_t len) {
      CHECK((got + off) % sizeof(float) == 0 && len % sizeof(float) == 0) << "a piece splits an element";
      const float* f = reinterpret_cast<const float*>(ptr);
      for (size_t i = 0; i < len / sizeof(float); ++i) {
        sum[(got + off) / sizeof(float) + i] += f[i];
      }
    });
    got += r.value();
  }
  for (size_t i = 0; i < src.size(); ++i) {
    CHECK(sum[i] == 1.0f + src[i]) << "element " << i;
  }
}

TEST(shm_rings_shrink_as_the_group_grows) {
  CHECK(ringCapacity(1) == (8u << 20) && ringCapacity(7) == (8u << 20));
  CHECK(ringCapacity(15) == (4u << 20) && ringCapacity(63) == (1u << 20) && ringCapacity(16383) == (1u << 20));
  CHECK(!ShmLink::create(3u << 20).isOk() && !ShmLink::create(4096).isOk());
}

TEST(shm_offers_that_are_not_what_they_claim_are_refused) {
  auto a = ShmLink::create(ringCapacity(1)).take();
  auto b = ShmLink::create(ringCapacity(1)).take();
  const ShmLink::Offer good = a->offer();
  auto refused = [&](ShmLink::Offer o, const std::string& why) {
    auto fresh = ShmLink::create(ringCapacity(1)).take();
    Status st = fresh->attach(o);
    CHECK(!st.isOk()) << "accepted an offer with " << why;
    return st.message();
  };
  ShmLink::Offer o = good;
  o.memfdIno ^= 1;  // a recycled fd number now naming another file
  CHECK(refused(o, "the wrong inode").find("not the file it offered") != std::string::npos);
  o = good;
  o.capacity = 3u << 20;  // not a power of two
  CHECK(refused(o, "a bad capacity").find("capacity") != std::string::npos);
  o = good;
  o.capacity = 1ULL << 40;
  refused(o, "a huge capacity");
  o = good;
  o.cookie ^= 1;  // the file is right, the ring is someone else's
  CHECK(refused(o, "the wrong cookie").find("does not match") != std::string::npos);
  o = good;
  o.bell = good.memfd;  // a doorbell that is a regular file
  o.bellIno = good.memfdIno;
  CHECK(refused(o, "a doorbell that is no pipe").find("not the pipe") != std::string::npos);
  o = good;
  o.pid = 0x3fffffff;  // no such process
  refused(o, "a pid that does not exist");
  // And the real offer still works.
  CHECK(b->attach(good).isOk());
}

TEST(shm_corrupt_counters_are_errors_not_overruns) {
  Pair p = attached();
  Scribbler ring(p.a->offer());  // a's ring: a writes head, b writes tail
  char buf[256] = {};
  CHECK(p.a->write(buf, sizeof(buf)).value() == sizeof(buf));
  ring.words[8].store(ring.words[8].load() + (64u << 20));  // head far past what the ring holds
  auto r = p.b->read(buf, sizeof(buf));
  CHECK(!r.isOk() && r.status().message().find("corrupt") != std::string::npos) << "read past the ring";
  ring.words[2].store(1ULL << 40);  // the shared copy of the capacity: never trusted
  ring.words[8].store(ring.words[8].load() - (64u << 20));
  CHECK(p.b->read(buf, sizeof(buf)).isOk());
  CHECK(p.a->write(buf, sizeof(buf)).isOk());
  ring.words[16].store(1ULL << 50);  // tail past anything ever sent
  auto w = p.a->write(buf, sizeof(buf));
  CHECK(!w.isOk() && w.status().message().find("corrupt") != std::string::npos) << "wrote over unread bytes";
}
