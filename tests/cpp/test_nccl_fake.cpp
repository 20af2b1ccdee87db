// The NCCL communicator's state machine, driven on CPU through FakeNccl.
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "check.h"
#include "transport/nccl/fake_nccl.h"
#include "transport/nccl/nccl_communicator.h"
#include "watchdog/reaper.h"

using namespace resilient_comm;
using namespace resilient_comm::nccl;
using Clock = std::chrono::steady_clock;

namespace {

struct Rig {
  std::shared_ptr<FakeNccl> api;
  std::shared_ptr<NcclCommunicator> comm;
};

Rig make(FakeScript script, int size = 1, std::chrono::milliseconds initTimeout = std::chrono::seconds(5)) {
  Rig r;
  r.api = std::make_shared<FakeNccl>(script);
  NcclOptions o;
  o.name = "test";
  o.store = c10::make_intrusive<c10d::HashStore>();
  o.prefix = "nccl/";
  o.rank = 0;
  o.size = size;
  auto c = NcclCommunicator::create(r.api, std::make_shared<FakeStreamOps>(script), o, Deadline::after(initTimeout));
  CHECK(c.isOk()) << c.status().toString();
  r.comm = c.take();
  return r;
}

double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

Deadline in(int ms) {
  return Deadline::after(std::chrono::milliseconds(ms));
}

// The last reference to a communicator may be its init thread's, released just after Ready
// is announced: teardown counters settle a moment after the test drops its own.
template <typename Pred>
bool eventually(Pred pred, int ms = 2000) {
  Deadline dl = in(ms);
  while (!pred()) {
    if (dl.passed()) {
      return false;
    }
    std::this_thread::yield();
  }
  return true;
}

}  // namespace

TEST(init_in_progress_then_ready) {
  FakeScript s;
  s.initPolls = 3;
  Rig r = make(s);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  CHECK(r.comm->state() == CommState::kReady);
  CHECK(r.api->inits == 1);
  float x[4] = {1, 2, 3, 4};
  CHECK(r.comm->allReduce(x, 4, DataType::kFloat32, RedOp::kSum, in(1000)).isOk());
}

TEST(init_that_never_completes_is_aborted_at_the_deadline) {
  FakeScript s;
  s.initNeverCompletes = true;
  Rig r = make(s, 1, std::chrono::seconds(30));
  auto t0 = Clock::now();
  Status st = r.comm->waitReady(in(150));
  double ms = msSince(t0);
  CHECK(st.code() == StatusCode::kTimeout) << st.toString();
  CHECK(ms >= 140 && ms < 1000) << ms;
  CHECK(r.comm->state() == CommState::kAborted);
  CHECK(r.api->aborts == 1);
  CHECK(r.api->destroys == 0 && r.api->finalizes == 0);
}

TEST(abort_during_init_returns_at_once) {
  FakeScript s;
  s.initNeverCompletes = true;
  Rig r = make(s, 1, std::chrono::seconds(30));
  Clock::time_point aborted;
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // holds the fault: init is pending
    aborted = Clock::now();
    r.comm->abort("stop");
  });
  Status st = r.comm->waitReady(in(5000));
  double ms = msSince(aborted);
  t.join();
  CHECK(st.code() == StatusCode::kAborted) << st.toString();
  CHECK(ms < 50) << ms;
}

TEST(remote_error_mid_op_is_a_peer_failure_and_never_destroys) {
  FakeScript s;
  s.remoteErrorAfterOps = 0;
  Rig r = make(s);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  float x[2] = {1, 1};
  Status st = r.comm->allReduce(x, 2, DataType::kFloat32, RedOp::kSum, in(2000));
  CHECK(st.code() == StatusCode::kPeerFailure) << st.toString();
  CHECK(st.message().find("remote process exited") != std::string::npos) << st.message();
  CHECK(r.comm->state() == CommState::kError);
  auto t0 = Clock::now();
  Status again = r.comm->broadcast(x, 2, DataType::kFloat32, 0, in(2000));
  CHECK(again.code() == StatusCode::kPeerFailure && msSince(t0) < 20) << again.toString();
  auto api = r.api;
  r.comm.reset();
  CHECK(eventually([&] { return api->aborts == 1; }));
  CHECK(api->destroys == 0 && api->finalizes == 0);
}

TEST(hung_op_times_out_and_aborts) {
  FakeScript s;
  s.opsHang = true;
  Rig r = make(s);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  float x[2] = {1, 1};
  auto t0 = Clock::now();
  Status st = r.comm->allReduce(x, 2, DataType::kFloat32, RedOp::kSum, in(100));
  double ms = msSince(t0);
  CHECK(st.code() == StatusCode::kTimeout) << st.toString();
  CHECK(ms >= 95 && ms < 600) << ms;
  CHECK(r.api->aborts == 1);
}

TEST(a_stuck_abort_taints_the_process_but_never_blocks_the_caller) {
  setenv("RESILIENT_COMM_ABORT_BOUND_MS", "200", 1);
  FakeScript s;
  s.opsHang = true;
  s.abortHangs = true;
  Rig r = make(s);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  float x[2] = {1, 1};
  auto t0 = Clock::now();
  Status st = r.comm->allReduce(x, 2, DataType::kFloat32, RedOp::kSum, in(100));
  double ms = msSince(t0);
  CHECK(st.code() == StatusCode::kTimeout) << st.toString();
  CHECK(ms < 100 + 200 + 300) << ms;
  CHECK(Reaper::tainted()) << "the stuck abort should taint the process";
  CHECK(Reaper::taintReason().find("ncclCommAbort") != std::string::npos) << Reaper::taintReason();
  r.api->release();
  unsetenv("RESILIENT_COMM_ABORT_BOUND_MS");
}

TEST(shrink_after_error_uses_ncclCommShrink_abort_and_aborts_the_parent) {
  FakeScript s;
  Rig r = make(s, 4);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto child = r.comm->shrink({2}, /*afterError=*/true, in(2000));
  CHECK(child.isOk()) << child.status().toString();
  CHECK(child.value()->waitReady(in(2000)).isOk());
  CHECK(child.value()->size() == 3 && child.value()->rank() == 0);
  CHECK(r.api->shrinks == 1 && r.api->lastShrinkFlags == kNcclShrinkAbort);
  CHECK(r.comm->state() == CommState::kAborted);
  CHECK(r.api->inits == 1) << "no re-init when ncclCommShrink exists";
}

TEST(a_failed_shrink_reports_the_nccl_error) {
  FakeScript s;
  s.shrinkFails = true;
  Rig r = make(s, 3);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto child = r.comm->shrink({1}, false, in(2000));
  CHECK(!child.isOk());
  CHECK(child.status().message().find("ncclCommShrink failed") != std::string::npos) << child.status().toString();
}

TEST(bad_exclude_lists_are_rejected) {
  Rig r = make(FakeScript{}, 3);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  for (std::vector<int> bad : {std::vector<int>{0}, {3}, {-1}, {1, 1}, {1, 2, 0}}) {
    auto c = r.comm->shrink(bad, false, in(1000));
    CHECK(c.status().code() == StatusCode::kInvalidArgument) << c.status().toString();
  }
}

TEST(versions_without_shrink_split_grow_fall_back_to_a_fresh_init) {
  FakeScript s;
  s.version = ncclVersionCode(2, 26, 0);
  s.missingOptionalSymbols = true;
  Rig r = make(s, 2);  // rank 0 of 2: the shrink leaves it alone
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto shrunk = r.comm->shrink({1}, false, in(2000));
  CHECK(shrunk.isOk()) << shrunk.status().toString();
  CHECK(shrunk.value()->waitReady(in(2000)).isOk());
  CHECK(r.api->shrinks == 0 && r.api->inits == 2);
  auto split = shrunk.value()->split(0, 0, in(2000));
  CHECK(split.isOk() && split.value()) << split.status().toString();
  CHECK(split.value()->waitReady(in(2000)).isOk());
  CHECK(r.api->splits == 0 && r.api->inits == 3);
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto grown = r.comm->grow(3, store, "grow/", in(2000));
  CHECK(grown.isOk()) << grown.status().toString();
  CHECK(grown.value()->size() == 3);
  CHECK(grown.value()->waitReady(in(2000)).isOk());
  CHECK(r.api->grows == 0 && r.api->inits == 4);
  CHECK(store->check({"grow/uid"}));
}

TEST(native_split_and_grow_where_the_version_has_them) {
  Rig r = make(FakeScript{}, 1);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto split = r.comm->split(0, 0, in(2000));
  CHECK(split.isOk() && split.value()) << split.status().toString();
  CHECK(split.value()->waitReady(in(2000)).isOk());
  CHECK(r.api->splits == 1 && r.api->inits == 1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto grown = r.comm->grow(3, store, "grow/", in(2000));
  CHECK(grown.isOk()) << grown.status().toString();
  CHECK(grown.value()->waitReady(in(2000)).isOk());
  CHECK(r.api->grows == 1 && r.api->inits == 1);
  CHECK(store->check({"grow/uid"})) << "the root publishes the grow id for the joiners";
}

TEST(too_old_a_library_is_refused_clearly) {
  FakeScript s;
  s.version = ncclVersionCode(2, 13, 4);
  auto api = std::make_shared<FakeNccl>(s);
  NcclOptions o;
  o.store = c10::make_intrusive<c10d::HashStore>();
  auto c = NcclCommunicator::create(api, std::make_shared<FakeStreamOps>(s), o, in(1000));
  CHECK(!c.isOk());
  CHECK(c.status().message().find("too old") != std::string::npos) << c.status().toString();
  CHECK(c.status().message().find("2.13.4") != std::string::npos) << c.status().toString();
}

TEST(a_healthy_communicator_is_finalized_and_destroyed) {
  Rig r = make(FakeScript{});
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto api = r.api;
  r.comm.reset();
  CHECK(eventually([&] { return api->destroys == 1; }));
  CHECK(api->finalizes == 1 && api->aborts == 0);
}
