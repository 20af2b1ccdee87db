// The NCCL emulator's shared state (see nccl_emulator.h): the communicators' lifecycle helpers,
// the launch thread, and the calling thread's group. Used by nccl_emulator.cpp (lifecycle) and
// emu_collectives.cpp (collectives, groups, kernels).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "emulation/nccl/emu_comm.h"
#include "emulation/nccl/nccl_emulator.h"

namespace resilient_comm::nccl {

namespace emu {

// Records `why` as the calling thread's last error (ncclGetLastError) and returns `r`.
ncclResult_t failWith(ncclResult_t r, std::string why);
// The NCCL code for a failure of the network under a communicator.
ncclResult_t fromStatus(const Status& st);
// Gives `c` its network; aborts it at once if `c` was aborted meanwhile.
void attachNet(EmuComm* c, std::shared_ptr<tcp::TcpCommunicator> net);

// Runs posted jobs at their due time, in order: NCCL's launch thread.
class Launcher {
 public:
  using Clock = std::chrono::steady_clock;
  Launcher();
  ~Launcher();
  void post(Clock::time_point due, std::function<void()> fn);

 private:
  struct Queue;
  std::shared_ptr<Queue> q_;
};

}  // namespace emu

struct NcclEmulator::State : std::enable_shared_from_this<NcclEmulator::State> {
  State(EmulatorOptions o, std::shared_ptr<Stats> s) : options(o), stats(std::move(s)) {}

  const EmulatorOptions options;
  std::shared_ptr<Stats> stats;
  emu::Launcher launcher;

  emu::EmuComm* newComm(int rank, int nranks, bool blocking, int device);
  // The communicator behind `h`, or null (and a counted misuse) if it was freed or never made.
  emu::EmuComm* live(ncclComm_t h, const char* call);
  // init.cc ncclCommEnsureReady: ncclInvalidArgument while the previous call is in progress,
  // else the communicator's async error.
  ncclResult_t ensureReady(emu::EmuComm* c, const char* call);
  // A failed call on a non-blocking communicator leaves its error as the async error.
  ncclResult_t markFailed(emu::EmuComm* c, ncclResult_t r);
  // Runs fn on a thread of its own, counted as a job of `c` until it returns.
  void startJob(emu::EmuComm* c, std::function<void()> fn);
  // A job's end: the async error becomes ncclSuccess, or the failure's code.
  void settle(emu::EmuComm* c, const Status& s);
  // For blocking communicators: waits until the job settled, and returns its result.
  ncclResult_t waitSettled(emu::EmuComm* c);
  Status untilAborted(emu::EmuComm* c);
  // Sets the abort flags of `c` and of its children in init, and interrupts their networks.
  void raiseAbort(emu::EmuComm* c, const std::string& why);
  // NCCL_SHRINK_ABORT's and revoke's first step: the kernels exit (a network op in progress is
  // interrupted), then the abort flag is lowered again.
  void stopKernels(emu::EmuComm* c, const std::string& why);
  // Waits until the kernels of `c` left the streams (and its jobs ended, with jobsToo).
  void drain(emu::EmuComm* c, bool jobsToo);
  void free(emu::EmuComm* c);
  // ncclCommAbort/Destroy/Finalize of a parent while an ncclCommGrow child still bootstraps over
  // it (bootstrap.cc bootstrapInit uses parent->bootstrap; NCCL's guide: destroy the parent after
  // the grow completed): counted as misuse and logged. The child's job fails, never crashes.
  void checkNoGrowInInit(emu::EmuComm* c, const char* call);
  // A split/shrink job's end: builds the child over `child`, writes it into `out`, settles both.
  void finishChild(emu::EmuComm* parent, Result<std::shared_ptr<Communicator>> child, ncclComm_t* out, bool blocking);
  const char* lastError(ncclComm_t comm);

  // Collectives (emu_collectives.cpp): ncclEnqueueCheck, groups and kernels.
  ncclResult_t enqueue(ncclComm_t h, cudaStream_t stream, const char* call, ncclResult_t argCheck,
                       const std::string& argError, emu::Task task);
  ncclResult_t groupStart();
  ncclResult_t groupEnd();
  void launch(std::vector<emu::Task> tasks);

  void release();
  void waitReleased();

 private:
  std::mutex releaseMu_;
  std::condition_variable releaseCv_;
  bool released_ = false;
};

}  // namespace resilient_comm::nccl
