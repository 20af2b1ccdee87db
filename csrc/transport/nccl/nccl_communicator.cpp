// NcclCommunicator's lifecycle, launch() and the watchdog's poll; the collectives are in
// nccl_collectives.cpp and the moves (shrink, split, grow) in nccl_moves.cpp.
#include "transport/nccl/nccl_communicator.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <cstring>
#include <thread>

#include "comm/bootstrap_id.h"
#include "comm/store_util.h"
#include "common/check.h"
#include "common/liveness.h"
#include "common/logging.h"
#include "watchdog/reaper.h"

namespace resilient_comm::nccl {

namespace {

// The communicator whose launch() this thread is in (its body's calls join that launch).
thread_local const NcclCommunicator* tlsLaunching = nullptr;

}  // namespace

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclApi> api, std::shared_ptr<device::StreamOps> streams,
                                   NcclOptions opts)
    : CommLifecycle(opts.name, opts.rank, opts.size),
      api_(std::move(api)),
      streams_(std::move(streams)),
      opts_(std::move(opts)),
      features_(api_->features()),
      handle_(std::make_shared<NcclHandle>(api_, "group '" + opts_.name + "' rank " + std::to_string(opts_.rank))) {}

Result<std::shared_ptr<NcclCommunicator>> NcclCommunicator::create(std::shared_ptr<NcclApi> api,
                                                                   std::shared_ptr<device::StreamOps> streams,
                                                                   NcclOptions opts, const Deadline& initDeadline) {
  if (!api->features().nonBlockingInit) {
    return Status(StatusCode::kNotSupported, "NCCL " + api->versionString() + " at " + api->path() +
                                                 " is too old: resilient_nccl needs 2.14 or later for "
                                                 "non-blocking init and ncclCommAbort");
  }
  std::shared_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(api), std::move(streams), std::move(opts)));
  Watchdog::instance().poll(c);
  c->start(
      [](NcclCommunicator& self, const Deadline& dl) -> Status {
        int64_t incarnation = 0;
        RC_ASSIGN_OR_RETURN(incarnation, storeAdd(self.opts_.store, self.opts_.prefix + "incarnation/" +
                                                                        std::to_string(self.opts_.rank),
                                                  1));
        return self.initWithId(self.opts_.prefix + "e" + std::to_string(incarnation) + "/uid", dl);
      },
      initDeadline);
  return c;
}

Result<std::shared_ptr<NcclCommunicator>> NcclCommunicator::join(std::shared_ptr<NcclApi> api,
                                                                 std::shared_ptr<device::StreamOps> streams,
                                                                 NcclOptions opts, const Deadline& dl) {
  if (!api->features().nonBlockingInit) {
    return Status(StatusCode::kNotSupported, "NCCL " + api->versionString() + " is too old to join a group");
  }
  std::shared_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(api), std::move(streams), std::move(opts)));
  Watchdog::instance().poll(c);
  c->start(
      [](NcclCommunicator& self, const Deadline& d) -> Status {
        if (!self.features_.grow) {
          return self.initWithId(self.opts_.prefix + "uid", d);  // the members re-init too
        }
        ncclUniqueId id{};
        if (!self.opts_.bootstrapId.empty()) {  // handed over by the caller
          if (self.opts_.bootstrapId.size() != sizeof(id.internal)) {
            return Status(StatusCode::kInvalidArgument, "join: a grow id of " +
                                                            std::to_string(self.opts_.bootstrapId.size()) + " bytes");
          }
          std::memcpy(id.internal, self.opts_.bootstrapId.data(), sizeof(id.internal));
          self.opts_.bootstrapId.clear();
        } else {
          std::vector<std::string> uid;
          RC_ASSIGN_OR_RETURN(uid, storeFetch(self.opts_.store, {self.opts_.prefix + "uid"}, d, self.abort_));
          RC_RETURN_IF_ERROR(hexDecode(uid[0], id.internal, sizeof(id.internal)));
        }
        ncclConfig_t cfg = nonBlockingConfig();
        return self.call(
            "ncclCommGrow",
            [&](ncclComm_t) { return self.api_->commGrow(nullptr, self.opts_.size, &id, self.opts_.rank,
                                                         self.handle_->slot(), &cfg); },
            d);
      },
      dl);
  return c;
}

Result<std::shared_ptr<NcclCommunicator>> NcclCommunicator::makeChild(int rank, int size, std::string prefix,
                                                                      c10::intrusive_ptr<c10d::Store> store) {
  std::shared_ptr<device::StreamOps> streams;
  RC_ASSIGN_OR_RETURN(streams, streams_->fork());
  NcclOptions o = opts_;
  o.bootstrapId.clear();  // the parent's; a child makes its own
  o.rank = rank;
  o.size = size;
  o.prefix = std::move(prefix);  // the child's own: its later moves cannot meet the parent's keys
  o.store = std::move(store);
  std::shared_ptr<NcclCommunicator> c(new NcclCommunicator(api_, std::move(streams), std::move(o)));
  Watchdog::instance().poll(c);
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  std::vector<std::shared_ptr<PendingOp>> ops;
  {
    std::lock_guard<std::mutex> lock(opsMu_);
    ops.swap(inflight_);
  }
  for (auto& op : ops) {
    if (!op->retired()) {  // its buffers stay held until its kernels have left the device
      Watchdog::instance().drain([op] {
        (void)op->poll();
        return op->retired();
      });
    }
  }
  if (state() == CommState::kReady && !disposed_) {
    handle_->finalize(Reaper::abortBound());  // healthy: flush, then free
  } else {
    handle_->abort(/*wait=*/false, Reaper::abortBound());
  }
}

Caps NcclCommunicator::caps() const {
  Caps c;
  c.nonBlockingInit = features_.nonBlockingInit;
  c.abort = features_.nonBlockingInit;
  c.split = true;   // natively where features_.split, else by re-init
  c.shrink = true;  // natively where features_.shrink, else by re-init
  c.revoke = features_.revoke;
  c.grow = true;  // natively where features_.grow, else by re-init
  c.multiRankPerDevice = features_.multiRankPerDevice;
  return c;
}

Status NcclCommunicator::mapError(const char* what, ncclResult_t r) {
  if (r == ncclSuccess || r == ncclInProgress) {
    return Status::ok();
  }
  std::string last = api_->getLastError(handle_->comm());
  std::string text = std::string(what) + " failed: " + api_->getErrorString(r) + (last.empty() ? "" : " (" + last + ")");
  switch (r) {
    case ncclRemoteError:
      return Status(StatusCode::kPeerFailure, text);
    case ncclTimeout:
      return Status(StatusCode::kTimeout, text);
    case ncclUnhandledCudaError:
      if (last.find("driver") != std::string::npos || last.find("no CUDA-capable") != std::string::npos) {
        return Status(StatusCode::kInternal, "no usable CUDA device: " + text);
      }
      return Status(StatusCode::kInternal, text);
    default:
      return Status(StatusCode::kInternal, text);
  }
}

Status NcclCommunicator::call(const char* what, const std::function<ncclResult_t(ncclComm_t)>& fn, const Deadline& dl) {
  Result<ncclResult_t> r = handle_->call(fn, dl, abort_);
  if (!r.isOk()) {
    return r.status().withContext(what);
  }
  return mapError(what, r.value());
}

Status NcclCommunicator::initWithId(const std::string& key, const Deadline& dl) {
  ncclUniqueId id{};
  if (!opts_.bootstrapId.empty()) {
    if (opts_.bootstrapId.size() != sizeof(id)) {
      return Status(StatusCode::kInvalidArgument, "a bootstrap id of " + std::to_string(opts_.bootstrapId.size()) +
                                                      " bytes; an ncclUniqueId has " + std::to_string(sizeof(id)));
    }
    std::memcpy(&id, opts_.bootstrapId.data(), sizeof(id));
    opts_.bootstrapId.clear();  // once: a later re-init makes a new one
    ncclConfig_t cfg = nonBlockingConfig();
    return call(
        "ncclCommInitRankConfig",
        [&](ncclComm_t) { return api_->commInitRankConfig(handle_->slot(), opts_.size, id, opts_.rank, &cfg); }, dl);
  }
  // [Note: the liveness lock]: this member's lock goes under its host's key before its init;
  // once the init completed, every member's is there (watchMembers reads them).
  const std::string tag = liveness::hostTag();
  const std::string mine = liveness::entry(opts_.rank);
  if (!tag.empty() && !mine.empty() && storeAppend(opts_.store, key + "/live/" + tag, mine).isOk()) {
    liveKey_ = key + "/live/" + tag;
  }
  RC_RETURN_IF_ERROR(exchangeId(
      opts_.store, key, opts_.rank == 0,
      [&](void* out) { return mapError("ncclGetUniqueId", api_->getUniqueId(static_cast<ncclUniqueId*>(out))); },
      &id, sizeof(id), dl, abort_));
  ncclConfig_t cfg = nonBlockingConfig();
  return call(
      "ncclCommInitRankConfig",
      [&](ncclComm_t) { return api_->commInitRankConfig(handle_->slot(), opts_.size, id, opts_.rank, &cfg); }, dl);
}

void NcclCommunicator::watchMembers() {
  if (liveKey_.empty()) {
    return;
  }
  AbortToken none;
  auto r = storeFetch(opts_.store, {liveKey_}, Deadline::after(std::chrono::milliseconds(1000)), none);
  liveKey_.clear();
  if (r.isOk()) {
    live_ = liveness::parse(r.value()[0], opts_.rank, opts_.size);
  }
}

Status NcclCommunicator::membersAlive(bool busy) {
  const int dead = live_.died();
  // (what it finished before it died still completes within the grace)
  if (dead < 0 || !busy || !live_.byRank[dead]->deadAfter(std::chrono::milliseconds(1)).passed()) {
    return Status::ok();
  }
  return Status(StatusCode::kPeerFailure, "rank " + std::to_string(dead) + " died while an op of group '" +
                                              opts_.name + "' waited on it (" + live_.byRank[dead]->why() + ")");
}

void NcclCommunicator::start(Plan plan, const Deadline& dl, std::function<void()> whenDone) {
  std::shared_ptr<NcclCommunicator> self = shared_from_this();
  std::thread([self, plan = std::move(plan), dl, whenDone = std::move(whenDone)] {
    Status st;
    {
      Result<device::DeviceGuard> guard = self->streams_->bind();  // NCCL binds to the calling thread's device
      st = guard.isOk() ? plan(*self, dl) : guard.status();
      if (st.isOk()) {
        Result<ncclResult_t> r = self->handle_->settle(dl, self->abort_);
        st = r.isOk() ? self->mapError("communicator init", r.value()) : r.status();
      }
      if (st.isOk() && self->handle_->comm() == nullptr) {
        st = Status(StatusCode::kInternal, "NCCL settled the init without writing a communicator");
      }
      if (st.isOk()) {
        self->watchMembers();
      }
    }
    if (self->finishInit(st) && !st.isOk()) {
      self->abort_.abort(st.message());
      self->disposed_ = true;
      self->handle_->abort(/*wait=*/false, Reaper::abortBound());  // a communicator that never built cannot be shrunk
    }
    if (whenDone) {
      whenDone();
    }
  }).detach();
}

Status NcclCommunicator::ready(const Deadline& dl) {
  CommState s = state();
  if (s == CommState::kInitializing) {
    RC_RETURN_IF_ERROR(waitReady(dl));
    s = state();
  }
  return s == CommState::kReady ? Status::ok() : error();
}

void NcclCommunicator::abort(const std::string& reason) {
  const bool initializing = state() == CommState::kInitializing;
  markAborted(reason);
  abort_.abort(reason);
  finish();
  if (initializing) {
    disposed_ = true;
    handle_->abort(/*wait=*/false, Reaper::abortBound());  // an init in progress cannot be shrunk
  } else {
    disposeHandle();
  }
}

Status NcclCommunicator::fail(const Status& st) {
  if (st.isOk() || st.code() == StatusCode::kInvalidArgument) {
    return st;
  }
  if (!markFailed(st)) {
    return state() == CommState::kReady ? st : error();
  }
  abort_.abort(st.message());
  finish();
  disposeHandle();
  return st;
}

void NcclCommunicator::finish() {
  std::vector<std::shared_ptr<PendingOp>> ops;
  {
    std::lock_guard<std::mutex> lock(opsMu_);
    ops = inflight_;
  }
  Status st = error();
  for (auto& op : ops) {
    op->fail(st);
  }
}

void NcclCommunicator::disposeHandle() {
  if (disposed_.exchange(true)) {
    return;
  }
  if (features_.revoke && handle_->comm() != nullptr) {
    Result<ncclResult_t> r = handle_->revokeOnce(Deadline::after(Reaper::abortBound()));
    if (r.isOk() && (r.value() == ncclSuccess || r.value() == ncclInProgress)) {
      return;  // its kernels stop; kept for a shrink
    }
  } else if (features_.shrink && handle_->comm() != nullptr) {
    return;  // kept for a shrink (NCCL_SHRINK_ABORT stops its kernels), or aborted when destroyed
  }
  handle_->abort(/*wait=*/false, Reaper::abortBound());
}

bool NcclCommunicator::launchingHere() const {
  return tlsLaunching == this;
}

Result<std::shared_ptr<PendingOp>> NcclCommunicator::launch(const std::string& what, const Deadline& dl,
                                                            std::shared_ptr<void> keep,
                                                            const std::function<Status()>& body) {
  const uint64_t seq = seq_++;
  const std::string where =
      what + " #" + std::to_string(seq) + " on group '" + opts_.name + "' rank " + std::to_string(opts_.rank);
  RC_RETURN_IF_ERROR(ready(dl));
  Status st;
  Result<std::shared_ptr<device::DeviceEvent>> end = Status(StatusCode::kInternal, "not recorded");
  {
    std::lock_guard<std::mutex> turn(launchMu_);
    Result<device::DeviceGuard> guard = streams_->bind();
    st = guard.status();
    if (st.isOk()) {
      st = streams_->followCurrent();
    }
    tlsLaunching = this;
    groupOpen_ = false;
    afterGroup_.clear();
    if (st.isOk()) {
      st = body();
    }
    if (groupOpen_) {
      Status closed = closeGroup(dl);
      st = st.isOk() ? closed : st;
    }
    tlsLaunching = nullptr;
    for (auto& fn : afterGroup_) {
      if (st.isOk()) {
        st = streams_->runOnStream(std::move(fn));
      }
    }
    afterGroup_.clear();
    if (st.isOk()) {
      end = streams_->record();
      st = end.status();
    }
  }
  if (!st.isOk()) {
    return fail(st.withContext(where));
  }
  auto op = std::make_shared<PendingOp>(seq, where, end.take(), dl, std::move(keep));
  {
    std::lock_guard<std::mutex> lock(opsMu_);
    inflight_.push_back(op);
  }
  Watchdog::instance().kick();
  return op;
}

Status NcclCommunicator::onStream(std::function<void()> fn) {
  if (launchingHere() && groupOpen_) {
    afterGroup_.push_back(std::move(fn));  // after the group's kernels are on the stream
    return Status::ok();
  }
  return streams_->runOnStream(std::move(fn));
}

Status NcclCommunicator::collective(const char* op, const Deadline& dl, const std::function<Status()>& calls) {
  if (launchingHere()) {
    return calls();
  }
  Result<std::shared_ptr<PendingOp>> launched = launch(op, dl, nullptr, calls);
  if (!launched.isOk()) {
    return launched.status();
  }
  Status st = launched.value()->hostWait(dl, &abort_);
  return st.code() == StatusCode::kTimeout ? fail(st) : (st.isOk() || error().isOk() ? st : error());
}

Status NcclCommunicator::enqueue(const char* what, const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& fn,
                                 const Deadline& dl) {
  if (!groupOpen_) {
    RC_RETURN_IF_ERROR(call("ncclGroupStart", [&](ncclComm_t) { return api_->groupStart(); }, dl));
    groupOpen_ = true;
  }
  auto* stream = static_cast<cudaStream_t>(streams_->nativeStream());
  return call(what, [&](ncclComm_t c) { return fn(c, stream); }, dl);
}

Status NcclCommunicator::closeGroup(const Deadline& dl) {
  groupOpen_ = false;
  RC_RETURN_IF_ERROR(call("ncclGroupEnd", [&](ncclComm_t) { return api_->groupEnd(); }, dl));
  Result<ncclResult_t> r = handle_->settle(dl, abort_);  // the kernels are on the stream once it settles
  if (!r.isOk()) {
    return r.status().withContext("ncclGroupEnd");
  }
  return mapError("the op's NCCL group", r.value());
}

bool NcclCommunicator::watchdogPoll() {
  std::vector<std::shared_ptr<PendingOp>> ops;
  {
    std::lock_guard<std::mutex> lock(opsMu_);
    ops = inflight_;
  }
  if (state() == CommState::kReady) {
    // The async error first: an op that "finished" on a communicator with a remote error has no
    // trustworthy result.
    std::optional<ncclResult_t> async = handle_->tryAsyncError();
    if (async && *async != ncclSuccess && *async != ncclInProgress) {
      (void)fail(mapError("the communicator (asynchronous error)", *async));
    }
  }
  if (state() == CommState::kReady) {
    bool busy = false;
    for (auto& op : ops) {
      Status st = op->poll();
      busy = busy || st.code() == StatusCode::kInProgress;
      if (st.code() == StatusCode::kInProgress && op->deadline().passed()) {
        (void)fail(Status(StatusCode::kTimeout, op->what() + " did not complete on the device before its deadline"));
        break;
      }
      if (!st.isOk() && st.code() != StatusCode::kInProgress) {
        (void)fail(st);  // a device error
        break;
      }
    }
    // A same-host member whose lock the kernel released: its peers' kernels would wait for it
    // until the deadline (NCCL's intra-node transports see no hang-up).
    Status alive = state() == CommState::kReady ? membersAlive(busy) : Status::ok();
    if (!alive.isOk()) {
      (void)fail(alive);
    }
  }
  if (state() != CommState::kReady && state() != CommState::kInitializing) {
    Status st = error();
    for (auto& op : ops) {
      op->fail(st);  // also reaches ops launched while the communicator was failing
      (void)op->poll();  // retires once its kernels have left the device
    }
  }
  std::lock_guard<std::mutex> lock(opsMu_);
  inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(),
                                 [](const std::shared_ptr<PendingOp>& op) { return op->retired(); }),
                  inflight_.end());
  return !inflight_.empty();
}

size_t NcclCommunicator::inFlight() const {
  std::lock_guard<std::mutex> lock(opsMu_);
  return inflight_.size();
}

}  // namespace resilient_comm::nccl
