// The NCCL communicator on the NCCL emulator: real bytes between ranks (threads of this process),
// non-blocking calls, late child handles, asynchronous kernels. Each test named after a defect
// of issue #14 fails on the transport as it was before (see the comment on each).
#include <atomic>
#include <cstdlib>
#include <thread>

#include "common/check.h"
#include "nccl_rig.h"  // includes check.h last
#include "watchdog/reaper.h"

using namespace resilient_comm;
using namespace resilient_comm::nccl;
using namespace rc_test;

namespace {

// Every rank all-reduces rank+1 into `n` floats on its communicator; true if all got the sum.
bool allReduceOnEach(std::vector<Communicator*> comms, int n = 257) {
  std::atomic<bool> ok{true};
  const int size = static_cast<int>(comms.size());
  onEachRank(size, [&](int r) {
    std::vector<float> x(n, static_cast<float>(r + 1));
    Status st = comms[r]->allReduce(x.data(), n, DataType::kFloat32, RedOp::kSum, in(5000));
    const float want = static_cast<float>(size * (size + 1) / 2);
    if (!st.isOk() || x.front() != want || x.back() != want) {
      ok = false;
    }
  });
  return ok;
}

// Rank r's process "dies": its communicator goes, and with it its connections.
void killRank(World& w, int r) {
  w[r].abort("rank " + std::to_string(r) + " dies");
  w.comms[r].reset();
}

// The two members of `w` grow to three with one joiner (a hot spare), each on its own thread;
// returns the grown communicators.
std::vector<std::shared_ptr<Communicator>> growByOneJoiner(World& w) {
  std::vector<std::shared_ptr<Communicator>> grown(3);
  auto store = c10::make_intrusive<c10d::HashStore>();
  onEachRank(3, [&](int r) {
    if (r < 2) {
      auto g = w[r].grow(3, store, "grow/", in(5000));
      CHECK(g.isOk()) << g.status().toString();
      grown[r] = g.take();
    } else {
      NcclOptions jo{"t", store, "grow/", 2, 3};
      auto j = NcclCommunicator::join(w.api, device::emu::makeEmulatedStreamOps(0), jo, in(5000));
      CHECK(j.isOk()) << j.status().toString();
      grown[r] = j.take();
    }
  });
  return grown;
}

std::vector<Communicator*> ptrs(World& w) {
  std::vector<Communicator*> out;
  for (auto& c : w.comms) {
    out.push_back(c.get());
  }
  return out;
}

}  // namespace

// Defect 1: ncclInProgress was taken for success, so the end event was recorded before NCCL's
// kernel was on the stream: the op "completed" at once on untouched buffers, and the next call
// failed with ncclInvalidArgument.
TEST(nccl_every_call_is_settled_before_its_end_event) {
  EmulatorOptions o;
  o.launchDelay = std::chrono::milliseconds(20);
  World w = makeWorld(2, o);
  allReady(w);
  for (int i = 0; i < 3; ++i) {
    CHECK(allReduceOnEach(ptrs(w))) << "round " << i;
  }
  CHECK(w.api->stats().misuse == 0);
}

// Defect 2: split/shrink/grow passed a stack variable as the child's handle and read it at
// once; NCCL writes it later from its own thread.
TEST(nccl_a_split_child_written_late_is_settled_and_used) {
  EmulatorOptions o;
  o.launchDelay = std::chrono::milliseconds(10);
  World w = makeWorld(4, o);
  allReady(w);
  std::vector<std::shared_ptr<Communicator>> kids(4);
  onEachRank(4, [&](int r) {
    auto c = w[r].split(r % 2, r, in(5000));
    CHECK(c.isOk() && c.value()) << c.status().toString();
    kids[r] = c.take();
    CHECK(kids[r]->waitReady(in(5000)).isOk());
  });
  CHECK(w.api->stats().splits == 4);
  CHECK(allReduceOnEach({kids[0].get(), kids[2].get()}));
  CHECK(allReduceOnEach({kids[1].get(), kids[3].get()}));
  CHECK(w.api->stats().misuse == 0);
}

// Defect 3: fail() aborted the parent first, so a shrink after an error never reached
// ncclCommShrink; and an abort of the parent while the child initialised killed the child.
void shrinkAfterAPeerDies(int version) {
  EmulatorOptions o;
  o.version = version;
  World w = makeWorld(3, o);
  allReady(w);
  killRank(w, 2);  // its connections close: the others' kernels see a remote error
  onEachRank(2, [&](int r) {
    float x = 1;
    Status st = w[r].allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, in(5000));
    CHECK(st.code() == StatusCode::kPeerFailure) << st.toString();
  });
  const int abortsBefore = w.api->stats().aborts;
  auto child0 = w[0].shrink({2}, /*afterError=*/true, in(5000));
  CHECK(child0.isOk()) << child0.status().toString();
  // Rank 1 has not shrunk yet: rank 0's child cannot be ready, so its parent must still be there.
  CHECK(w.api->stats().aborts == abortsBefore) << "the parent was aborted before its child was ready";
  auto child1 = w[1].shrink({2}, /*afterError=*/true, in(5000));
  CHECK(child1.isOk()) << child1.status().toString();
  CHECK(allReduceOnEach({child0.value().get(), child1.value().get()}));
  CHECK(w.api->stats().shrinks == 2) << "ncclCommShrink on both survivors";
  CHECK(w.api->stats().inits == 3) << "no fresh init";
  CHECK(eventually([&] { return w.api->stats().aborts == abortsBefore + 2; })) << "parents aborted once children are ready";
  CHECK(w.api->stats().misuse == 0);
}

TEST(nccl_shrink_after_an_error_revokes_then_shrinks_where_revoke_exists) {
  shrinkAfterAPeerDies(ncclVersionCode(2, 30, 0));
}

TEST(nccl_shrink_after_an_error_uses_shrink_abort_before_revoke_existed) {
  shrinkAfterAPeerDies(ncclVersionCode(2, 27, 3));
}

// The library refuses ncclCommShrink on a parent with an error (one reading of NCCL's source):
// every survivor falls back to a fresh init together, none waits for a shrink the others gave up.
TEST(nccl_a_refused_native_shrink_falls_back_to_a_fresh_init_on_every_survivor) {
  EmulatorOptions o;
  o.shrinkFailsAfterError = true;
  o.version = ncclVersionCode(2, 27, 3);
  World w = makeWorld(3, o);
  allReady(w);
  killRank(w, 2);
  std::vector<std::shared_ptr<Communicator>> kids(2);
  auto t0 = Clock::now();
  onEachRank(2, [&](int r) {
    float x = 1;
    (void)w[r].allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, in(5000));
    auto c = w[r].shrink({2}, true, in(5000));
    CHECK(c.isOk()) << c.status().toString();
    kids[r] = c.take();
  });
  CHECK(allReduceOnEach({kids[0].get(), kids[1].get()}));
  CHECK(msSince(t0) < 3000) << msSince(t0);
  CHECK(w.api->stats().inits == 5) << "both survivors re-initialised: " << w.api->stats().inits.load();
}

// Defect 4: the reaper held the handle's mutex inside ncclCommAbort, so a stuck abort blocked
// every later call on the handle (a shrink with a 1 s deadline had not returned after 3 s).
TEST(nccl_a_stuck_abort_blocks_no_later_call_and_taints_the_process) {
  setenv("RESILIENT_COMM_ABORT_BOUND_MS", "200", 1);
  EmulatorOptions o;
  o.initNeverCompletes = true;
  o.abortHangs = true;
  World w = makeWorld(2, o, 30000);
  w[0].abort("give up the init");  // its ncclCommAbort never returns
  auto t0 = Clock::now();
  auto child = w[0].shrink({1}, true, in(1000));
  float x = 1;
  Status op = w[0].allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, in(1000));
  CHECK(msSince(t0) < 100) << "calls after a stuck abort waited " << msSince(t0) << " ms";
  CHECK(op.code() == StatusCode::kAborted) << op.toString();
  CHECK(eventually([] { return Reaper::tainted(); }, 2000)) << "the stuck abort taints the process";
  CHECK(Reaper::taintReason().find("ncclCommAbort") != std::string::npos) << Reaper::taintReason();
  w.api->release();
  w[1].abort("done");
  unsetenv("RESILIENT_COMM_ABORT_BOUND_MS");
}

// Defect 5: async ops ran on the worker thread and followed its stream, not the caller's
// current stream at the call: NCCL could read inputs before their producer wrote them. And the
// result must be ordered before the caller's later work on its stream without a host wait.
TEST(nccl_an_op_follows_the_callers_stream_at_the_call) {
  EmulatorOptions o;
  o.kernelTime = std::chrono::milliseconds(5);
  World w = makeWorld(2, o);
  allReady(w);
  std::atomic<bool> ok{true};
  onEachRank(2, [&](int r) {
    auto caller = device::emu::Stream::create(0);
    device::emu::setCurrentStream(caller);
    std::vector<float> x(64, 0.0f);
    caller->enqueue([&x, r] {  // a producer still running when the op is called
      std::this_thread::sleep_for(std::chrono::milliseconds(30));  // models a long kernel
      std::fill(x.begin(), x.end(), static_cast<float>(r + 1));
    });
    auto op = w[r].launch("all_reduce", in(5000), nullptr, [&] {
      return w[r].allReduce(x.data(), x.size(), DataType::kFloat32, RedOp::kSum, in(5000));
    });
    CHECK(op.isOk()) << op.status().toString();
    auto t0 = Clock::now();
    Result<bool> ordered = op.value()->blockCurrentStream();
    CHECK(ordered.isOk() && ordered.value());
    CHECK(msSince(t0) < 5) << "blockCurrentStream must not wait on the host";
    std::atomic<float> seen{-1};
    caller->enqueue([&] { seen = x[0]; });  // a consumer of the result on the caller's stream
    CHECK(eventually([&] { return seen.load() >= 0; }));
    if (seen.load() != 3.0f) {
      ok = false;
    }
    device::emu::setCurrentStream(nullptr);
  });
  CHECK(ok) << "the op read its input before the caller's producer wrote it, or the consumer ran early";
}

// Defect 6: a communicator and its shrunk child shared one stream state (an unsynchronised
// deque): a child's op could complete early, or wait behind its parent's stuck work.
TEST(nccl_a_child_has_a_stream_of_its_own) {  // a split's child, as a shrink's
  World w = makeWorld(2, {});
  allReady(w);
  std::mutex gate;
  gate.lock();
  for (auto& s : w.streams) {
    streamOf(*s).enqueue([&gate] { std::lock_guard<std::mutex> wait(gate); });  // parent's stream stuck
  }
  std::vector<std::shared_ptr<Communicator>> kids(2);
  onEachRank(2, [&](int r) {
    auto c = w[r].split(0, r, in(5000));
    CHECK(c.isOk() && c.value()) << c.status().toString();
    kids[r] = c.take();
  });
  CHECK(allReduceOnEach({kids[0].get(), kids[1].get()})) << "the child's op waited behind its parent's stream";
  gate.unlock();
}

// Defect 7: on a timeout or abort the op returned and its tensors went back to the allocator
// while the kernel could still write them. The op must hold them until its end event completes.
TEST(nccl_an_ops_tensors_are_held_until_its_end_event_completes) {
  World w = makeWorld(2, {});
  allReady(w);
  std::mutex gate;
  gate.lock();
  streamOf(*w.streams[0]).enqueue([&gate] { std::lock_guard<std::mutex> wait(gate); });  // kernel cannot start
  auto tensors = std::make_shared<std::vector<float>>(8, 1.0f);
  std::weak_ptr<std::vector<float>> alive = tensors;
  auto op = w[0].launch("all_reduce", in(100), tensors, [&] {
    return w[0].allReduce(tensors->data(), 8, DataType::kFloat32, RedOp::kSum, in(100));
  });
  CHECK(op.isOk());
  tensors.reset();
  Status st = op.value()->hostWait(in(3000), nullptr);
  CHECK(st.code() == StatusCode::kTimeout) << st.toString();
  CHECK(w[0].state() == CommState::kError) << "the watchdog failed the communicator at the deadline";
  CHECK(!alive.expired()) << "the tensors were released while the kernel could still run";
  gate.unlock();
  CHECK(eventually([&] { return alive.expired(); })) << "released once the kernel left the device";
  w[1].abort("done");
}

// Defect 8: an error from an event or stream call (a sticky CUDA error) escaped without failing
// the communicator, which stayed Ready.
TEST(nccl_a_device_error_fails_the_communicator) {
  World w = makeWorld(1, {});
  allReady(w);
  auto op = w[0].launch("all_reduce", in(2000), nullptr, [&]() -> Status {
    float x = 1;
    RC_RETURN_IF_ERROR(w[0].onStream([] { throw std::runtime_error("an illegal memory access"); }));
    return w[0].allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, in(2000));
  });
  CHECK(op.isOk());
  Status st = op.value()->hostWait(in(2000), nullptr);
  CHECK(st.code() == StatusCode::kInternal && st.message().find("illegal memory access") != std::string::npos)
      << st.toString();
  CHECK(eventually([&] { return w[0].state() == CommState::kError; }));
  CHECK(w[0].error().message().find("illegal memory access") != std::string::npos) << w[0].error().toString();
}

// Defect 9: makeCurrent() changed the caller's current device and never restored it.
TEST(nccl_the_callers_device_is_restored) {
  World w = makeWorld(1, {}, 5000, /*device=*/2);
  allReady(w);
  auto other = device::emu::makeEmulatedStreamOps(5);
  Result<device::DeviceGuard> mine = other->bind();
  CHECK(device::emu::currentDevice() == 5);
  float x = 1;
  CHECK(w[0].allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, in(2000)).isOk());
  CHECK(device::emu::currentDevice() == 5) << "the op left device " << device::emu::currentDevice() << " current";
}

// Defect 11: the destructor busy-spun forever when ncclCommFinalize never settled (a peer gone).
TEST(nccl_a_healthy_communicator_is_finalized_and_a_finalize_that_never_settles_is_aborted) {
  setenv("RESILIENT_COMM_ABORT_BOUND_MS", "200", 1);
  {
    World w = makeWorld(2, {});
    allReady(w);
    auto api = w.api;
    onEachRank(2, [&](int r) { w.comms[r].reset(); });  // both finalize: it settles
    CHECK(eventually([&] { return api->stats().destroys == 2; }));
    CHECK(api->stats().aborts == 0);
  }
  World w = makeWorld(2, {});
  allReady(w);
  auto api = w.api;
  auto t0 = Clock::now();
  w.comms[0].reset();  // its peer never finalizes
  CHECK(msSince(t0) < 50) << "the destructor waited " << msSince(t0) << " ms";
  CHECK(eventually([&] { return api->stats().aborts == 1; }, 2000)) << "aborted once the finalize did not settle";
  CHECK(api->stats().destroys == 0);
  w[1].abort("done");
  unsetenv("RESILIENT_COMM_ABORT_BOUND_MS");
}

// Overlap (issue #14): with 20 ms kernels, a launch returns to the host at once, 8 launched back
// to back are in flight together (none has completed when the 8th launch returns), and only a
// host wait waits. A round can lose the race on a loaded host (the 8 launches then take longer
// than a kernel), so one round of four must show it; a launch that waited for its kernel
// would fail every round.
TEST(nccl_ops_overlap_the_host) {
  EmulatorOptions o;
  // (With 5 ms kernels and 3 rounds a loaded CI machine once took longer than a kernel to
  // make the 8 launches in every round.)
  o.kernelTime = std::chrono::milliseconds(20);
  World w = makeWorld(2, o);
  allReady(w);
  std::vector<double> launchUs[2];
  std::atomic<int> overlapped[2] = {0, 0};
  onEachRank(2, [&](int r) {
    for (int round = 0; round < 4; ++round) {
      std::vector<std::vector<float>> bufs(8, std::vector<float>(16, static_cast<float>(r + 1)));
      std::vector<std::shared_ptr<PendingOp>> ops;
      for (auto& b : bufs) {
        auto s = Clock::now();
        auto op = w[r].launch("all_reduce", in(5000), nullptr, [&] {
          return w[r].allReduce(b.data(), b.size(), DataType::kFloat32, RedOp::kSum, in(5000));
        });
        launchUs[r].push_back(1000 * msSince(s));
        CHECK(op.isOk());
        ops.push_back(op.take());
      }
      int done = 0;
      for (auto& op : ops) {
        done += op->poll().isOk() ? 1 : 0;
      }
      overlapped[r] += done == 0 ? 1 : 0;
      for (auto& op : ops) {
        CHECK(op->hostWait(in(5000), nullptr).isOk());
      }
      CHECK(bufs[7][0] == 3.0f);
    }
  });
  std::vector<double> all(launchUs[0]);
  all.insert(all.end(), launchUs[1].begin(), launchUs[1].end());
  std::sort(all.begin(), all.end());
  std::printf("launch us: median %.0f, max %.0f\n", all[all.size() / 2], all.back());
  CHECK(overlapped[0] > 0 && overlapped[1] > 0) << "8 launches were never all in flight together";
  CHECK(all[all.size() / 2] <= 1000) << "median launch " << all[all.size() / 2] << " us";
}

TEST(nccl_bad_exclude_lists_are_rejected) {
  World w = makeWorld(1, {});
  allReady(w);
  for (std::vector<int> bad : {std::vector<int>{0}, {3}, {-1}}) {
    auto c = w[0].shrink(bad, false, in(1000));
    CHECK(c.status().code() == StatusCode::kInvalidArgument) << c.status().toString();
  }
}

TEST(nccl_versions_without_shrink_split_grow_fall_back_to_a_fresh_init) {
  EmulatorOptions o;
  o.version = ncclVersionCode(2, 17, 0);
  o.missingOptionalSymbols = true;
  World w = makeWorld(2, o);
  allReady(w);
  std::vector<std::shared_ptr<Communicator>> kids(2);
  onEachRank(2, [&](int r) {
    auto c = w[r].split(0, r, in(5000));
    CHECK(c.isOk() && c.value()) << c.status().toString();
    kids[r] = c.take();
  });
  CHECK(allReduceOnEach({kids[0].get(), kids[1].get()}));
  CHECK(w.api->stats().splits == 0 && w.api->stats().inits == 4);
  auto grown = growByOneJoiner(w);
  CHECK(allReduceOnEach({grown[0].get(), grown[1].get(), grown[2].get()}));
  CHECK(w.api->stats().grows == 0);
}

TEST(nccl_native_grow_adds_a_joiner) {
  World w = makeWorld(2, {});
  allReady(w);
  auto grown = growByOneJoiner(w);
  CHECK(allReduceOnEach({grown[0].get(), grown[1].get(), grown[2].get()}));
  CHECK(w.api->stats().grows == 3 && w.api->stats().inits == 2);
  CHECK(w.api->stats().misuse == 0);
}

TEST(nccl_init_that_never_completes_is_aborted_at_the_deadline) {
  EmulatorOptions o;
  o.initNeverCompletes = true;
  World w = makeWorld(1, o, 30000);
  auto t0 = Clock::now();
  Status st = w[0].waitReady(in(150));
  CHECK(st.code() == StatusCode::kTimeout) << st.toString();
  CHECK(msSince(t0) >= 140 && msSince(t0) < 1000) << msSince(t0);
  CHECK(w[0].state() == CommState::kAborted);
  CHECK(eventually([&] { return w.api->stats().aborts == 1; }));
}

TEST(nccl_too_old_a_library_is_refused_clearly) {
  EmulatorOptions o;
  o.version = ncclVersionCode(2, 13, 4);
  auto api = std::make_shared<NcclEmulator>(o);
  NcclOptions opts;
  opts.store = c10::make_intrusive<c10d::HashStore>();
  auto c = NcclCommunicator::create(api, device::emu::makeEmulatedStreamOps(0), opts, in(1000));
  CHECK(!c.isOk());
  CHECK(c.status().message().find("too old") != std::string::npos) << c.status().toString();
  CHECK(c.status().message().find("2.13.4") != std::string::npos) << c.status().toString();
}
