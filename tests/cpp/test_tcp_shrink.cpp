// TcpCommunicator's shrink over reused connections (fence resync), with one thread per rank
// over loopback sockets and an in-process store: a member whose communicator is aborted
// (every socket shut down, as the kernel does for a killed process) during a collective,
// then shrink, every collective on the result; a child built before the other survivors
// shrink; abort during the resync, during the wait for fences and during a grow; mismatched
// exclude lists (in the build, and in the first collective); a stale Hello left on the shared
// listener by an abandoned build. Real processes and real SIGKILL are in
// tests/backend/test_membership.py.
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <utility>
#include <thread>

#include "check.h"
#include "tcp_group.h"
#include "transport/tcp/tcp_communicator.h"

using namespace resilient_comm;
using namespace resilient_comm::tcp;
using namespace rc_test;
using Clock = std::chrono::steady_clock;

namespace {

// True while thread `tid` of this process sleeps in the kernel.
bool sleepingInKernel(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(f, line);
  size_t p = line.rfind(')');
  return p != std::string::npos && p + 2 < line.size() && line[p + 2] == 'S';
}

}  // namespace

TEST(tcp_shrink_after_failure_reuses_every_survivor_connection) {
  for (int victim : {0, 2, 4}) {
    Comms comms = makeGroup(5, "reuse" + std::to_string(victim) + "/");
    std::vector<Status> st = failDuring(comms, victim, 16);
    std::vector<int> survivors;
    for (int r = 0; r < 5; ++r) {
      if (r != victim) {
        CHECK(!st[r].isOk()) << "rank " << r << " never saw the failure";
        survivors.push_back(r);
      }
    }
    const Clock::time_point t0 = Clock::now();
    Comms shrunk = shrinkAll(comms, survivors, {victim});
    const double ms = msSince(t0);
    for (size_t i = 0; i < shrunk.size(); ++i) {
      CHECK(shrunk[i]->rank() == static_cast<int>(i) && shrunk[i]->size() == 4);
      CHECK(reused(shrunk[i]) == 3) << "survivor " << i << " reused " << reused(shrunk[i]) << " of 3";
    }
    CHECK(ms < 2000) << "shrink took " << ms << " ms";
    checkEveryCollective(shrunk, 16);
    checkEveryCollective(shrunk, 100000);  // ring-sized, chunked
  }
}

TEST(tcp_shrink_after_failure_mid_large_message_falls_back_where_streams_were_cut) {
  // 4 MiB messages: the failure cuts some streams in the middle of a message; those pairs
  // connect afresh, the others are reused, and the result is correct either way.
  Comms comms = makeGroup(4, "large/");
  failDuring(comms, 1, 1 << 20);
  Comms shrunk = shrinkAll(comms, {0, 2, 3}, {1});
  checkEveryCollective(shrunk, 1 << 18);
  // Shrinking the shrunk group again (a second failure) works as well.
  std::vector<Status> st = failDuring(shrunk, 2, 16);
  Comms again = shrinkAll(shrunk, {0, 1}, {2});
  CHECK(reused(again[0]) + reused(again[1]) <= 2);
  checkEveryCollective(again, 1000);
}

// Runs `wait` on a thread, aborts `comm` once that thread sleeps in the kernel, and returns
// what `wait` returned and how long after the abort it did.
std::pair<Status, double> abortWhileWaiting(Communicator& comm, const std::function<Status()>& wait,
                                            const std::string& reason) {
  std::atomic<pid_t> tid{0};
  Status waited;
  Clock::time_point returned;
  std::thread waiter([&] {
    tid.store(static_cast<pid_t>(::syscall(SYS_gettid)));
    waited = wait();
    returned = Clock::now();
  });
  const Clock::time_point until = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < until && (tid.load() == 0 || !sleepingInKernel(tid.load()))) {
    std::this_thread::yield();
  }
  const Clock::time_point aborted = Clock::now();
  comm.abort(reason);
  waiter.join();
  return {waited, std::chrono::duration<double, std::milli>(returned - aborted).count()};
}

TEST(tcp_shrink_builds_without_waiting_for_the_others_to_shrink) {
  // The parent's failure already sent what the resync reads (every survivor's last frame of
  // it), so a survivor's child is built before any other survivor has called shrink; nobody
  // waits on it here, so the backstop thread builds it. The peers' fences are read by the
  // first ops.
  Comms comms = makeGroup(4, "early/");
  failDuring(comms, 1, 16);
  auto first = comms[0]->shrink({1}, true, Deadline::after(kLong));
  CHECK(first.isOk()) << first.status().toString();
  std::shared_ptr<Communicator> early = first.take();
  const Clock::time_point until = Clock::now() + std::chrono::seconds(5);
  Status polled = early->poll();
  while (polled.code() == StatusCode::kInProgress && Clock::now() < until) {
    std::this_thread::yield();  // a bounded poll of the state, which the build changes
    polled = early->poll();
  }
  CHECK(polled.isOk()) << polled.toString();
  CHECK(reused(early) == 2) << reused(early);
  Comms rest = shrinkAll(comms, {2, 3}, {1});
  Comms shrunk{early, rest[0], rest[1]};
  checkEveryCollective(shrunk, 16);
}

// Rank 0 of `comms` (3 ranks) shrinks out rank 2 and waits for its child until it aborts it,
// which must return that wait at once; then rank 1's shrink must fail within its deadline.
void abortRank0WhileItWaits(const Comms& comms, const std::string& reason) {
  auto r0 = comms[0]->shrink({2}, true, Deadline::after(kLong));
  CHECK(r0.isOk()) << r0.status().toString();
  std::shared_ptr<Communicator> child = r0.take();
  auto [waited, ms] = abortWhileWaiting(*child, [&] { return child->waitReady(Deadline::after(kLong)); }, reason);
  CHECK(waited.code() == StatusCode::kAborted) << waited.toString();
  CHECK(waited.message().find(reason) != std::string::npos) << waited.toString();
  CHECK(ms < 50) << "waitReady returned " << ms << " ms after the abort";
  const Clock::time_point t1 = Clock::now();
  auto r1 = comms[1]->shrink({2}, true, Deadline::after(std::chrono::milliseconds(500)));
  CHECK(r1.isOk()) << r1.status().toString();
  Status s1 = r1.value()->waitReady(Deadline::after(kLong));
  if (s1.isOk()) {
    float x = 1;
    s1 = r1.value()->allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, Deadline::after(kLong));
  }
  CHECK(!s1.isOk());
  CHECK(msSince(t1) < 2000) << "rank 1 took " << msSince(t1) << " ms to fail";
}

TEST(tcp_abort_during_resync_returns_at_once) {
  // Rank 1's communicator has not failed (it is idle and Ready), so rank 0's build waits for
  // its last frame of the parent until rank 0 aborts the child.
  abortRank0WhileItWaits(makeGroup(3, "abortresync/"), "test: abort during the resync");
  // Every survivor failed, so rank 0's child is built at once; waitReady then waits for rank
  // 1's fence (rank 1 has not shrunk yet) until rank 0 aborts the child, whose side rank 1's
  // child then finds gone.
  Comms comms = makeGroup(3, "abortfence/");
  failDuring(comms, 2, 16);
  abortRank0WhileItWaits(comms, "test: abort while waiting for a fence");
}

TEST(tcp_abort_during_grow_returns_at_once) {
  // The members grow for a joiner that never comes: each child's build waits in the store for
  // the joiner's address until it is aborted.
  Comms comms = makeGroup(2, "abortgrow/");
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<Communicator>> grown(2);
  for (int r = 0; r < 2; ++r) {
    auto g = comms[r]->grow(3, store, "abortgrow/join/", Deadline::after(kLong));
    CHECK(g.isOk()) << g.status().toString();
    grown[r] = g.take();
  }
  for (int r = 0; r < 2; ++r) {
    auto [waited, ms] = abortWhileWaiting(
        *grown[r], [&] { return grown[r]->waitReady(Deadline::after(kLong)); }, "test: abort during grow");
    CHECK(waited.code() == StatusCode::kAborted) << "rank " << r << ": " << waited.toString();
    CHECK(ms < 50) << "rank " << r << ": waitReady returned " << ms << " ms after the abort";
  }
  // The members' own group is untouched.
  checkEveryCollective(comms, 16);
}

// Ranks 0, 1 and 2 of `comms` (rank 3 died) shrink with a deadline of 1.5 s: ranks 0 and 1
// exclude rank 3, rank 2 excludes `wrong` instead; then each runs `then` on its child. Per rank:
// the first error (or Ok) and the milliseconds from its shrink call.
std::pair<std::vector<Status>, std::vector<double>> shrinkThree(const Comms& comms, const std::vector<int>& wrong,
                                                               const std::function<Status(Communicator&)>& then) {
  std::vector<Status> st(3);
  std::vector<double> ms(3);
  onEach(3, [&](int r) {
    const Clock::time_point t0 = Clock::now();
    auto c = comms[r]->shrink(r == 2 ? wrong : std::vector<int>{3}, true,
                              Deadline::after(std::chrono::milliseconds(1500)));
    st[r] = c.isOk() ? then(*c.value()) : c.status();
    ms[r] = msSince(t0);
  });
  return {st, ms};
}

TEST(tcp_mismatched_fences_fail_the_first_collective) {
  // Without waitReady the fences are read by the first collective: a survivor that shrank
  // with other arguments fails it with a Mismatch on the ranks that read its fence.
  Comms comms = makeGroup(4, "fencemismatch/");
  failDuring(comms, 3, 16);
  // Ranks 0 and 1 exclude the dead rank 3; rank 2 wrongly excludes rank 1 as well, so its
  // group {0, 2} needs no fresh connection and is ready at once, like theirs.
  auto [st, ms] = shrinkThree(comms, {1, 3}, [](Communicator& c) {
    std::vector<float> x(16, 1.0f);
    return c.allReduce(x.data(), x.size(), DataType::kFloat32, RedOp::kSum, Deadline::after(kLong));
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(!st[r].isOk()) << "rank " << r << " reduced over a group built from mismatched arguments";
    CHECK(ms[r] < 3000) << "rank " << r << " took " << ms[r] << " ms";
  }
  // Rank 1 may only learn at its deadline: rank 2 shut their stream (it left rank 1 out), and
  // if rank 1 sees that before it is ready it waits for a fresh connection rank 2 never makes.
  for (int r : {0, 2}) {
    CHECK(st[r].message().find("different communicator") != std::string::npos) << "rank " << r << ": "
                                                                                  << st[r].toString();
    CHECK(ms[r] < 1000) << "rank " << r << " took " << ms[r] << " ms";
  }
  CHECK(st[2].code() == StatusCode::kMismatch) << st[2].toString();
}

TEST(tcp_shrink_with_mismatched_exclude_lists_fails_within_the_deadline) {
  Comms comms = makeGroup(4, "mismatch/");
  failDuring(comms, 3, 16);
  // Ranks 0 and 1 exclude the dead rank 3; rank 2 wrongly excludes rank 1.
  auto [st, ms] = shrinkThree(comms, {1}, [](Communicator& c) { return c.waitReady(Deadline::after(kLong)); });
  for (int r = 0; r < 3; ++r) {
    CHECK(!st[r].isOk()) << "rank " << r << " built a communicator from mismatched arguments";
    CHECK(ms[r] < 3000) << "rank " << r << " took " << ms[r] << " ms";
  }
  // Rank 0 and rank 2 disagree directly: a Mismatch, well before the deadline.
  for (int r : {0, 2}) {
    CHECK(st[r].code() == StatusCode::kMismatch) << "rank " << r << ": " << st[r].toString();
    CHECK(st[r].message().find("different communicator") != std::string::npos) << st[r].toString();
    CHECK(ms[r] < 1000) << "rank " << r << " took " << ms[r] << " ms";
  }
}

TEST(tcp_stale_hello_from_an_abandoned_build_is_ignored) {
  Comms comms = makeGroup(2, "stale/");
  // Rank 0's first shrink times out before rank 1 arrives, so nobody ever accepts rank 1's
  // Hello for it, which stays in the backlog of rank 0's listener.
  auto a1 = comms[0]->shrink({}, false, Deadline::after(std::chrono::milliseconds(50)));
  CHECK(a1.isOk());
  CHECK(a1.value()->waitReady(Deadline::after(kLong)).code() == StatusCode::kTimeout);
  auto b1 = comms[1]->shrink({}, false, Deadline::after(std::chrono::milliseconds(100)));
  CHECK(b1.isOk());
  Status sb1 = b1.value()->waitReady(Deadline::after(kLong));
  CHECK(sb1.code() == StatusCode::kTimeout) << sb1.toString();
  CHECK(sb1.message().find("to accept") != std::string::npos) << sb1.toString();
  // The next shrink on both ranks must skip that Hello, not report a mismatch.
  std::vector<std::shared_ptr<Communicator>> next(2);
  std::vector<Status> st(2);
  onEach(2, [&](int r) {
    auto c = comms[r]->shrink({}, false, Deadline::after(kLong));
    st[r] = c.isOk() ? c.value()->waitReady(Deadline::after(kLong)) : c.status();
    next[r] = c.isOk() ? c.take() : nullptr;
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(st[r].isOk()) << "rank " << r << ": " << st[r].toString();
  }
  checkEveryCollective(next, 8);
}

TEST(tcp_a_survivor_dying_before_the_shrink_fails_the_others_at_once) {
  Comms comms = makeGroup(4, "deadsurvivor/");
  failDuring(comms, 3, 16);
  // Rank 2 survived the failure but dies before it shrinks: its sockets and its listener
  // close (as the kernel closes a killed process's).
  comms[2].reset();
  std::vector<Status> st(2);
  std::vector<double> ms(2);
  onEach(2, [&](int r) {
    const Clock::time_point t0 = Clock::now();
    auto c = comms[r]->shrink({3}, true, Deadline::after(kLong));
    st[r] = c.isOk() ? c.value()->waitReady(Deadline::after(kLong)) : c.status();
    ms[r] = msSince(t0);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(st[r].code() == StatusCode::kPeerFailure) << "rank " << r << ": " << st[r].toString();
    CHECK(st[r].message().find("rank 2") != std::string::npos) << st[r].toString();
    CHECK(ms[r] < 1000) << "rank " << r << " took " << ms[r] << " ms (the deadline is 10 s)";
  }
}
