// The NCCL emulator's collectives: ncclEnqueueCheck's rules (enqueue.cc), groups (group.cc) and
// kernels on the emulated streams. See nccl_emulator.h.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstring>
#include <optional>
#include <utility>

#include "common/logging.h"
#include "emulation/nccl/emu_state.h"

namespace resilient_comm::nccl {

using emu::EmuComm;
using emu::Task;

namespace {

thread_local int tlsDepth = 0;
thread_local std::vector<Task> tlsTasks;
thread_local ncclResult_t tlsGroupError = ncclSuccess;
thread_local int tlsBlocking = -1;  // group.cc ncclGroupBlocking: the first communicator's mode

size_t typeSize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
  }
  return 0;
}

// The element types the network under the emulator reduces (NCCL also reduces uint32, uint64
// and fp8: the emulator refuses those with ncclInvalidArgument).
std::optional<DataType> reduceType(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return DataType::kInt8;
    case ncclUint8:
      return DataType::kUInt8;
    case ncclInt32:
      return DataType::kInt32;
    case ncclInt64:
      return DataType::kInt64;
    case ncclFloat16:
      return DataType::kFloat16;
    case ncclBfloat16:
      return DataType::kBFloat16;
    case ncclFloat32:
      return DataType::kFloat32;
    case ncclFloat64:
      return DataType::kFloat64;
    default:
      return std::nullopt;
  }
}

std::optional<RedOp> reduceOp(ncclRedOp_t op) {
  switch (op) {
    case ncclSum:
      return RedOp::kSum;
    case ncclProd:
      return RedOp::kProd;
    case ncclMax:
      return RedOp::kMax;
    case ncclMin:
      return RedOp::kMin;
    case ncclAvg:
      return RedOp::kAvg;
    default:
      return std::nullopt;
  }
}

// ArgsCheck (enqueue.cc) for a reduction: "" when the arguments are valid.
std::string checkReduction(ncclDataType_t dt, ncclRedOp_t op, size_t count, const void* send, const void* recv) {
  std::optional<DataType> t = reduceType(dt);
  if (typeSize(dt) == 0) {
    return "invalid datatype " + std::to_string(dt);
  }
  if (!t) {
    return "the emulator does not reduce datatype " + std::to_string(dt);
  }
  if (!reduceOp(op)) {
    return "invalid or unsupported reduction op " + std::to_string(op);
  }
  if (op == ncclAvg && !isFloatingPoint(*t)) {
    return "the emulator averages floating-point types only";
  }
  if (count > 0 && (send == nullptr || recv == nullptr)) {
    return "a NULL buffer with a non-zero count";
  }
  return "";
}

std::string checkRoot(const EmuComm& c, int root) {
  return root < 0 || root >= c.nranks ? "root " + std::to_string(root) + " out of range" : "";
}

// A group's sends and receives: those between this rank and itself (NCCL allows them) are copies,
// matched in order; the others go over the network together.
Status sendRecv(tcp::TcpCommunicator& net, const std::vector<P2POp>& ops) {
  std::vector<P2POp> remote;
  std::vector<const P2POp*> selfSends;
  std::vector<const P2POp*> selfRecvs;
  for (const P2POp& op : ops) {
    if (op.peer != net.rank()) {
      remote.push_back(op);
    } else {
      (op.kind == P2POp::Kind::kSend ? selfSends : selfRecvs).push_back(&op);
    }
  }
  if (selfSends.size() != selfRecvs.size()) {
    return Status(StatusCode::kMismatch, "a send to itself without its receive (or the other way round)");
  }
  for (size_t i = 0; i < selfSends.size(); ++i) {
    if (selfSends[i]->bytes != selfRecvs[i]->bytes) {
      return Status(StatusCode::kMismatch, "a send to itself of " + std::to_string(selfSends[i]->bytes) +
                                               " bytes into a receive of " + std::to_string(selfRecvs[i]->bytes));
    }
    if (selfSends[i]->bytes > 0) {
      std::memmove(selfRecvs[i]->buf, selfSends[i]->buf, selfSends[i]->bytes);
    }
  }
  return remote.empty() ? Status::ok() : net.sendRecv(remote, Deadline::never());
}

}  // namespace

ncclResult_t NcclEmulator::State::enqueue(ncclComm_t h, cudaStream_t stream, const char* call, ncclResult_t argCheck,
                                          const std::string& argError, Task task) {
  EmuComm* c = live(h, call);
  auto groupErrCheck = [](ncclResult_t r) {  // group.cc ncclGroupErrCheck
    if (tlsDepth > 0 && r != ncclSuccess && r != ncclInProgress) {
      tlsGroupError = r;
    }
    return r;
  };
  if (c == nullptr) {
    return groupErrCheck(ncclInvalidArgument);
  }
  if (c->revoked) {
    return groupErrCheck(emu::failWith(ncclInvalidUsage, std::string(call) + ": communicator was revoked"));
  }
  ++tlsDepth;
  ncclResult_t ret = ensureReady(c, call);
  auto* s = reinterpret_cast<device::emu::Stream*>(stream);
  if (ret == ncclSuccess && argCheck != ncclSuccess) {
    ret = emu::failWith(argCheck, std::string(call) + ": " + argError);
  } else if (ret == ncclSuccess && s == nullptr) {
    ret = emu::failWith(ncclInvalidArgument, std::string(call) + ": the emulator needs an emulated stream");
  } else if (ret == ncclSuccess && s->device() != c->device) {
    ret = emu::failWith(ncclInvalidArgument, std::string(call) + ": a stream of emulated device " +
                                                 std::to_string(s->device()) + " with a communicator of device " +
                                                 std::to_string(c->device));
  } else if (ret == ncclSuccess && tlsBlocking != -1 && tlsBlocking != static_cast<int>(c->blocking)) {
    ret = emu::failWith(ncclInvalidArgument, "blocking and non-blocking communicators in the same group");
  }
  if (ret == ncclSuccess) {
    tlsBlocking = c->blocking;
    task.comm = c;
    task.stream = s->shared_from_this();
    tlsTasks.push_back(std::move(task));
  } else {
    markFailed(c, ret);
    groupErrCheck(ret);
  }
  ncclResult_t end = groupEnd();
  if (ret != ncclSuccess) {
    return ret;
  }
  if (end != ncclSuccess && end != ncclInProgress) {
    return end;
  }
  return c->blocking ? ncclSuccess : c->asyncError();
}

ncclResult_t NcclEmulator::State::groupStart() {
  ++tlsDepth;
  return ncclSuccess;
}

// group.cc ncclGroupEndInternal: the outermost end launches the group. Non-blocking: every
// communicator in it is ncclInProgress until the launch thread has put the kernels on their
// streams (launchDelay later), then ncclSuccess; the call returns ncclInProgress. An error
// inside the group is returned and left as every communicator's async error (groupCleanup).
ncclResult_t NcclEmulator::State::groupEnd() {
  if (tlsDepth == 0) {
    return emu::failWith(ncclInvalidUsage, "ncclGroupEnd: not in a group call");
  }
  if (--tlsDepth > 0) {
    return ncclSuccess;
  }
  std::vector<Task> tasks;
  tasks.swap(tlsTasks);
  ncclResult_t err = tlsGroupError;
  tlsGroupError = ncclSuccess;
  const int blocking = tlsBlocking;
  tlsBlocking = -1;
  std::vector<EmuComm*> comms;
  for (const Task& t : tasks) {
    if (std::find(comms.begin(), comms.end(), t.comm) == comms.end()) {
      comms.push_back(t.comm);
    }
  }
  if (err != ncclSuccess) {
    for (EmuComm* c : comms) {
      markFailed(c, err);
    }
    return err;
  }
  if (tasks.empty()) {
    return ncclSuccess;
  }
  if (blocking == 1) {
    launch(std::move(tasks));
    return ncclSuccess;
  }
  for (EmuComm* c : comms) {
    c->result = ncclInProgress;
    std::lock_guard<std::mutex> lock(c->mu);
    ++c->jobs;
  }
  launcher.post(emu::Launcher::Clock::now() + options.launchDelay,
                [self = shared_from_this(), tasks = std::move(tasks), comms]() mutable {
                  self->launch(std::move(tasks));
                  for (EmuComm* c : comms) {
                    std::lock_guard<std::mutex> lock(c->mu);
                    c->result = ncclSuccess;  // group.cc: ncclCommSetAsyncError(comm, ret) once launched
                    --c->jobs;
                    c->cv.notify_all();
                  }
                });
  return ncclInProgress;
}

namespace {

struct Kernel {
  EmuComm* comm;
  std::shared_ptr<device::emu::Stream> stream;
  std::vector<std::function<Status(tcp::TcpCommunicator&)>> collectives;
  std::vector<P2POp> p2p;  // progressed together, as one group's sends and receives are
};

}  // namespace

// One kernel per (communicator, stream) of the group. A kernel exits at once on an aborted
// communicator; after a network failure it spins until the communicator is aborted, with
// ncclRemoteError as the async error (or nothing, with peerDeathHangs); it lasts kernelTime at
// least.
void NcclEmulator::State::launch(std::vector<Task> tasks) {
  std::vector<Kernel> kernels;
  for (Task& t : tasks) {
    auto it = std::find_if(kernels.begin(), kernels.end(),
                           [&](const Kernel& k) { return k.comm == t.comm && k.stream == t.stream; });
    if (it == kernels.end()) {
      kernels.push_back(Kernel{t.comm, t.stream, {}, {}});
      it = kernels.end() - 1;
    }
    if (t.p2p) {
      it->p2p.push_back(*t.p2p);
    } else {
      it->collectives.push_back(std::move(t.collective));
    }
  }
  for (Kernel& k : kernels) {
    {
      std::lock_guard<std::mutex> lock(k.comm->mu);
      ++k.comm->kernels;
    }
    ++stats->kernels;
    std::shared_ptr<device::emu::Stream> stream = k.stream;
    stream->enqueue([self = shared_from_this(), k = std::move(k)] {
      EmuComm* c = k.comm;
      const auto started = std::chrono::steady_clock::now();
      Status st;
      bool ran = false;
      {
        std::lock_guard<std::mutex> busy(c->netMu);
        std::shared_ptr<tcp::TcpCommunicator> net;
        {
          std::lock_guard<std::mutex> lock(c->mu);
          if (!c->abortFlag && c->net) {
            net = c->net;
            ++c->inNet;
          }
        }
        if (net) {
          for (const auto& f : k.collectives) {
            if (!(st = f(*net)).isOk()) {
              break;
            }
          }
          if (st.isOk() && !k.p2p.empty()) {
            st = sendRecv(*net, k.p2p);
          }
          std::lock_guard<std::mutex> lock(c->mu);
          --c->inNet;
          ran = true;
        }
      }
      std::unique_lock<std::mutex> lock(c->mu);
      if (ran && !st.isOk() && !c->abortFlag) {
        c->lastError = "a kernel's network operation failed: " + st.message();
        if (!self->options.peerDeathHangs) {
          int expected = ncclSuccess;
          c->netResult.compare_exchange_strong(expected, emu::fromStatus(st));
        }
        RC_LOG(kInfo, "NCCL emulator: " << c->name << " rank " << c->rank << ": " << c->lastError
                                        << "; the kernel spins until the communicator is aborted");
        c->cv.wait(lock, [&] { return c->abortFlag.load(); });
      }
      if (self->options.kernelTime.count() > 0) {
        c->cv.wait_until(lock, started + self->options.kernelTime, [&] { return c->abortFlag.load(); });
      }
      --c->kernels;
      c->cv.notify_all();
    });
  }
}

// The API: each call checks its arguments (enqueue.cc ArgsCheck) and joins the caller's group.

ncclResult_t NcclEmulator::allReduce(const void* send, void* recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                                     ncclComm_t comm, cudaStream_t stream) {
  std::string bad = checkReduction(dt, op, count, send, recv);
  Task t;
  if (bad.empty()) {
    DataType type = *reduceType(dt);
    RedOp red = *reduceOp(op);
    size_t bytes = count * typeSize(dt);
    t.collective = [=](tcp::TcpCommunicator& net) {
      if (send != recv && bytes > 0) {
        std::memmove(recv, send, bytes);
      }
      return net.allReduce(recv, count, type, red, Deadline::never());
    };
  }
  return state_->enqueue(comm, stream, "ncclAllReduce", bad.empty() ? ncclSuccess : ncclInvalidArgument, bad,
                         std::move(t));
}

ncclResult_t NcclEmulator::broadcast(const void* send, void* recv, size_t count, ncclDataType_t dt, int root,
                                     ncclComm_t comm, cudaStream_t stream) {
  EmuComm* c = reinterpret_cast<EmuComm*>(comm);
  std::string bad = typeSize(dt) == 0 ? "invalid datatype" : (c != nullptr && c->magic == emu::kLiveMagic ? checkRoot(*c, root) : "");
  size_t bytes = count * typeSize(dt);
  Task t;
  t.collective = [=](tcp::TcpCommunicator& net) {
    if (net.rank() == root && send != recv && bytes > 0) {
      std::memmove(recv, send, bytes);
    }
    return net.broadcast(recv, bytes, DataType::kUInt8, root, Deadline::never());
  };
  return state_->enqueue(comm, stream, "ncclBroadcast", bad.empty() ? ncclSuccess : ncclInvalidArgument, bad,
                         std::move(t));
}

ncclResult_t NcclEmulator::reduce(const void* send, void* recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
  EmuComm* c = reinterpret_cast<EmuComm*>(comm);
  std::string bad = checkReduction(dt, op, count, send, send);
  if (bad.empty() && c != nullptr && c->magic == emu::kLiveMagic) {
    bad = checkRoot(*c, root);
  }
  Task t;
  if (bad.empty()) {
    DataType type = *reduceType(dt);
    RedOp red = *reduceOp(op);
    size_t bytes = count * typeSize(dt);
    t.collective = [=](tcp::TcpCommunicator& net) {
      if (send == recv) {
        return net.reduce(recv, count, type, red, root, Deadline::never());
      }
      std::vector<char> tmp(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
      Status st = net.reduce(tmp.data(), count, type, red, root, Deadline::never());
      if (st.isOk() && net.rank() == root && bytes > 0) {
        std::memcpy(recv, tmp.data(), bytes);
      }
      return st;
    };
  }
  return state_->enqueue(comm, stream, "ncclReduce", bad.empty() ? ncclSuccess : ncclInvalidArgument, bad,
                         std::move(t));
}

ncclResult_t NcclEmulator::allGather(const void* send, void* recv, size_t sendCount, ncclDataType_t dt,
                                     ncclComm_t comm, cudaStream_t stream) {
  std::string bad = typeSize(dt) == 0 ? "invalid datatype" : "";
  size_t bytes = sendCount * typeSize(dt);
  Task t;
  t.collective = [=](tcp::TcpCommunicator& net) {
    return net.allGather(send, recv, bytes, DataType::kUInt8, Deadline::never());
  };
  return state_->enqueue(comm, stream, "ncclAllGather", bad.empty() ? ncclSuccess : ncclInvalidArgument, bad,
                         std::move(t));
}

ncclResult_t NcclEmulator::reduceScatter(const void* send, void* recv, size_t recvCount, ncclDataType_t dt,
                                         ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  std::string bad = checkReduction(dt, op, recvCount, send, recv);
  Task t;
  if (bad.empty()) {
    DataType type = *reduceType(dt);
    RedOp red = *reduceOp(op);
    t.collective = [=](tcp::TcpCommunicator& net) {
      return net.reduceScatter(send, recv, recvCount, type, red, Deadline::never());
    };
  }
  return state_->enqueue(comm, stream, "ncclReduceScatter", bad.empty() ? ncclSuccess : ncclInvalidArgument, bad,
                         std::move(t));
}

ncclResult_t NcclEmulator::send(const void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                                cudaStream_t stream) {
  EmuComm* c = reinterpret_cast<EmuComm*>(comm);
  std::string bad = typeSize(dt) == 0 ? "invalid datatype" : (c != nullptr && c->magic == emu::kLiveMagic ? checkRoot(*c, peer) : "");
  Task t;
  t.p2p = P2POp{P2POp::Kind::kSend, peer, const_cast<void*>(buf), count * typeSize(dt), 0};
  return state_->enqueue(comm, stream, "ncclSend", bad.empty() ? ncclSuccess : ncclInvalidArgument, bad, std::move(t));
}

ncclResult_t NcclEmulator::recv(void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                                cudaStream_t stream) {
  EmuComm* c = reinterpret_cast<EmuComm*>(comm);
  std::string bad = typeSize(dt) == 0 ? "invalid datatype" : (c != nullptr && c->magic == emu::kLiveMagic ? checkRoot(*c, peer) : "");
  Task t;
  t.p2p = P2POp{P2POp::Kind::kRecv, peer, buf, count * typeSize(dt), 0};
  return state_->enqueue(comm, stream, "ncclRecv", bad.empty() ? ncclSuccess : ncclInvalidArgument, bad, std::move(t));
}

ncclResult_t NcclEmulator::groupStart() {
  return state_->groupStart();
}

ncclResult_t NcclEmulator::groupEnd() {
  return state_->groupEnd();
}

}  // namespace resilient_comm::nccl
