// Connections made on first use (mesh.h, [Note: lazy connections]), with the full-mesh bound
// lowered so that small groups take the large groups' path: a build connects the ring
// neighbours only, every collective is right and connects only the peers it uses, a failure
// reaches ranks that never connected to the one that failed, a shrink works over the
// connections there are, and a peer that died before it dialled is a PeerFailure within
// ~100 ms, whichever side dials.
#include <cstdlib>
#include <string>
#include <vector>

#include "tcp_group.h"  // first: torch's headers define a CHECK of their own, which check.h replaces
#include "check.h"

using namespace resilient_comm;
using namespace resilient_comm::tcp;
using namespace rc_test;

namespace {

// Groups of more than `n` ranks connect on first use while this lives.
struct FullMeshBound {
  explicit FullMeshBound(int n) {
    setenv("RESILIENT_COMM_TCP_FULL_MESH", std::to_string(n).c_str(), 1);
  }
  ~FullMeshBound() {
    unsetenv("RESILIENT_COMM_TCP_FULL_MESH");
  }
};

int connections(const std::shared_ptr<Communicator>& c) {
  return dynamic_cast<TcpCommunicator&>(*c).connections();
}

}  // namespace

TEST(tcp_a_large_group_connects_its_ring_neighbours_and_the_rest_on_first_use) {
  FullMeshBound bound(2);
  Comms comms = makeGroup(8, "lazy/");
  for (int r = 0; r < 8; ++r) {
    CHECK(connections(comms[r]) == 2) << "rank " << r << " holds " << connections(comms[r]) << " connections";
  }
  // A ring all-reduce uses nothing but the neighbours.
  const size_t ringCount = 1 << 20;
  CHECK(dynamic_cast<TcpCommunicator&>(*comms[0]).chooseAlgo(OpKind::kAllReduce, ringCount * 4) == Algo::kRing);
  onEach(8, [&](int r) {
    std::vector<float> x(ringCount, 1.0f);
    Status st = comms[r]->allReduce(x.data(), x.size(), DataType::kFloat32, RedOp::kSum, Deadline::after(kLong));
    CHECK(st.isOk() && x[0] == 8.0f) << st.toString();
  });
  for (int r = 0; r < 8; ++r) {
    CHECK(connections(comms[r]) == 2) << "rank " << r << " after a ring all-reduce: " << connections(comms[r]);
  }
  // Recursive doubling adds its partners (r ^ 2, r ^ 4; r ^ 1 is a neighbour or one more).
  onEach(8, [&](int r) {
    float x = static_cast<float>(r);
    Status st = comms[r]->allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, Deadline::after(kLong));
    CHECK(st.isOk() && x == 28.0f) << st.toString();
  });
  for (int r = 0; r < 8; ++r) {
    CHECK(connections(comms[r]) >= 3 && connections(comms[r]) <= 5) << "rank " << r << ": " << connections(comms[r]);
  }
  checkEveryCollective(comms, 16);
  checkEveryCollective(comms, 100000);
  for (int r = 0; r < 8; ++r) {
    CHECK(connections(comms[r]) == 7) << "rank " << r << " after all_to_all: " << connections(comms[r]);
  }
}

TEST(tcp_a_failure_reaches_ranks_that_never_connected_to_it_and_the_survivors_shrink) {
  FullMeshBound bound(2);
  for (int victim : {0, 3}) {
    Comms comms = makeGroup(6, "lazyfail" + std::to_string(victim) + "/");
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Status> st = failDuring(comms, victim, 1 << 20);  // ring: neighbours only
    const double ms = msSince(t0);
    std::vector<int> survivors;
    for (int r = 0; r < 6; ++r) {
      if (r != victim) {
        CHECK(!st[r].isOk() && st[r].code() != StatusCode::kTimeout) << "rank " << r << ": " << st[r].toString();
        survivors.push_back(r);
      }
    }
    CHECK(ms < 2000) << "the failure took " << ms << " ms to reach every rank";
    Comms shrunk = shrinkAll(comms, survivors, {victim});
    checkEveryCollective(shrunk, 16);
    checkEveryCollective(shrunk, 100000);
  }
}

TEST(tcp_a_peer_that_died_before_it_connected_fails_the_op_at_once) {
  FullMeshBound bound(2);
  // In a group of 4, ranks 1 and 3 (and 0 and 2) are not ring neighbours: their first message
  // connects them. The higher rank dials, so rank 3 finds rank 1's listener gone at once, and
  // rank 0, waiting for dead rank 2 to dial, probes it.
  for (int dead : {1, 2}) {
    Comms comms = makeGroup(4, "lazydead" + std::to_string(dead) + "/");
    const int asker = dead == 1 ? 3 : 0;
    comms[dead].reset();  // its sockets and its listener close, as a killed process's do
    const auto t0 = std::chrono::steady_clock::now();
    float v = 1.0f;
    std::vector<P2POp> ops{{P2POp::Kind::kRecv, dead, &v, sizeof(v), 0}};
    Status st = comms[asker]->sendRecv(ops, Deadline::after(kLong));
    const double ms = msSince(t0);
    CHECK(st.code() == StatusCode::kPeerFailure) << "rank " << asker << ": " << st.toString();
    CHECK(st.message().find("rank " + std::to_string(dead)) != std::string::npos) << st.toString();
    CHECK(ms < 1000) << "rank " << asker << " took " << ms << " ms (the deadline is 10 s)";
  }
}
