// The NCCL emulator keeps the rules of the real library that the transport depends on
// (docs/nccl.md): driven here through its raw API, as a user of libnccl would call it.
#include <cstring>
#include <thread>

#include "nccl_rig.h"  // includes check.h last

using namespace resilient_comm;
using namespace resilient_comm::nccl;
using namespace rc_test;

namespace {

ncclConfig_t nb() {
  return nonBlockingConfig();
}

cudaStream_t cs(const std::shared_ptr<device::emu::Stream>& s) {
  return reinterpret_cast<cudaStream_t>(s.get());
}

// What a collective call on a non-blocking communicator may answer: the async error at its end
// (enqueue.cc ncclEnqueueCheck), i.e. ncclInProgress, or already the launch's result.
bool launchedOrFailed(ncclResult_t r) {
  return r == ncclInProgress || r == ncclSuccess || r == ncclRemoteError;
}

// Polls the async error until it leaves ncclInProgress.
ncclResult_t settled(NcclApi& api, ncclComm_t c, int ms = 5000) {
  ncclResult_t r = ncclInProgress;
  Deadline dl = in(ms);
  while (r == ncclInProgress && !dl.passed()) {
    CHECK(api.commGetAsyncError(c, &r) == ncclSuccess);
    std::this_thread::yield();
  }
  return r;
}

// n ranks (threads) of one communicator made with the raw API; returns the handles.
std::vector<ncclComm_t> initAll(NcclEmulator& api, int n) {
  ncclUniqueId id{};
  CHECK(api.getUniqueId(&id) == ncclSuccess);
  std::vector<ncclComm_t> comms(n, nullptr);
  for (int r = 0; r < n; ++r) {
    ncclConfig_t cfg = nb();
    CHECK(api.commInitRankConfig(&comms[r], n, id, r, &cfg) == ncclInProgress);
    CHECK(comms[r] != nullptr) << "the handle is written at the call";
  }
  for (int r = 0; r < n; ++r) {
    CHECK(settled(api, comms[r]) == ncclSuccess);
  }
  return comms;
}

}  // namespace

TEST(emulator_init_is_in_progress_with_the_handle_written_at_the_call) {
  NcclEmulator api({});
  auto comms = initAll(api, 2);
  for (ncclComm_t c : comms) {
    CHECK(api.commAbort(c) == ncclSuccess);
  }
  CHECK(api.stats().misuse == 0);
}

TEST(emulator_kernels_reach_the_stream_after_the_call_returns) {
  EmulatorOptions o;
  o.launchDelay = std::chrono::milliseconds(30);
  NcclEmulator api(o);
  auto comms = initAll(api, 1);
  auto stream = device::emu::Stream::create(0);
  float x = 2;
  CHECK(api.allReduce(&x, &x, 1, ncclFloat32, ncclSum, comms[0], cs(stream)) == ncclInProgress);
  CHECK(stream->tail() == 0) << "no kernel on the stream when the call returns";
  ncclResult_t r = ncclSuccess;
  CHECK(api.commGetAsyncError(comms[0], &r) == ncclSuccess && r == ncclInProgress);
  CHECK(settled(api, comms[0]) == ncclSuccess);
  CHECK(stream->tail() == 1) << "the kernel is on the stream once the call settled";
  CHECK(api.commAbort(comms[0]) == ncclSuccess);
}

TEST(emulator_a_call_before_the_previous_one_settled_is_an_invalid_argument) {
  EmulatorOptions o;
  o.launchDelay = std::chrono::milliseconds(30);
  NcclEmulator api(o);
  auto comms = initAll(api, 1);
  auto stream = device::emu::Stream::create(0);
  float x = 1;
  CHECK(api.allReduce(&x, &x, 1, ncclFloat32, ncclSum, comms[0], cs(stream)) == ncclInProgress);
  CHECK(api.allReduce(&x, &x, 1, ncclFloat32, ncclSum, comms[0], cs(stream)) == ncclInvalidArgument);
  CHECK(std::string(api.getLastError(comms[0])).find("before the previous operation") != std::string::npos)
      << api.getLastError(comms[0]);
  CHECK(api.commAbort(comms[0]) == ncclSuccess);
}

TEST(emulator_split_writes_the_child_late_and_a_nocolor_rank_gets_null) {
  EmulatorOptions o;
  o.launchDelay = std::chrono::milliseconds(5);
  NcclEmulator api(o);
  auto comms = initAll(api, 3);
  std::vector<ncclComm_t> children(3, reinterpret_cast<ncclComm_t>(0x1));  // must be overwritten with NULL
  onEachRank(3, [&](int r) {
    ncclConfig_t cfg = nb();
    int color = r == 2 ? kNcclSplitNoColor : 0;
    CHECK(api.commSplit(comms[r], color, r, &children[r], &cfg) == ncclInProgress);
    // NCCL stores the child from its own thread (COMPILER_ATOMIC_STORE): read it atomically too.
    CHECK(__atomic_load_n(&children[r], __ATOMIC_ACQUIRE) == nullptr) << "the child is NULL when the call returns";
    CHECK(settled(api, comms[r]) == ncclSuccess);
  });
  CHECK(children[0] != nullptr && children[1] != nullptr && children[2] == nullptr);
  CHECK(settled(api, children[0]) == ncclSuccess);
  for (ncclComm_t c : {comms[0], comms[1], comms[2], children[0], children[1]}) {
    CHECK(api.commAbort(c) == ncclSuccess);
  }
  CHECK(api.stats().misuse == 0);
}

TEST(emulator_aborting_a_parent_kills_its_childs_init) {
  NcclEmulator api({});
  auto comms = initAll(api, 2);
  ncclComm_t child = nullptr;
  ncclConfig_t cfg = nb();
  // Only rank 0 splits: the child's init waits for rank 1 forever.
  CHECK(api.commSplit(comms[0], 0, 0, &child, &cfg) == ncclInProgress);
  auto t0 = Clock::now();
  CHECK(api.commAbort(comms[0]) == ncclSuccess);
  CHECK(msSince(t0) < 1000) << msSince(t0);
  CHECK(child == nullptr || settled(api, child) != ncclSuccess) << "the child's init must not have completed";
  CHECK(api.commAbort(comms[1]) == ncclSuccess);
}

TEST(emulator_a_dead_peer_is_a_remote_error_and_the_kernel_spins_until_abort) {
  NcclEmulator api({});
  auto comms = initAll(api, 2);
  CHECK(api.commAbort(comms[1]) == ncclSuccess);  // the peer's process "dies"
  auto stream = device::emu::Stream::create(0);
  float x = 1;
  CHECK(launchedOrFailed(api.allReduce(&x, &x, 1, ncclFloat32, ncclSum, comms[0], cs(stream))));
  ncclResult_t launched = settled(api, comms[0]);  // the kernel may have failed by the time we look
  CHECK(launched == ncclSuccess || launched == ncclRemoteError) << launched;
  CHECK(eventually([&] {
    ncclResult_t r = ncclSuccess;
    api.commGetAsyncError(comms[0], &r);
    return r == ncclRemoteError;
  }));
  CHECK(!stream->reached(1)) << "the kernel does not finish on a dead peer";
  CHECK(api.commDestroy(comms[0]) == ncclRemoteError) << "destroy refuses a communicator with an error";
  CHECK(api.commAbort(comms[0]) == ncclSuccess);
  CHECK(eventually([&] { return stream->reached(1); })) << "the abort makes the kernel exit";
  CHECK(api.stats().misuse == 0);
}

TEST(emulator_revoke_quiesces_then_refuses_collectives) {
  NcclEmulator api({});
  auto comms = initAll(api, 1);
  auto stream = device::emu::Stream::create(0);
  CHECK(api.commRevoke(comms[0], 1) == ncclInvalidArgument);
  CHECK(api.commRevoke(comms[0], kNcclRevokeDefault) == ncclInProgress);
  CHECK(settled(api, comms[0]) == ncclSuccess);
  float x = 1;
  CHECK(api.allReduce(&x, &x, 1, ncclFloat32, ncclSum, comms[0], cs(stream)) == ncclInvalidUsage);
  CHECK(api.commFinalize(comms[0]) == ncclInvalidArgument) << "finalize after revoke is invalid";
  CHECK(api.commAbort(comms[0]) == ncclSuccess);
}

TEST(emulator_shrink_abort_works_on_a_parent_with_a_remote_error) {
  NcclEmulator api({});
  auto comms = initAll(api, 3);
  CHECK(api.commAbort(comms[2]) == ncclSuccess);
  std::vector<ncclComm_t> children(2, nullptr);
  onEachRank(2, [&](int r) {
    auto stream = device::emu::Stream::create(0);
    float x = 1;
    CHECK(launchedOrFailed(api.allReduce(&x, &x, 1, ncclFloat32, ncclSum, comms[r], cs(stream))));
    CHECK(eventually([&] {
      ncclResult_t e = ncclSuccess;
      api.commGetAsyncError(comms[r], &e);
      return e == ncclRemoteError;
    }));
    int ex[1] = {2};
    ncclConfig_t cfg = nb();
    CHECK(api.commShrink(comms[r], ex, 1, &children[r], &cfg, kNcclShrinkAbort) == ncclInProgress);
    CHECK(settled(api, comms[r]) == ncclSuccess);
    CHECK(children[r] != nullptr);
    float y = static_cast<float>(r + 1);
    CHECK(launchedOrFailed(api.allReduce(&y, &y, 1, ncclFloat32, ncclSum, children[r], cs(stream))));
    CHECK(settled(api, children[r]) == ncclSuccess);
    CHECK(eventually([&] { return stream->reached(stream->tail()); }));
    CHECK(y == 3.0f) << y;
  });
  for (ncclComm_t c : {comms[0], comms[1], children[0], children[1]}) {
    CHECK(api.commAbort(c) == ncclSuccess);
  }
  CHECK(api.stats().misuse == 0);
}

TEST(emulator_counts_a_use_after_abort_as_misuse) {
  NcclEmulator api({});
  auto comms = initAll(api, 1);
  CHECK(api.commAbort(comms[0]) == ncclSuccess);
  ncclResult_t r = ncclSuccess;
  CHECK(api.commGetAsyncError(comms[0], &r) == ncclInvalidArgument);
  CHECK(api.stats().misuse == 1);
}
