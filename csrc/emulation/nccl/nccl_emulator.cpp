// The NCCL emulator's communicator lifecycle: init, abort, destroy, finalize, revoke, split,
// shrink, grow and the async error. Collectives, groups and kernels are in emu_collectives.cpp.
// Each rule names the place in NCCL's source it follows (src/init.cc, src/group.cc,
// src/enqueue.cc); docs/nccl.md lists them.
#include "emulation/nccl/nccl_emulator.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "comm/bootstrap_id.h"
#include "common/env.h"
#include "common/logging.h"
#include "emulation/nccl/emu_bootstrap.h"
#include "emulation/device/emulated_device.h"
#include "emulation/nccl/emu_state.h"
#include "transport/nccl/nccl_transport.h"
#include "transport/tcp/socket.h"

namespace resilient_comm::nccl {

using emu::EmuComm;

namespace {

constexpr std::chrono::minutes kRootLifetime{10};

ncclComm_t handleOf(EmuComm* c) {
  return reinterpret_cast<ncclComm_t>(c);
}

// The caller's config: blocking unless it says otherwise (init.cc parseCommConfig: a wrong magic
// is ncclInvalidArgument; the blocking field counts from version 2.14).
ncclResult_t parseConfig(const ncclConfig_t* cfg, bool inherit, bool* blocking) {
  if (cfg == nullptr) {
    *blocking = inherit;
    return ncclSuccess;
  }
  if (cfg->magic != kNcclApiMagic) {
    return emu::failWith(ncclInvalidArgument, "ncclConfig_t argument not initialized with NCCL_CONFIG_INITIALIZER");
  }
  *blocking = !(cfg->version >= ncclVersionCode(2, 14, 0) && cfg->blocking == 0);
  return ncclSuccess;
}

// A new communicator over `net`: bootstrapped through `id`'s root (an init or a grow).
Status bootstrap(EmuComm* c, const ncclUniqueId& id) {
  int port = 0;
  tcp::Socket sock;
  RC_ASSIGN_OR_RETURN(sock, tcp::listenPublished(&port));
  auto listener = std::make_shared<tcp::Listener>(std::move(sock));
  std::vector<std::string> book;
  RC_ASSIGN_OR_RETURN(book, emu::joinRoot(id, c->rank, c->nranks, tcp::publishedHost() + ":" + std::to_string(port),
                                          Deadline::never(), c->initAbort));
  uint64_t nonce = emu::idNonce(id);
  tcp::TcpOptions o;
  o.name = c->name;
  o.rank = c->rank;
  o.size = c->nranks;
  auto net = tcp::TcpCommunicator::fromAddressBook(std::move(o), listener, std::move(book),
                                                   "nccl-emu/" + hexEncode(&nonce, sizeof(nonce)) + "/",
                                                   Deadline::never());
  emu::attachNet(c, net);
  return net->waitReady(Deadline::never());
}

}  // namespace

NcclEmulator::NcclEmulator(EmulatorOptions options)
    : options_(options), stats_(std::make_shared<Stats>()), state_(std::make_shared<State>(options, stats_)) {}

NcclEmulator::~NcclEmulator() = default;

bool NcclEmulator::hasSymbol(const char* name) const {
  static const char* optional[] = {"ncclCommSplit", "ncclCommShrink", "ncclCommRevoke", "ncclCommGetUniqueId",
                                   "ncclCommGrow"};
  for (const char* o : optional) {
    if (std::strcmp(o, name) == 0) {
      return !options_.missingOptionalSymbols;
    }
  }
  return true;
}

void NcclEmulator::release() {
  state_->release();
}

ncclResult_t NcclEmulator::getUniqueId(ncclUniqueId* id) {
  if (id == nullptr) {
    return emu::failWith(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
  }
  Status st = emu::startRoot(id, kRootLifetime);
  return st.isOk() ? ncclSuccess : emu::failWith(ncclSystemError, "bootstrap root: " + st.message());
}

// init.cc ncclCommInitRankDev: *comm is written at the call, in ncclInProgress; the device is the
// calling thread's current one; the init job bootstraps and connects.
ncclResult_t NcclEmulator::commInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                              ncclConfig_t* config) {
  if (comm == nullptr) {
    return emu::failWith(ncclInvalidArgument, "ncclCommInitRankConfig: comm is NULL");
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return emu::failWith(ncclInvalidArgument,
                         "Invalid rank requested : " + std::to_string(rank) + "/" + std::to_string(nranks));
  }
  bool blocking = true;
  ncclResult_t r = parseConfig(config, true, &blocking);
  if (r != ncclSuccess) {
    return r;
  }
  ++stats_->inits;
  EmuComm* c = state_->newComm(rank, nranks, blocking, device::emu::currentDevice());
  c->result = ncclInProgress;
  *comm = handleOf(c);
  state_->startJob(c, [st = state_, c, id] {
    Status s = st->options.initNeverCompletes ? st->untilAborted(c) : bootstrap(c, id);
    st->settle(c, s);
  });
  return blocking ? state_->waitSettled(c) : ncclInProgress;
}

ncclResult_t NcclEmulator::commGetAsyncError(ncclComm_t comm, ncclResult_t* err) {
  EmuComm* c = state_->live(comm, "ncclCommGetAsyncError");
  if (c == nullptr) {
    return ncclInvalidArgument;
  }
  if (err == nullptr) {
    return emu::failWith(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
  }
  *err = c->asyncError();
  return ncclSuccess;
}

// init.cc ncclCommAbort: sets the abort flags (a child in init through its parent too), joins
// the background jobs, waits for the kernels to leave the streams, then frees the communicator.
// Blocking, whatever the config says.
ncclResult_t NcclEmulator::commAbort(ncclComm_t comm) {
  if (comm == nullptr) {
    return ncclSuccess;
  }
  EmuComm* c = state_->live(comm, "ncclCommAbort");
  if (c == nullptr) {
    return ncclInvalidArgument;
  }
  state_->checkNoGrowInInit(c, "ncclCommAbort");
  ++stats_->aborts;
  state_->raiseAbort(c, "ncclCommAbort");
  if (options_.abortHangs) {
    state_->waitReleased();
  }
  state_->drain(c, /*jobsToo=*/true);
  state_->free(c);
  return ncclSuccess;
}

// init.cc ncclCommDestroy: ncclCommEnsureReady first (an error or a call in progress is returned,
// and nothing is freed), then the kernels drain and the communicator is freed.
ncclResult_t NcclEmulator::commDestroy(ncclComm_t comm) {
  if (comm == nullptr) {
    return ncclSuccess;
  }
  EmuComm* c = state_->live(comm, "ncclCommDestroy");
  if (c == nullptr) {
    return ncclInvalidArgument;
  }
  state_->checkNoGrowInInit(c, "ncclCommDestroy");
  ncclResult_t r = state_->ensureReady(c, "ncclCommDestroy");
  if (r != ncclSuccess) {
    return r;
  }
  ++stats_->destroys;
  state_->drain(c, /*jobsToo=*/true);
  state_->free(c);
  return ncclSuccess;
}

// init.cc ncclCommFinalize: ensureReady; twice (or after a revoke) is ncclInvalidArgument; a job
// flushes the kernels and waits until every rank finalized ("globally quiescent"), in
// ncclInProgress until then: forever if a peer is gone, until the communicator is aborted.
ncclResult_t NcclEmulator::commFinalize(ncclComm_t comm) {
  EmuComm* c = state_->live(comm, "ncclCommFinalize");
  if (c == nullptr) {
    return ncclInvalidArgument;
  }
  state_->checkNoGrowInInit(c, "ncclCommFinalize");
  ncclResult_t r = state_->ensureReady(c, "ncclCommFinalize");
  if (r != ncclSuccess) {
    return state_->markFailed(c, r);
  }
  if (c->finalizeCalled.exchange(true)) {
    return state_->markFailed(c, emu::failWith(ncclInvalidArgument, "ncclCommFinalize called twice (or after a revoke)"));
  }
  ++stats_->finalizes;
  c->result = ncclInProgress;
  state_->startJob(c, [st = state_, c] {
    st->drain(c, /*jobsToo=*/false);
    std::lock_guard<std::mutex> busy(c->netMu);
    st->settle(c, c->network()->barrier(Deadline::never()));
  });
  return c->blocking ? state_->waitSettled(c) : ncclInProgress;
}

// init.cc ncclCommRevoke: flags must be 0; not after destroy/finalize, not twice. The kernels are
// told to stop, the communicator is ncclInProgress until they have, then ncclSuccess; it can then
// only be shrunk, split, aborted or destroyed (enqueue.cc: a collective is ncclInvalidUsage).
ncclResult_t NcclEmulator::commRevoke(ncclComm_t comm, int flags) {
  if (comm == nullptr) {
    return ncclSuccess;
  }
  EmuComm* c = state_->live(comm, "ncclCommRevoke");
  if (c == nullptr) {
    return ncclInvalidArgument;
  }
  if (flags != kNcclRevokeDefault) {
    return emu::failWith(ncclInvalidArgument, "ncclCommRevoke: revokeFlags must be NCCL_REVOKE_DEFAULT");
  }
  if (c->finalizeCalled || c->revoked.exchange(true)) {
    return emu::failWith(ncclInvalidArgument, "ncclCommRevoke: the communicator is finalized or already revoked");
  }
  ++stats_->revokes;
  c->finalizeCalled = true;
  c->result = ncclInProgress;
  state_->startJob(c, [st = state_, c] {
    st->stopKernels(c, "ncclCommRevoke");
    if (!st->options.shrinkFailsAfterError) {
      c->netResult = ncclSuccess;  // quiescent: management calls may proceed
    }
    st->settle(c, Status::ok());
  });
  return c->blocking ? state_->waitSettled(c) : ncclInProgress;
}

// init.cc ncclCommShrink / ncclCommInitChildComm: NCCL_SHRINK_ABORT stops the parent's kernels
// first (synchronously); the exclude list must not name the caller; ncclCommEnsureReady(parent);
// *newcomm is NULL at the call and written by the job when the child is ready.
ncclResult_t NcclEmulator::commShrink(ncclComm_t comm, int* exclude, int count, ncclComm_t* out, ncclConfig_t* config,
                                      int flags) {
  EmuComm* p = state_->live(comm, "ncclCommShrink");
  if (p == nullptr) {
    return ncclInvalidArgument;
  }
  ++stats_->shrinks;
  stats_->lastShrinkFlags = flags;
  const bool abortFirst = (flags & kNcclShrinkAbort) != 0;
  if (abortFirst) {
    state_->stopKernels(p, "ncclCommShrink(NCCL_SHRINK_ABORT)");
    if (!options_.shrinkFailsAfterError) {
      p->netResult = ncclSuccess;
    }
  }
  if (out == nullptr || exclude == nullptr || count <= 0) {
    return emu::failWith(ncclInvalidArgument, "ncclCommShrink: newcomm, excludeRanksList or its count is invalid");
  }
  std::vector<int> ex(exclude, exclude + count);
  std::sort(ex.begin(), ex.end());
  if (std::binary_search(ex.begin(), ex.end(), p->rank) || ex.back() >= p->nranks || ex.front() < 0) {
    return emu::failWith(ncclInvalidArgument, "ncclCommShrink: a rank in excludeRanksList must not call it");
  }
  ncclResult_t r = state_->ensureReady(p, "ncclCommShrink");
  if (r != ncclSuccess) {
    return state_->markFailed(p, r);
  }
  bool blocking = p->blocking;
  if ((r = parseConfig(config, p->blocking, &blocking)) != ncclSuccess) {
    return r;
  }
  *out = nullptr;
  p->result = ncclInProgress;
  state_->startJob(p, [st = state_, p, ex, out, blocking, abortFirst] {
    std::shared_ptr<tcp::TcpCommunicator> net = p->network();
    const bool afterError = abortFirst || p->revoked || net->state() != CommState::kReady;
    Result<std::shared_ptr<Communicator>> child = Status(StatusCode::kInternal, "not run");
    {
      std::lock_guard<std::mutex> busy(p->netMu);
      child = net->shrink(ex, afterError, Deadline::never());
    }
    st->finishChild(p, std::move(child), out, blocking);
  });
  return p->blocking ? state_->waitSettled(p) : ncclInProgress;
}

// init.cc ncclCommSplit: as shrink, without the abort; NCCL_SPLIT_NOCOLOR takes part and gets NULL.
ncclResult_t NcclEmulator::commSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t* config) {
  EmuComm* p = state_->live(comm, "ncclCommSplit");
  if (p == nullptr) {
    return ncclInvalidArgument;
  }
  if (out == nullptr) {
    return emu::failWith(ncclInvalidArgument, "ncclCommSplit: newcomm is NULL");
  }
  ncclResult_t r = state_->ensureReady(p, "ncclCommSplit");
  if (r != ncclSuccess) {
    return state_->markFailed(p, r);
  }
  bool blocking = p->blocking;
  if ((r = parseConfig(config, p->blocking, &blocking)) != ncclSuccess) {
    return r;
  }
  ++stats_->splits;
  *out = nullptr;
  p->result = ncclInProgress;
  state_->startJob(p, [st = state_, p, color, key, out, blocking] {
    Result<std::shared_ptr<Communicator>> child = Status(StatusCode::kInternal, "not run");
    {
      std::lock_guard<std::mutex> busy(p->netMu);
      child = p->network()->split(color, key, Deadline::never());
    }
    st->finishChild(p, std::move(child), out, blocking);
  });
  return p->blocking ? state_->waitSettled(p) : ncclInProgress;
}

ncclResult_t NcclEmulator::commGetUniqueId(ncclComm_t comm, ncclUniqueId* id) {
  EmuComm* c = state_->live(comm, "ncclCommGetUniqueId");
  if (c == nullptr) {
    return ncclInvalidArgument;
  }
  ncclResult_t r = state_->ensureReady(c, "ncclCommGetUniqueId");
  if (r != ncclSuccess) {
    return r;
  }
  return getUniqueId(id);
}

// init.cc ncclCommGrow: existing ranks pass rank -1 (the coordinator its id, the others NULL:
// the id reaches them over the parent), new ranks comm NULL, the id and their rank. *newcomm is
// written at the call, in ncclInProgress.
ncclResult_t NcclEmulator::commGrow(ncclComm_t comm, int nranks, const ncclUniqueId* id, int rank, ncclComm_t* out,
                                    ncclConfig_t* config) {
  if (out == nullptr || nranks <= 0) {
    return emu::failWith(ncclInvalidArgument, "ncclCommGrow: newcomm is NULL or nRanks is not positive");
  }
  *out = nullptr;
  EmuComm* p = nullptr;
  if (comm != nullptr) {
    if ((p = state_->live(comm, "ncclCommGrow")) == nullptr) {
      return ncclInvalidArgument;
    }
    if (nranks <= p->nranks || rank != -1) {
      return emu::failWith(ncclInvalidArgument, "ncclCommGrow: existing ranks pass rank -1 and a larger nRanks");
    }
    ncclResult_t r = state_->ensureReady(p, "ncclCommGrow");
    if (r != ncclSuccess) {
      return state_->markFailed(p, r);
    }
    if ((p->rank == 0) != (id != nullptr)) {
      return emu::failWith(ncclInvalidArgument, "ncclCommGrow: only the coordinator (rank 0) passes the unique id");
    }
  } else if (id == nullptr || rank < 0 || rank >= nranks) {
    return emu::failWith(ncclInvalidArgument, "ncclCommGrow: a new rank passes the unique id and its rank");
  }
  bool blocking = true;
  ncclResult_t r = parseConfig(config, p != nullptr ? p->blocking : true, &blocking);
  if (r != ncclSuccess) {
    return r;
  }
  ++stats_->grows;
  EmuComm* c =
      state_->newComm(p != nullptr ? p->rank : rank, nranks, blocking, p != nullptr ? p->device : device::emu::currentDevice());
  c->result = ncclInProgress;
  *out = handleOf(c);
  ncclUniqueId mine{};
  if (id != nullptr) {
    mine = *id;
  }
  // The child bootstraps over the parent until it is ready (bootstrap.cc bootstrapInit: ranks
  // exchange their ring addresses through parent->bootstrap): the parent must live until then.
  std::shared_ptr<tcp::TcpCommunicator> parentNet;
  if (p != nullptr) {
    std::lock_guard<std::mutex> lock(p->mu);
    ++p->growsInInit;
    parentNet = p->net;
  }
  state_->startJob(c, [st = state_, p, c, mine, parentNet]() mutable {
    Status s = Status::ok();
    if (p != nullptr && parentNet == nullptr) {
      s = Status(StatusCode::kInternal, "ncclCommGrow: the parent has no network");
    } else if (p != nullptr) {  // the coordinator's id reaches every existing rank over the parent
      std::lock_guard<std::mutex> busy(p->netMu);
      s = parentNet->broadcast(mine.internal, sizeof(mine.internal), DataType::kUInt8, 0, Deadline::never());
    }
    if (s.isOk()) {
      s = bootstrap(c, mine);
    }
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(p->mu);
      --p->growsInInit;
    }
    st->settle(c, s);
  });
  return blocking ? state_->waitSettled(c) : ncclInProgress;
}

const char* NcclEmulator::getErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled CUDA error (emulated)";
    case ncclSystemError:
      return "system error (emulated: a socket or thread call failed)";
    case ncclInternalError:
      return "internal error (emulated)";
    case ncclInvalidArgument:
      return "invalid argument (emulated)";
    case ncclInvalidUsage:
      return "invalid usage (emulated)";
    case ncclRemoteError:
      return "a peer process died or the network failed (emulated)";
    case ncclInProgress:
      return "operation in progress (emulated)";
    case ncclTimeout:
      return "timeout (emulated)";
  }
  return "unknown result code (emulated)";
}

const char* NcclEmulator::getLastError(ncclComm_t comm) {
  return state_->lastError(comm);
}

bool emulationRequested() {
  return env::getString(env::Knob::kNcclEmulate) == "1";
}

std::shared_ptr<NcclEmulator> processEmulator() {
  static std::shared_ptr<NcclEmulator> emulator = [] {
    EmulatorOptions o;
    int x = 0, y = 0, z = 0;
    std::string v = env::getString(env::Knob::kNcclEmulateVersion);
    if (std::sscanf(v.c_str(), "%d.%d.%d", &x, &y, &z) == 3) {
      o.version = ncclVersionCode(x, y, z);
    } else {
      RC_LOG(kWarning, "ignoring RESILIENT_COMM_NCCL_EMULATE_VERSION=" << v << ": not x.y.z");
    }
    o.launchDelay = std::chrono::microseconds(env::getInt(env::Knob::kNcclEmulateLaunchUs));
    o.kernelTime = std::chrono::microseconds(env::getInt(env::Knob::kNcclEmulateKernelUs));
    o.peerDeathHangs = env::getString(env::Knob::kNcclEmulatePeerDeath) == "hang";
    return std::make_shared<NcclEmulator>(o);
  }();
  return emulator;
}

DeviceTransport emulatedNcclTransport(std::string backend) {
  DeviceTransport t = ncclTransport(std::move(backend), c10::DeviceType::CPU, "CPU", [](const c10::Device&) {
    return Result<NcclRuntime>(NcclRuntime{processEmulator(), device::emu::makeEmulatedStreamOps(0)});
  });
  t.enabled = emulationRequested;
  return t;
}

}  // namespace resilient_comm::nccl
