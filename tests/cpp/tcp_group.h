// Groups of TCP communicators for the C++ tests, one thread per rank over loopback sockets and
// an in-process store: build one, fail one of its ranks the way a killed process fails (every
// socket shut down) inside a collective, shrink the survivors, and check every collective's
// values on a group.
#pragma once

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "transport/tcp/tcp_communicator.h"

namespace rc_test {

using resilient_comm::Communicator;
using resilient_comm::DataType;
using resilient_comm::Deadline;
using resilient_comm::P2POp;
using resilient_comm::RedOp;
using resilient_comm::Status;
using resilient_comm::tcp::TcpCommunicator;
using resilient_comm::tcp::TcpOptions;

constexpr std::chrono::milliseconds kLong(10000);

inline double msSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// Runs fn(i) for every i in [0, n) on its own thread and joins them (each fn is bounded by
// its own deadlines).
inline void onEach(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i) {
    ts.emplace_back(fn, i);
  }
  for (auto& t : ts) {
    t.join();
  }
}

using Comms = std::vector<std::shared_ptr<Communicator>>;

inline Comms makeGroup(int n, const std::string& prefix) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Comms out(n);
  for (int r = 0; r < n; ++r) {
    TcpOptions o;
    o.name = "shrink-test";
    o.store = store;
    o.prefix = prefix;
    o.rank = r;
    o.size = n;
    out[r] = TcpCommunicator::create(std::move(o), Deadline::after(kLong));
  }
  std::vector<Status> st(n);
  onEach(n, [&](int r) { st[r] = out[r]->waitReady(Deadline::after(kLong)); });
  for (int r = 0; r < n; ++r) {
    CHECK(st[r].isOk()) << "rank " << r << ": " << st[r].toString();
  }
  return out;
}

inline int reused(const std::shared_ptr<Communicator>& c) {
  return dynamic_cast<TcpCommunicator&>(*c).reusedConnections();
}

// `victim` dies the way a killed process does (every socket shut down) while the others are
// inside an allReduce of `count` floats; returns each survivor's failure.
inline std::vector<Status> failDuring(Comms& comms, int victim, size_t count) {
  const int n = static_cast<int>(comms.size());
  std::vector<Status> st(n);
  std::atomic<int> started{0};
  onEach(n, [&](int r) {
    if (r == victim) {
      while (started.load() < n - 1) {
        std::this_thread::yield();  // the others are about to block on it
      }
      comms[r]->abort("test: rank " + std::to_string(r) + " dies");
      return;
    }
    std::vector<float> x(count, 1.0f);
    ++started;
    for (int i = 0; i < 1000 && st[r].isOk(); ++i) {
      st[r] = comms[r]->allReduce(x.data(), count, DataType::kFloat32, RedOp::kSum, Deadline::after(kLong));
    }
  });
  return st;
}

inline Comms shrinkAll(const Comms& comms, const std::vector<int>& survivors, const std::vector<int>& exclude) {
  Comms out(survivors.size());
  std::vector<Status> st(survivors.size());
  onEach(static_cast<int>(survivors.size()), [&](int i) {
    auto r = comms[survivors[i]]->shrink(exclude, /*afterError=*/true, Deadline::after(kLong));
    if (!r.isOk()) {
      st[i] = r.status();
      return;
    }
    out[i] = r.take();
    st[i] = out[i]->waitReady(Deadline::after(kLong));
  });
  for (size_t i = 0; i < survivors.size(); ++i) {
    CHECK(st[i].isOk()) << "survivor " << survivors[i] << ": " << st[i].toString();
  }
  return out;
}

// Every collective on `comms` (ranks 0..n-1 of one communicator), checked against local sums.
inline void checkEveryCollective(const Comms& comms, size_t count) {
  const int n = static_cast<int>(comms.size());
  std::vector<std::string> bad(n);
  onEach(n, [&](int r) {
    Communicator& c = *comms[r];
    auto dl = [] { return Deadline::after(kLong); };
    auto fail = [&](const std::string& what, const Status& s) {
      if (!s.isOk() && bad[r].empty()) {
        bad[r] = what + ": " + s.toString();
      }
    };
    auto expect = [&](const std::string& what, bool ok) {
      if (!ok && bad[r].empty()) {
        bad[r] = what + " returned wrong values";
      }
    };
    const float tri = static_cast<float>(n * (n - 1) / 2);
    std::vector<float> a(count);
    for (size_t i = 0; i < count; ++i) {
      a[i] = static_cast<float>(r + i % 7);
    }
    Status s = c.allReduce(a.data(), count, DataType::kFloat32, RedOp::kSum, dl());
    fail("allReduce", s);
    bool ok = true;
    for (size_t i = 0; i < count; ++i) {
      ok = ok && a[i] == tri + static_cast<float>(n * (i % 7));
    }
    expect("allReduce", ok);
    std::vector<float> b(count, static_cast<float>(r));
    fail("broadcast", c.broadcast(b.data(), count, DataType::kFloat32, n - 1, dl()));
    expect("broadcast", b[0] == n - 1 && b[count - 1] == n - 1);
    std::vector<float> red(count, static_cast<float>(r));
    fail("reduce", c.reduce(red.data(), count, DataType::kFloat32, RedOp::kSum, 0, dl()));
    expect("reduce", r != 0 || (red[0] == tri && red[count - 1] == tri));
    std::vector<float> mine(count, static_cast<float>(r)), all(count * n);
    fail("allGather", c.allGather(mine.data(), all.data(), count, DataType::kFloat32, dl()));
    ok = true;
    for (int j = 0; j < n; ++j) {
      ok = ok && all[j * count] == j && all[j * count + count - 1] == j;
    }
    expect("allGather", ok);
    std::vector<float> rsIn(count * n, 1.0f), rsOut(count);
    fail("reduceScatter", c.reduceScatter(rsIn.data(), rsOut.data(), count, DataType::kFloat32, RedOp::kSum, dl()));
    expect("reduceScatter", rsOut[0] == n && rsOut[count - 1] == n);
    std::vector<float> a2aIn(n), a2aOut(n);
    for (int j = 0; j < n; ++j) {
      a2aIn[j] = static_cast<float>(10 * r + j);
    }
    std::vector<size_t> ones(n, 1), displs(n);
    std::iota(displs.begin(), displs.end(), 0);
    fail("allToAll", c.allToAll(a2aIn.data(), ones, displs, a2aOut.data(), ones, displs, DataType::kFloat32, dl()));
    ok = true;
    for (int j = 0; j < n; ++j) {
      ok = ok && a2aOut[j] == 10 * j + r;
    }
    expect("allToAll", ok);
    float g = static_cast<float>(r);
    std::vector<float> gathered(n);
    fail("gather", c.gather(&g, gathered.data(), 1, DataType::kFloat32, 0, dl()));
    ok = true;
    for (int j = 0; r == 0 && j < n; ++j) {
      ok = ok && gathered[j] == j;
    }
    expect("gather", ok);
    std::vector<float> scatterIn(n);
    std::iota(scatterIn.begin(), scatterIn.end(), 0.0f);
    float got = -1;
    fail("scatter", c.scatter(scatterIn.data(), &got, 1, DataType::kFloat32, 0, dl()));
    expect("scatter", got == r);
    fail("barrier", c.barrier(dl()));
    float sendv = static_cast<float>(r), recvv = -1;
    std::vector<P2POp> ops{{P2POp::Kind::kSend, (r + 1) % n, &sendv, sizeof(float), 0},
                           {P2POp::Kind::kRecv, (r + n - 1) % n, &recvv, sizeof(float), 0}};
    fail("sendRecv", c.sendRecv(ops, dl()));
    expect("sendRecv", recvv == (r + n - 1) % n);
  });
  for (int r = 0; r < n; ++r) {
    CHECK(bad[r].empty()) << "rank " << r << ": " << bad[r];
  }
}

}  // namespace rc_test
