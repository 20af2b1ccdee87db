// The HCCL communicator's state machine, driven on CPU through FakeHccl, and the libhccl loader
// on a machine without CANN.
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "check.h"
#include "comm/bootstrap_id.h"
#include "emulation/hccl/fake_hccl.h"
#include "transport/hccl/hccl_communicator.h"
#include "watchdog/reaper.h"

using namespace resilient_comm;
using namespace resilient_comm::hccl;
using Clock = std::chrono::steady_clock;

namespace {

// The threads bindDevice ran on.
struct Binds {
  std::mutex mu;
  std::set<std::thread::id> threads;
};

struct HcclRig {
  std::shared_ptr<FakeHccl> api;
  std::shared_ptr<HcclCommunicator> comm;
  std::shared_ptr<Binds> binds = std::make_shared<Binds>();
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
};

HcclOptions options(const HcclRig& r, int size, int rank = 0) {
  HcclOptions o;
  o.name = "test";
  o.store = r.store;
  o.prefix = "hccl/";
  o.rank = rank;
  o.size = size;
  o.makeStreams = r.api->streams();
  o.bindDevice = [b = r.binds] {
    std::lock_guard<std::mutex> lock(b->mu);
    b->threads.insert(std::this_thread::get_id());
  };
  return o;
}

HcclRig makeRig(FakeHcclScript script, int size = 1, std::chrono::milliseconds initTimeout = std::chrono::seconds(5)) {
  HcclRig r;
  r.api = std::make_shared<FakeHccl>(script);
  auto c = HcclCommunicator::create(r.api, options(r, size), Deadline::after(initTimeout));
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

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST(hccl_init_runs_on_a_build_thread_then_ready) {
  HcclRig r = makeRig(FakeHcclScript{}, 4);
  CHECK(r.comm->state() == CommState::kInitializing) << "create() returns before the init is done";
  CHECK(r.comm->waitReady(in(2000)).isOk());
  CHECK(r.comm->state() == CommState::kReady);
  CHECK(r.api->inits == 1);
  {
    std::lock_guard<std::mutex> lock(r.binds->mu);
    CHECK(r.binds->threads.size() == 1 && !r.binds->threads.count(std::this_thread::get_id()))
        << "the build thread binds the device before calling HCCL";
  }
  auto id = r.store->get("hccl/e1/uid");
  CHECK(id.size() == 2 * kHcclRootInfoBytes) << id.size();
  float x[3] = {1, 2, 3};
  CHECK(r.comm->allReduce(x, 3, DataType::kFloat32, RedOp::kSum, in(1000)).isOk());
  CHECK(x[0] == 4 && x[1] == 8 && x[2] == 12) << x[0] << " " << x[1] << " " << x[2];
  {
    std::lock_guard<std::mutex> lock(r.binds->mu);
    CHECK(r.binds->threads.count(std::this_thread::get_id())) << "ops bind the calling thread too";
  }
  int16_t h[2] = {1, 2};
  CHECK(r.comm->allReduce(h, 2, DataType::kInt16, RedOp::kMin, in(1000)).isOk());
  CHECK(r.api->lastDataType == HCCL_DATA_TYPE_INT16 && r.api->lastReduceOp == HCCL_REDUCE_MIN);
  bool b[2] = {true, false};
  CHECK(r.comm->allReduce(b, 2, DataType::kBool, RedOp::kSum, in(1000)).isOk());
  CHECK(r.api->lastDataType == HCCL_DATA_TYPE_UINT8 && r.api->lastReduceOp == HCCL_REDUCE_MAX);
  CHECK(r.comm->barrier(in(1000)).isOk());
  CHECK(r.comm->gather(x, x, 1, DataType::kFloat32, 1, in(1000)).isOk());
  CHECK(r.api->misuse == 0);
}

TEST(hccl_init_past_the_wait_deadline_is_abandoned_never_joined) {
  FakeHcclScript s;
  s.initBlocks = true;
  HcclRig r = makeRig(s, 2, std::chrono::seconds(30));
  auto api = r.api;
  CHECK(api->waitFor([&] { return api->inits == 1; }, std::chrono::seconds(2))) << "init never reached HCCL";
  auto t0 = Clock::now();
  Status st = r.comm->waitReady(in(150));
  double ms = msSince(t0);
  CHECK(st.code() == StatusCode::kTimeout) << st.toString();
  CHECK(ms >= 140 && ms < 150 + 250) << ms;
  CHECK(r.comm->state() == CommState::kAborted);
  CHECK(api->initsReturned == 0) << "the init thread is still inside HCCL";
  std::weak_ptr<HcclCommunicator> weak = r.comm;
  r.comm.reset();
  CHECK(weak.expired()) << "the init thread must not keep the communicator alive";
  api->release();
  CHECK(api->waitFor([&] { return api->destroys == 1; }, std::chrono::seconds(2)))
      << "the abandoned init destroys the communicator it returns; destroys=" << api->destroys;
  CHECK(api->misuse == 0);
}

TEST(hccl_the_init_deadline_holds_without_a_waitReady_deadline) {
  FakeHcclScript s;
  s.initBlocks = true;
  HcclRig r = makeRig(s, 2, std::chrono::milliseconds(150));
  auto t0 = Clock::now();
  Status st = r.comm->waitReady(in(5000));
  double ms = msSince(t0);
  CHECK(st.code() == StatusCode::kTimeout) << st.toString();
  CHECK(has(st.message(), "abandoned")) << st.message();
  CHECK(ms < 150 + 250) << ms;
  CHECK(r.comm->state() == CommState::kError);
  auto api = r.api;
  api->release();
  CHECK(api->waitFor([&] { return api->destroys == 1; }, std::chrono::seconds(2))) << api->destroys;
}

TEST(hccl_async_error_mid_op_is_a_peer_failure_and_stops_issuing) {
  FakeHcclScript s;
  s.asyncErrorAfterOps = 0;
  HcclRig r = makeRig(s, 2);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  float x[2] = {1, 1};
  Status st = r.comm->allReduce(x, 2, DataType::kFloat32, RedOp::kSum, in(2000));
  CHECK(st.code() == StatusCode::kPeerFailure) << st.toString();
  CHECK(has(st.message(), "remote rank") && has(st.message(), "HCCL_E_REMOTE") && has(st.message(), "all_reduce #0"))
      << st.message();
  CHECK(r.comm->state() == CommState::kError);
  auto t0 = Clock::now();
  Status again = r.comm->broadcast(x, 2, DataType::kFloat32, 0, in(2000));
  CHECK(again.code() == StatusCode::kPeerFailure && msSince(t0) < 20) << again.toString();
  CHECK(r.api->ops == 1) << "nothing is issued after the error";
  CHECK(r.api->destroys == 0) << "a world stays for shrink";
  auto api = r.api;
  r.comm.reset();
  CHECK(api->destroys == 1 && api->suspends == 1) << "a failed world is suspended, then destroyed";
  CHECK(api->misuse == 0);
}

TEST(hccl_hung_op_times_out_and_fails_the_communicator) {
  FakeHcclScript s;
  s.opsHang = true;
  HcclRig r = makeRig(s);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  float x[2] = {1, 1};
  auto t0 = Clock::now();
  Status st = r.comm->allReduce(x, 2, DataType::kFloat32, RedOp::kSum, in(100));
  double ms = msSince(t0);
  CHECK(st.code() == StatusCode::kTimeout) << st.toString();
  CHECK(ms >= 95 && ms < 600) << ms;
  CHECK(r.comm->state() == CommState::kError);
  CHECK(r.comm->barrier(in(1000)).code() == StatusCode::kTimeout);
  CHECK(r.api->ops == 1);
}

TEST(hccl_abort_wakes_a_hung_op_at_once) {
  FakeHcclScript s;
  s.opsHang = true;
  HcclRig r = makeRig(s);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  Clock::time_point aborted;
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // holds the fault: the op is pending
    aborted = Clock::now();
    r.comm->abort("stop");
  });
  float x[2] = {1, 1};
  Status st = r.comm->allReduce(x, 2, DataType::kFloat32, RedOp::kSum, in(5000));
  double ms = msSince(aborted);
  t.join();
  CHECK(st.code() == StatusCode::kAborted) << st.toString();
  CHECK(ms < 50) << ms;
  CHECK(r.comm->state() == CommState::kAborted);
}

TEST(hccl_a_destroy_that_hangs_taints_the_process_but_never_blocks_the_caller) {
  setenv("RESILIENT_COMM_ABORT_BOUND_MS", "200", 1);
  FakeHcclScript s;
  s.destroyBlocks = true;
  HcclRig r = makeRig(s, 3);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto child = r.comm->shrink({1}, false, in(2000));
  CHECK(child.isOk()) << child.status().toString();
  CHECK(child.value()->waitReady(in(2000)).isOk());
  auto t0 = Clock::now();
  child.value()->abort("stop");  // a sub-communicator: its own HcclComm is destroyed now
  double ms = msSince(t0);
  CHECK(ms >= 190 && ms < 200 + 300) << ms;
  CHECK(r.api->suspends == 1 && r.api->destroys == 1 && r.api->destroysReturned == 0)
      << "the caller went on while HcclCommDestroy is still stuck";
  CHECK(Reaper::tainted());
  r.api->release();
  auto api = r.api;
  CHECK(api->waitFor([&] { return api->destroysReturned == 1; }, std::chrono::seconds(2)));
  unsetenv("RESILIENT_COMM_ABORT_BOUND_MS");
}

TEST(hccl_shrink_builds_sub_communicators_from_the_world) {
  HcclRig r = makeRig(FakeHcclScript{}, 4);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto child = r.comm->shrink({2}, /*afterError=*/true, in(2000));
  CHECK(child.isOk()) << child.status().toString();
  CHECK(child.value()->waitReady(in(2000)).isOk());
  CHECK(child.value()->size() == 3 && child.value()->rank() == 0);
  CHECK(r.api->subComms == 1 && r.api->inits == 1) << "no re-init where HcclCreateSubCommConfig exists";
  CHECK((r.api->lastRankIds() == std::vector<uint32_t>{0, 1, 3}));
  CHECK(r.comm->state() == CommState::kAborted);
  CHECK(r.api->destroys == 0) << "the aborted world stays for its derivations";
  float x[1] = {1};
  CHECK(child.value()->allReduce(x, 1, DataType::kFloat32, RedOp::kSum, in(1000)).isOk());
  CHECK(x[0] == 3) << x[0];
  const uint64_t firstId = r.api->lastSubCommId;
  auto grandchild = child.value()->shrink({1}, false, in(2000));
  CHECK(grandchild.isOk()) << grandchild.status().toString();
  CHECK(grandchild.value()->waitReady(in(2000)).isOk());
  CHECK((r.api->lastRankIds() == std::vector<uint32_t>{0, 3})) << "members are named by their world ranks";
  CHECK(r.api->lastSubCommId != firstId);
  CHECK(child.value()->state() == CommState::kReady);
  auto api = r.api;
  r.comm.reset();
  CHECK(api->destroys == 0) << "the world lives while a derived communicator does";
  child = Result<std::shared_ptr<Communicator>>(std::shared_ptr<Communicator>());
  CHECK(api->destroys == 1);
  grandchild = Result<std::shared_ptr<Communicator>>(std::shared_ptr<Communicator>());
  CHECK(api->destroys == 3) << api->destroys;
  CHECK(api->suspends == 1) << "only the failed world is suspended";
  CHECK(api->misuse == 0);
}

// What torch's reconfigure asks of the HCCL device communicator (backend_reconfigure.cpp, the
// same code that the NCCL emulator's tests drive end to end): a shrink plan shrinks the failed
// world after its error; a fresh plan aborts it and builds a new world under the uuid's prefix.
TEST(hccl_reconfigure_shrinks_a_failed_world_or_builds_a_fresh_one) {
  FakeHcclScript s;
  s.asyncErrorAfterOps = 0;
  HcclRig r = makeRig(s, 3);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  float x[1] = {1};
  CHECK(r.comm->allReduce(x, 1, DataType::kFloat32, RedOp::kSum, in(2000)).code() == StatusCode::kPeerFailure);
  CHECK(!r.comm->error().isOk());
  auto child = r.comm->shrink({2}, /*afterError=*/true, in(2000));
  CHECK(child.isOk()) << child.status().toString();
  CHECK(child.value()->waitReady(in(2000)).isOk());
  CHECK(child.value()->size() == 2 && child.value()->rank() == 0);
  CHECK((r.api->lastRankIds() == std::vector<uint32_t>{0, 1}));
  CHECK(r.api->inits == 1) << "a shrink derives from the world: no new root info";

  HcclRig fresh = makeRig(FakeHcclScript{}, 1);
  HcclOptions o = options(fresh, 2);
  o.prefix = "hccl/u7/";  // the backend's configTag for reconfigure uuid 7
  fresh.comm->abort("superseded by reconfigure (uuid 7)");
  auto made = HcclCommunicator::create(fresh.api, o, in(2000));
  CHECK(made.isOk()) << made.status().toString();
  CHECK(made.value()->waitReady(in(2000)).isOk());
  CHECK(fresh.store->check({"hccl/u7/e1/uid"})) << "the fresh world bootstraps under the uuid's keys";
  CHECK(made.value()->allReduce(x, 1, DataType::kFloat32, RedOp::kSum, in(1000)).isOk());
  CHECK(r.api->misuse == 0 && fresh.api->misuse == 0);
}

// After torch's reconfigure the members may share no store: rank 0's root info reaches them
// over the host communicator (backend_comms.cpp) and the communicator inits from it alone.
TEST(hccl_a_handed_over_root_info_inits_without_the_store) {
  auto api = std::make_shared<FakeHccl>(FakeHcclScript{});
  Result<std::vector<uint8_t>> root = makeRootInfo(*api);
  CHECK(root.isOk()) << root.status().toString();
  CHECK(root.value().size() == sizeof(HcclRootInfo));
  Result<std::vector<uint8_t>> other = makeRootInfo(*api);
  CHECK(other.isOk() && other.value() != root.value()) << "every root info differs";

  HcclRig r;
  r.api = api;
  HcclOptions o = options(r, 2, 1);
  o.rootInfo = root.value();
  auto made = HcclCommunicator::create(api, o, in(2000));
  CHECK(made.isOk()) << made.status().toString();
  CHECK(made.value()->waitReady(in(2000)).isOk());
  CHECK(r.store->getNumKeys() == 0) << "no store key was read or written";
  float x[1] = {1};
  CHECK(made.value()->allReduce(x, 1, DataType::kFloat32, RedOp::kSum, in(1000)).isOk());

  o.rootInfo.resize(17);
  auto bad = HcclCommunicator::create(api, o, in(2000));
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(has(bad.status().message(), "a root info of 17 bytes; an HcclRootInfo has 4108")) << bad.status().message();
  CHECK(api->misuse == 0);
}

TEST(hccl_split_from_the_world) {
  HcclRig r = makeRig(FakeHcclScript{}, 1);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto none = r.comm->split(-1, 0, in(2000));
  CHECK(none.isOk() && !none.value()) << none.status().toString();
  auto split = r.comm->split(7, 0, in(2000));
  CHECK(split.isOk() && split.value()) << split.status().toString();
  CHECK(split.value()->waitReady(in(2000)).isOk());
  CHECK(r.api->subComms == 1 && r.api->inits == 1);
  CHECK(r.comm->state() == CommState::kReady) << "split leaves the parent usable";
}

TEST(hccl_without_optional_symbols_moves_init_afresh_and_ops_say_not_supported) {
  FakeHcclScript s;
  s.missingOptionalSymbols = true;
  HcclRig r = makeRig(s, 2);  // rank 0 of 2: the shrink leaves it alone
  CHECK(r.comm->waitReady(in(2000)).isOk());
  float x[4] = {1, 2, 3, 4};
  Status st = r.comm->reduce(x, 4, DataType::kFloat32, RedOp::kSum, 0, in(1000));
  CHECK(st.code() == StatusCode::kNotSupported && has(st.message(), "HcclReduce")) << st.toString();
  CHECK(r.comm->scatter(x, x, 1, DataType::kFloat32, 0, in(1000)).code() == StatusCode::kNotSupported);
  CHECK(r.comm->allToAll(x, {1, 1}, {0, 1}, x, {1, 1}, {0, 1}, DataType::kFloat32, in(1000)).code() ==
        StatusCode::kNotSupported);
  std::vector<P2POp> two = {P2POp{P2POp::Kind::kSend, 1, x, 4, 0}, P2POp{P2POp::Kind::kRecv, 1, x + 1, 4, 0}};
  st = r.comm->sendRecv(two, in(1000));
  CHECK(st.code() == StatusCode::kNotSupported && has(st.message(), "HcclBatchSendRecv")) << st.toString();
  CHECK(r.comm->sendRecv({two[0]}, in(1000)).isOk()) << "a single send needs no batch";
  CHECK(r.comm->state() == CommState::kReady);

  auto shrunk = r.comm->shrink({1}, false, in(2000));
  CHECK(shrunk.isOk()) << shrunk.status().toString();
  CHECK(shrunk.value()->waitReady(in(2000)).isOk());
  CHECK(r.api->subComms == 0 && r.api->inits == 2);
  CHECK(r.store->check({"hccl/shrink0/0,/uid"}));
  auto split = shrunk.value()->split(0, 0, in(2000));
  CHECK(split.isOk() && split.value()) << split.status().toString();
  CHECK(split.value()->waitReady(in(2000)).isOk());
  CHECK(r.api->inits == 3);
  CHECK(r.store->check({"hccl/shrink0/0,/split0/0/uid"})) << "a child's keys live under its own prefix";

  auto joinStore = c10::make_intrusive<c10d::HashStore>();
  auto grown = r.comm->grow(3, joinStore, "grow/", in(2000));
  CHECK(grown.isOk()) << grown.status().toString();
  HcclOptions j = options(r, 3, 2);
  j.store = joinStore;
  j.prefix = "grow/";
  auto joiner = HcclCommunicator::join(r.api, j, in(2000));
  CHECK(joiner.isOk()) << joiner.status().toString();
  CHECK(grown.value()->waitReady(in(2000)).isOk() && joiner.value()->waitReady(in(2000)).isOk());
  CHECK(grown.value()->size() == 3 && joiner.value()->rank() == 2);
  CHECK(r.api->inits == 5);
}

TEST(hccl_a_failed_sub_communicator_reports_the_hccl_error) {
  FakeHcclScript s;
  s.subCommFails = true;
  HcclRig r = makeRig(s, 3);
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto child = r.comm->shrink({1}, false, in(2000));
  CHECK(child.isOk()) << child.status().toString();
  Status st = child.value()->waitReady(in(2000));
  CHECK(st.code() == StatusCode::kInternal) << st.toString();
  CHECK(has(st.message(), "HcclCreateSubCommConfig failed") && has(st.message(), "HCCL_E_INTERNAL")) << st.message();
  CHECK(child.value()->state() == CommState::kError);
  CHECK(r.comm->state() == CommState::kReady);
}

TEST(hccl_average_is_refused_and_the_communicator_stays_ready) {
  HcclRig r = makeRig(FakeHcclScript{});
  CHECK(r.comm->waitReady(in(2000)).isOk());
  float x[1] = {1};
  Status st = r.comm->allReduce(x, 1, DataType::kFloat32, RedOp::kAvg, in(1000));
  CHECK(st.code() == StatusCode::kNotSupported && has(st.message(), "no average")) << st.toString();
  CHECK(r.comm->state() == CommState::kReady && r.api->ops == 0);
}

TEST(hccl_a_healthy_communicator_is_destroyed_once_without_suspend) {
  HcclRig r = makeRig(FakeHcclScript{});
  CHECK(r.comm->waitReady(in(2000)).isOk());
  auto api = r.api;
  r.comm.reset();
  CHECK(api->destroys == 1 && api->suspends == 0 && api->misuse == 0);
}

TEST(hccl_bootstrap_ids_round_trip_and_garbage_is_refused) {
  HcclRootInfo a{};
  for (size_t i = 0; i < sizeof(a.internal); ++i) {
    a.internal[i] = static_cast<char>(i * 7);
  }
  HcclRootInfo b{};
  CHECK(hexDecode(hexEncode(a.internal, sizeof(a.internal)), b.internal, sizeof(b.internal)).isOk());
  CHECK(std::memcmp(a.internal, b.internal, sizeof(a.internal)) == 0);
  CHECK(!hexDecode("zz", b.internal, 1).isOk());
  CHECK(!hexDecode("abc", b.internal, 2).isOk());
}

TEST(hccl_loader_says_what_it_tried) {
  unsetenv("RESILIENT_COMM_HCCL_LIB");
  auto found = loadHccl();
  if (found.isOk()) {  // a machine with CANN: nothing more to learn here (success is kept)
    CHECK(!found.value()->path().empty());
    return;
  }
  const std::string& m = found.status().message();
  CHECK(m.rfind("no libhccl found: libhccl.so: ", 0) == 0) << m;
  CHECK(has(m, "(set RESILIENT_COMM_HCCL_LIB or install the CANN toolkit)")) << m;

  const std::string bogus = "/tmp/rc_hccl_loader_" + std::to_string(getpid()) + ".so";
  std::ofstream(bogus) << "not a library";
  setenv("RESILIENT_COMM_HCCL_LIB", bogus.c_str(), 1);
  auto r = loadHccl();
  CHECK(!r.isOk());
  CHECK(has(r.status().message(), "RESILIENT_COMM_HCCL_LIB=" + bogus + ": ")) << r.status().message();
  CHECK(has(r.status().message(), "; libhccl.so: ")) << "the default path is still tried: " << r.status().message();

  setenv("RESILIENT_COMM_HCCL_LIB", "libm.so.6", 1);
  r = loadHccl();
  CHECK(has(r.status().message(), "libm.so.6: not a usable libhccl (missing HcclGetRootInfo, ")) << r.status().message();
  unsetenv("RESILIENT_COMM_HCCL_LIB");
  std::remove(bogus.c_str());
}
