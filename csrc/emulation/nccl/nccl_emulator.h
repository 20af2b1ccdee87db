// NcclEmulator: an NcclApi that behaves like the real libnccl where the NCCL transport depends
// on it, on CPU, moving real bytes between real processes. Test-only in purpose (CPU tests, and
// RESILIENT_COMM_NCCL_EMULATE=1, which sends resilient_nccl's CPU tensors through the NCCL
// communicator on it), but built into the library so the whole stack can run on it.
//
// What it models, each rule from NCCL's own source (docs/nccl.md lists them with where NCCL
// does each one):
// - Non-blocking communicators: init, every collective and group, split, shrink, grow,
//   revoke and finalize return ncclInProgress and finish on a background thread; the
//   communicator's async error says ncclInProgress until then. A call on a communicator whose
//   previous call has not settled fails with ncclInvalidArgument and leaves that error set.
// - A collective's kernel reaches the stream only after the call returned (launchDelay), and
//   runs asynchronously on the emulated stream (emulation/device/emulated_device.h), for kernelTime at
//   least; an event recorded before it is on the stream completes before it runs.
// - Child handles: ncclCommInitRankConfig and ncclCommGrow write the handle at the call;
//   ncclCommSplit and ncclCommShrink write NULL at the call and the child later, from their
//   own thread, into the caller's pointer (which must still be valid then).
// - Errors: a peer that dies (or any network failure) leaves the kernel spinning and sets
//   ncclRemoteError as the async error (peerDeathHangs: it only spins, as intra-node transports
//   do); errors are sticky and every later call returns them; ncclCommDestroy and
//   ncclCommFinalize refuse a communicator with an error.
// - ncclCommAbort stops the kernels, joins the background threads (an init's, a child's init
//   through its parent), then frees the communicator: any later use of the handle is counted
//   as `misuse` (undefined behaviour in the real library). NCCL_SHRINK_ABORT aborts the
//   parent's kernels before the shrink; ncclCommRevoke stops them and makes the communicator
//   quiescent (ncclInProgress, then ncclSuccess), after which collectives are ncclInvalidUsage
//   and only shrink, split, abort or destroy may follow.
// The data path under it is the project's TCP transport: each emulated communicator owns a
// TcpCommunicator (bootstrapped through a root started by ncclGetUniqueId, as NCCL's is), and a
// kernel runs its collectives on it.
//
// Threads: any, as the real library; ncclCommAbort may be called while other threads use the
// communicator's handle only in the ways NCCL allows (none); the transport never does.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "comm/device_transport.h"
#include "transport/nccl/nccl_api.h"

namespace resilient_comm::nccl {

struct EmulatorOptions {
  int version = ncclVersionCode(2, 30, 0);
  bool missingOptionalSymbols = false;  // as if the library lacked split/shrink/revoke/grow
  // How long after a call returns its kernels reach the stream (NCCL's launch thread).
  std::chrono::microseconds launchDelay{20};
  // Device time of every kernel (at least).
  std::chrono::microseconds kernelTime{0};
  // A dead peer makes the kernel spin with no async error (an intra-node transport) instead
  // of ncclRemoteError (the network proxy's report).
  bool peerDeathHangs = false;
  // Faults for tests.
  bool initNeverCompletes = false;  // an init's bootstrap never finishes (until aborted)
  bool abortHangs = false;          // ncclCommAbort blocks until release()
  // ncclCommShrink refuses a parent whose network reported an error, NCCL_SHRINK_ABORT or not
  // (one reading of ncclCommInitChildComm: ncclCommEnsureReady returns the async error).
  bool shrinkFailsAfterError = false;
};

class NcclEmulator : public NcclApi {
 public:
  explicit NcclEmulator(EmulatorOptions options);
  ~NcclEmulator() override;

  int version() const override {
    return options_.version;
  }
  std::string path() const override {
    return "emulator";
  }
  bool hasSymbol(const char* name) const override;

#define RC_NCCL_EMU_METHOD(symbol, method, required, params, args) ncclResult_t method params override;
  RC_NCCL_API(RC_NCCL_EMU_METHOD)
#undef RC_NCCL_EMU_METHOD

  const char* getErrorString(ncclResult_t r) override;
  const char* getLastError(ncclComm_t comm) override;

  // Unblocks every abort held by abortHangs.
  void release();
  const EmulatorOptions& options() const {
    return options_;
  }

  struct Stats {
    std::atomic<int> inits{0}, aborts{0}, destroys{0}, finalizes{0}, revokes{0}, shrinks{0}, splits{0}, grows{0},
        kernels{0};
    std::atomic<int> lastShrinkFlags{-1};
    // Calls on a handle that was aborted or destroyed (or never made): undefined behaviour in the
    // real library. Every one is logged.
    std::atomic<int> misuse{0};
  };
  Stats& stats() {
    return *stats_;
  }

 private:
  struct State;
  EmulatorOptions options_;
  std::shared_ptr<Stats> stats_;
  std::shared_ptr<State> state_;
};

// True when RESILIENT_COMM_NCCL_EMULATE=1.
bool emulationRequested();
// The process's emulator for RESILIENT_COMM_NCCL_EMULATE=1, made on first use with the options
// of the RESILIENT_COMM_NCCL_EMULATE_* knobs.
std::shared_ptr<NcclEmulator> processEmulator();
// The registry entry that carries `backend`'s CPU tensors on the NCCL code path: the process's
// emulator and emulated streams, enabled by RESILIENT_COMM_NCCL_EMULATE=1.
DeviceTransport emulatedNcclTransport(std::string backend);

}  // namespace resilient_comm::nccl
