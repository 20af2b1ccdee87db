// The job token on the TCP handshake (transport/tcp/auth.h): SipHash-2-4 against the
// reference vector, and a stranger that knows a communicator's hash (it is predictable: the
// store prefix and epoch) joining a build as a rank -- accepted without a token, dropped with
// one, while the real rank still joins.
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cstdlib>
#include <string>
#include <thread>

#include "check.h"
#include "tcp_rig.h"
#include "transport/tcp/auth.h"
#include "transport/tcp/mesh.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_communicator.h"
#include "transport/tcp/wire.h"

using namespace resilient_comm;
using namespace resilient_comm::tcp;

namespace {

constexpr std::chrono::milliseconds kLong(10000);

// Rank 0 of a 2-rank group builds; a stranger connects to its listener as rank 1 with the
// right hash (and no token); then, if the stranger was not taken, the real rank 1. Returns
// whether rank 0's build took the stranger.
bool strangerTaken(const std::string& prefix) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto make = [&](int r) { return rc_test::twoRankComm(store, "auth-test", prefix, r, kLong); };
  // Rank 1's address, for now (rank 0 only accepts from it): rank 0's build gets to its accept
  // loop before rank 1 exists; the real rank 1 publishes its own when it starts.
  std::string placeholder = "127.0.0.1:1";
  store->set(prefix + "e1/addr/1", std::vector<uint8_t>(placeholder.begin(), placeholder.end()));
  auto c0 = make(0);
  std::thread build([&] { (void)c0->waitReady(Deadline::after(kLong)); });
  rc_test::BuildJoiner joiner{build, c0};
  const auto [host, port] = rc_test::publishedAddress(*store, prefix + "e1/addr/0");
  AbortToken never;
  Result<Socket> s = connectTo(host, port, Deadline::after(kLong), never);
  CHECK(s.isOk()) << s.status().toString();
  Hello forged{kWireMagic, 1, 2, 0, fnv1a(prefix + "e1/") ^ 2ULL, 42, 0};
  CHECK(writeAll(s.value(), &forged, sizeof(forged), Deadline::after(kLong), never).isOk());
  HelloAnswer reply{};
  Status st = readAll(s.value(), &reply, sizeof(reply), Deadline::after(std::chrono::milliseconds(500)), never);
  const bool taken = st.isOk() && reply.answer == 1;
  std::shared_ptr<TcpCommunicator> c1;
  if (!taken) {
    c1 = make(1);
    Status s1 = c1->waitReady(Deadline::after(kLong));
    CHECK(s1.isOk()) << s1.toString();
  }
  build.join();
  if (!taken) {
    Status s0 = c0->waitReady(Deadline::after(kLong));
    CHECK(s0.isOk()) << s0.toString() << " (answer " << int(reply.answer) << ", read " << st.toString() << ")";
    float a = 1.0f, b = 2.0f;
    std::thread t([&] { CHECK(c1->allReduce(&b, 1, DataType::kFloat32, RedOp::kSum, Deadline::after(kLong)).isOk()); });
    CHECK(c0->allReduce(&a, 1, DataType::kFloat32, RedOp::kSum, Deadline::after(kLong)).isOk());
    t.join();
    CHECK(a == 3.0f && b == 3.0f) << a << " " << b;
  } else {
    c0->abort("test over");
  }
  return taken;
}

}  // namespace

TEST(siphash24_matches_the_reference_vector) {
  unsigned char key[16], msg[15];
  for (int i = 0; i < 16; ++i) {
    key[i] = static_cast<unsigned char>(i);
  }
  for (int i = 0; i < 15; ++i) {
    msg[i] = static_cast<unsigned char>(i);
  }
  uint64_t k0 = 0, k1 = 0;
  for (int i = 0; i < 8; ++i) {
    k0 |= static_cast<uint64_t>(key[i]) << (8 * i);
    k1 |= static_cast<uint64_t>(key[8 + i]) << (8 * i);
  }
  // The SipHash paper's test vector (Aumasson & Bernstein, appendix A): 15 bytes 00..0e.
  CHECK(sipHash24(k0, k1, msg, 15) == 0xa129ca6149be45e5ULL) << std::hex << sipHash24(k0, k1, msg, 15);
  CHECK(JobKey().mac(msg, 15) == 0);
  CHECK(JobKey("a").mac(msg, 15) != JobKey("b").mac(msg, 15));
}

TEST(tcp_a_stranger_with_the_right_hash_joins_only_without_a_token) {
  ::unsetenv("RESILIENT_COMM_TOKEN");
  CHECK(strangerTaken("auth-open/")) << "without a token a forged Hello is indistinguishable (the reason for it)";
  ::setenv("RESILIENT_COMM_TOKEN", "0123456789abcdef-test-token", 1);
  const bool taken = strangerTaken("auth-token/");
  ::unsetenv("RESILIENT_COMM_TOKEN");
  CHECK(!taken) << "a Hello without the job's token was accepted";
}
