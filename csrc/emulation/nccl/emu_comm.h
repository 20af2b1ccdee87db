// The NCCL emulator's internals (see nccl_emulator.h): one emulated communicator, the jobs that
// finish its non-blocking calls, and the thread-local group a call joins.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/abort_token.h"
#include "emulation/device/emulated_device.h"
#include "transport/nccl/nccl_types.h"
#include "transport/tcp/tcp_communicator.h"

namespace resilient_comm::nccl::emu {

constexpr uint64_t kLiveMagic = 0x6e63636c2d656d75ULL;  // "nccl-emu"
constexpr uint64_t kDeadMagic = 0x646561642d636f6dULL;  // "dead-com"

// What ncclComm_t points to. Never freed (a freed handle stays recognisable as dead, so a use
// after abort is counted instead of crashing the test that made it).
struct EmuComm {
  std::atomic<uint64_t> magic{kLiveMagic};
  int rank = 0;
  int nranks = 1;
  int device = 0;  // the caller's current device at init, as NCCL binds it
  bool blocking = true;
  std::string name;

  std::atomic<int> result{ncclSuccess};     // comm->asyncResult: init, groups, moves, revoke
  std::atomic<int> netResult{ncclSuccess};  // what a kernel saw of the network (the proxy's result)
  std::atomic<bool> abortFlag{false};       // kernels exit at once while it is set
  std::atomic<bool> revoked{false};
  std::atomic<bool> finalizeCalled{false};
  AbortToken initAbort;  // interrupts a bootstrap in progress

  std::mutex netMu;  // one network user at a time: a kernel, or a split/grow's exchange
  std::shared_ptr<tcp::TcpCommunicator> net;  // set by the init job; guarded by mu

  mutable std::mutex mu;
  std::condition_variable cv;  // a job or a kernel ended, or abortFlag was set
  int jobs = 0;                // background jobs of this communicator still running
  int kernels = 0;             // kernels on streams, not finished
  int inNet = 0;               // kernels inside a network op right now
  std::string lastError;       // what the last asynchronous failure said
  std::vector<EmuComm*> childrenInInit;  // a split/shrink child being built (the parent's abort stops it)
  int growsInInit = 0;  // ncclCommGrow children still bootstrapping over this (the parent's) network

  ncclResult_t asyncError() const {
    int r = result.load();
    return static_cast<ncclResult_t>(r != ncclSuccess ? r : netResult.load());
  }
  std::shared_ptr<tcp::TcpCommunicator> network() const {
    std::lock_guard<std::mutex> lock(mu);
    return net;
  }
};

// One NCCL call queued in the calling thread's group.
struct Task {
  EmuComm* comm = nullptr;
  std::shared_ptr<device::emu::Stream> stream;
  std::function<Status(tcp::TcpCommunicator&)> collective;  // a collective's work on the network
  std::optional<P2POp> p2p;                    // or a send/recv, batched with the group's others
};

}  // namespace resilient_comm::nccl::emu
