// Fuzzing the TCP transport's two parsers with seeded random and mutated input (issue #16):
//   - the frame parser (Transfer): a peer's stream carries a random blob, a valid frame with
//     bytes flipped, a header with a random size or kind, an error frame with a random length,
//     a frame cut short, or a mutated confirmation. The op must end at once with success (only
//     for a frame that is exactly what it expects) or a clear error, never a crash, a hang or a
//     read past its buffer (the ASan build runs this too: scripts/sanitize.sh).
//   - the Hello path: while rank 0 builds, strangers connect to its listener with random bytes,
//     Hellos with random fields, mutated copies of the real rank's Hello, or a partial Hello
//     held open. The build must take the real rank 1, soon, and the first op must be right.
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "tcp_rig.h"
#include "transport/tcp/auth.h"
#include "transport/tcp/mesh.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_communicator.h"
#include "transport/tcp/transfer.h"
#include "transport/tcp/wire.h"

using namespace resilient_comm;
using namespace resilient_comm::tcp;

namespace {

constexpr size_t kHdr = sizeof(WireHeader);

std::string bytesOf(const void* p, size_t n) {
  return std::string(static_cast<const char*>(p), n);
}

void flip(std::mt19937_64& rng, std::string& s, int times) {
  for (int i = 0; i < times && !s.empty(); ++i) {
    s[rng() % s.size()] ^= static_cast<char>(1 + rng() % 255);
  }
}

std::string randomBlob(std::mt19937_64& rng, size_t maxLen) {
  std::string s(rng() % (maxLen + 1), '\0');
  for (char& c : s) {
    c = static_cast<char>(rng());
  }
  return s;
}

// What the fuzzing peer writes for case `i`, given the header the op expects and its payload.
std::string mutatedFrame(std::mt19937_64& rng, const WireHeader& expect, const std::string& payload, bool ack,
                         int* mode) {
  WireHeader h = expect;
  if (ack) {
    h.kind = static_cast<uint8_t>(MsgKind::kAck);
    h.bytes = 0;
  }
  std::string frame = bytesOf(&h, kHdr) + (ack ? std::string() : payload);
  *mode = static_cast<int>(rng() % 8);
  switch (*mode) {
    case 0:
      return randomBlob(rng, 3 * kHdr);
    case 1:  // a few bytes of the header flipped
      flip(rng, frame, 1 + static_cast<int>(rng() % 3));
      return frame;
    case 2:  // only the payload flipped: still a well-formed frame
      if (frame.size() > kHdr) {
        frame[kHdr + rng() % (frame.size() - kHdr)] ^= 0x5a;
      }
      return frame;
    case 3: {  // a random size, huge ones included
      WireHeader g = h;
      g.bytes = rng() % 2 ? rng() : rng() % 512;
      return bytesOf(&g, kHdr) + randomBlob(rng, 256);
    }
    case 4: {  // a random kind (error frames among them) with a random size
      WireHeader g = h;
      g.kind = static_cast<uint8_t>(rng() % 8);
      g.bytes = rng() % 3 == 0 ? rng() : rng() % 5000;
      g.dtype = static_cast<uint8_t>(rng());
      return bytesOf(&g, kHdr) + randomBlob(rng, 512);
    }
    case 5:  // cut short
      return frame.substr(0, rng() % frame.size());
    case 6:  // the right frame twice over, then garbage
      return frame + frame + randomBlob(rng, 64);
    default:  // exactly right
      return frame;
  }
}

}  // namespace

TEST(tcp_frame_parser_survives_random_and_mutated_frames) {
  std::mt19937_64 rng(20261202);
  std::map<std::string, int> outcomes;
  const int kCases = 3000;
  for (int i = 0; i < kCases; ++i) {
    int fds[2];
    CHECK(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    CHECK(setNonBlocking(fds[0]).isOk());
    std::vector<Peer> peers(2);
    peers[1].sock = Socket(fds[0]);
    Socket fuzzer(fds[1]);
    const bool ack = i % 4 == 3;  // the op sent a confirmed frame and awaits its confirmation
    const size_t bytes = ack ? 16 : rng() % 300;
    MsgMeta meta{OpKind::kBroadcast, DataType::kFloat32, RedOp::kSum, static_cast<uint64_t>(i), 1, 77};
    WireHeader expect{kWireMagic, static_cast<uint8_t>(MsgKind::kData), static_cast<uint8_t>(meta.op),
                      static_cast<uint8_t>(meta.dtype), static_cast<uint8_t>(meta.redop), meta.seq, bytes, meta.tag};
    const std::string payload = randomBlob(rng, 0).append(bytes, 'p');
    int mode = 0;
    const std::string frame = mutatedFrame(rng, expect, payload, ack, &mode);
    CHECK(::send(fuzzer.fd(), frame.data(), frame.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(frame.size()));
    ::shutdown(fuzzer.fd(), SHUT_WR);  // nothing more comes: every verdict is due now
    std::vector<char> out(bytes + 64, 'x');
    char sent[16] = {};
    AbortToken never;
    const auto t0 = std::chrono::steady_clock::now();
    Transfer x(peers, 0, meta, Deadline::after(std::chrono::milliseconds(3000)), never);
    if (ack) {
      x.sendConfirmed(1, sent, sizeof(sent));
    } else {
      x.recv(1, out.data(), bytes);
    }
    Status st = x.run();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    // A Timeout is only the peer's own verdict, carried by its error frame (never this op's deadline).
    CHECK(st.code() != StatusCode::kTimeout || st.message().rfind("rank 1 failed: ", 0) == 0)
        << "case " << i << " (mode " << mode << ") hung: " << st.toString();
    for (unsigned char ch : st.message()) {
      CHECK(ch >= 0x20 || ch == '\n' || ch == '\t') << "case " << i << ": a control byte in " << st.toString();
    }
    CHECK(ms < 1000) << "case " << i << " (mode " << mode << ") took " << ms << " ms";
    CHECK(st.isOk() || !st.message().empty()) << "case " << i;
    if (st.isOk()) {
      // Success only for the expected frame (a kData sent as kDataAck is the same frame).
      WireHeader got{};
      std::memcpy(&got, frame.data(), std::min(frame.size(), kHdr));
      CHECK(frame.size() >= kHdr && got.magic == kWireMagic && got.seq == expect.seq)
          << "case " << i << " (mode " << mode << ") succeeded on a foreign frame";
      if (!ack) {
        CHECK(std::memcmp(out.data(), frame.data() + kHdr, bytes) == 0) << "case " << i;
        CHECK(out[bytes] == 'x') << "case " << i << ": wrote past the buffer";
      }
    }
    outcomes[st.isOk() ? "ok" : statusCodeName(st.code())]++;
  }
  std::string summary;
  for (const auto& [k, n] : outcomes) {
    summary += " " + k + "=" + std::to_string(n);
  }
  std::printf("  %d cases:%s\n", kCases, summary.c_str());
  CHECK(outcomes["ok"] > 0 && outcomes["Mismatch"] > 0 && outcomes["PeerFailure"] > 0) << summary;
}

TEST(tcp_hello_fuzz_never_stalls_or_poisons_a_build) {
  ::setenv("RESILIENT_COMM_TOKEN", "fuzz-token-0123456789", 1);
  struct Unset {
    ~Unset() {
      ::unsetenv("RESILIENT_COMM_TOKEN");
    }
  } unset;
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string prefix = "fuzz-hello/";
  auto make = [&](int r) { return rc_test::twoRankComm(store, "fuzz", prefix, r, std::chrono::seconds(20)); };
  auto c0 = make(0);
  Status built0;
  std::thread build([&] { built0 = c0->waitReady(Deadline::after(std::chrono::seconds(20))); });
  rc_test::BuildJoiner joiner{build, c0};
  const auto [host, port] = rc_test::publishedAddress(*store, prefix + "e1/addr/0");

  std::mt19937_64 rng(7);
  AbortToken never;
  const Hello real{kWireMagic, 1, 2, 0, fnv1a(prefix + "e1/") ^ 2ULL, 42, 0};
  std::vector<Socket> held;  // partial Hellos left open until the end
  for (int i = 0; i < 200; ++i) {
    Result<Socket> s = connectTo(host, port, Deadline::after(std::chrono::seconds(5)), never);
    CHECK(s.isOk()) << "connection " << i << ": " << s.status().toString();
    std::string blob;
    switch (i % 5) {
      case 0:
        blob = randomBlob(rng, 2 * sizeof(Hello));
        break;
      case 1: {
        Hello h{kWireMagic, static_cast<int32_t>(rng()), static_cast<int32_t>(rng()), static_cast<uint32_t>(rng()),
                rng(), rng(), rng()};
        blob = bytesOf(&h, sizeof(h));
        break;
      }
      case 2:
        blob = bytesOf(&real, sizeof(real));  // the right hash and rank, without the token's MAC
        flip(rng, blob, static_cast<int>(rng() % 3));
        break;
      case 3:
        blob = bytesOf(&real, sizeof(real)).substr(0, rng() % sizeof(real));
        break;
      default:
        blob = bytesOf(&real, sizeof(real)) + randomBlob(rng, 64);
        break;
    }
    if (!blob.empty()) {
      (void)::send(s.value().fd(), blob.data(), blob.size(), MSG_NOSIGNAL);
    }
    if (i % 5 == 3 && held.size() < 10) {
      held.push_back(std::move(s.value()));
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto c1 = make(1);
  Status s1 = c1->waitReady(Deadline::after(std::chrono::seconds(20)));
  build.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s1.isOk()) << s1.toString();
  CHECK(built0.isOk()) << built0.toString();
  CHECK(s < 5.0) << "the build took " << s << " s after the real rank came";
  float a = 1.0f, b = 2.0f;
  Status r1;
  std::thread t([&] { r1 = c1->allReduce(&b, 1, DataType::kFloat32, RedOp::kSum, Deadline::after(std::chrono::seconds(10))); });
  Status r0 = c0->allReduce(&a, 1, DataType::kFloat32, RedOp::kSum, Deadline::after(std::chrono::seconds(10)));
  t.join();
  CHECK(r0.isOk() && r1.isOk()) << r0.toString() << " / " << r1.toString();
  CHECK(a == 3.0f && b == 3.0f) << a << " " << b;
}
