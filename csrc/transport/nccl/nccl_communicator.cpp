#include "transport/nccl/nccl_communicator.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <cstring>
#include <thread>

#include "comm/bootstrap_id.h"
#include "comm/group_moves.h"
#include "comm/poll_loop.h"
#include "comm/store_util.h"
#include "common/check.h"
#include "common/env.h"
#include "watchdog/reaper.h"

namespace resilient_comm::nccl {

namespace {

Result<ncclDataType_t> toNccl(DataType dt) {
  switch (dt) {
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
    case DataType::kBool:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kInt16:
      break;
  }
  return Status(StatusCode::kInvalidArgument, std::string("NCCL has no ") + dataTypeName(dt) + " type");
}

ncclRedOp_t toNccl(RedOp op, DataType dt) {
  if (dt == DataType::kBool) {  // or / and, as the TCP transport does
    return (op == RedOp::kProd || op == RedOp::kMin) ? ncclMin : ncclMax;
  }
  switch (op) {
    case RedOp::kSum:
      return ncclSum;
    case RedOp::kProd:
      return ncclProd;
    case RedOp::kMin:
      return ncclMin;
    case RedOp::kMax:
      return ncclMax;
    case RedOp::kAvg:
      return ncclAvg;
  }
  return ncclSum;
}

std::chrono::milliseconds abortBound() {
  return std::chrono::milliseconds(env::getInt(env::Knob::kAbortBoundMs));
}

}  // namespace

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclApi> api, std::shared_ptr<StreamOps> streams,
                                   NcclOptions opts)
    : CommLifecycle(opts.name, opts.rank, opts.size),
      api_(std::move(api)),
      streams_(std::move(streams)),
      opts_(std::move(opts)) {}

Result<std::shared_ptr<NcclCommunicator>> NcclCommunicator::create(std::shared_ptr<NcclApi> api,
                                                                   std::shared_ptr<StreamOps> streams,
                                                                   NcclOptions opts, const Deadline& initDeadline) {
  if (!api->features().nonBlockingInit) {
    return Status(StatusCode::kNotSupported, "NCCL " + api->versionString() + " at " + api->path() +
                                                 " is too old: resilient_nccl needs 2.14 or later for "
                                                 "non-blocking init and ncclCommAbort");
  }
  std::shared_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(api), std::move(streams), std::move(opts)));
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
                                                                 std::shared_ptr<StreamOps> streams, NcclOptions opts,
                                                                 const Deadline& dl) {
  if (!api->features().nonBlockingInit) {
    return Status(StatusCode::kNotSupported, "NCCL " + api->versionString() + " is too old to join a group");
  }
  std::shared_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(api), std::move(streams), std::move(opts)));
  c->start(
      [](NcclCommunicator& self, const Deadline& d) -> Status {
        if (!self.api_->features().grow) {
          return self.initWithId(self.opts_.prefix + "uid", d);  // the members re-init too
        }
        std::vector<std::string> uid;
        RC_ASSIGN_OR_RETURN(uid, storeFetch(self.opts_.store, {self.opts_.prefix + "uid"}, d, self.abort_));
        ncclUniqueId id{};
        RC_RETURN_IF_ERROR(hexDecode(uid[0], id.internal, sizeof(id.internal)));
        ncclConfig_t cfg = nonBlockingConfig();
        return self.call("ncclCommGrow", [&] {
          return self.api_->commGrow(nullptr, self.opts_.size, &id, self.opts_.rank, &self.comm_, &cfg);
        });
      },
      dl);
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ == nullptr) {
    return;
  }
  if (state() == CommState::kReady) {
    // Healthy: flush and free, bounded like an abort.
    auto api = api_;
    ncclComm_t comm = comm_;
    Reaper::run(
        [api, comm] {
          ncclResult_t st = api->commFinalize(comm);
          while (st == ncclSuccess || st == ncclInProgress) {
            ncclResult_t async = ncclSuccess;
            api->commGetAsyncError(comm, &async);
            if (async != ncclInProgress) {
              break;
            }
            std::this_thread::yield();
          }
          api->commDestroy(comm);
        },
        abortBound(), "finalizing group '" + opts_.name + "'");
  } else {
    abortNccl();
  }
}

Caps NcclCommunicator::caps() const {
  NcclFeatures f = api_->features();
  Caps c;
  c.nonBlockingInit = f.nonBlockingInit;
  c.abort = f.nonBlockingInit;
  c.split = true;   // natively where f.split, else by re-init
  c.shrink = true;  // natively where f.shrink, else by re-init
  c.revoke = f.revoke;
  c.grow = true;  // natively where f.grow, else by re-init
  c.multiRankPerDevice = f.multiRankPerDevice;
  return c;
}

Status NcclCommunicator::mapError(const char* what, ncclResult_t r) {
  if (r == ncclSuccess || r == ncclInProgress) {
    return Status::ok();
  }
  std::string last = api_->getLastError(comm_);
  std::string text = std::string(what) + " failed: " + api_->getErrorString(r) + (last.empty() ? "" : " (" + last + ")");
  if (r == ncclRemoteError) {
    return Status(StatusCode::kPeerFailure, text);
  }
  if (r == ncclUnhandledCudaError &&
      (last.find("driver") != std::string::npos || last.find("no CUDA-capable") != std::string::npos)) {
    return Status(StatusCode::kInternal, "no usable CUDA device: " + text);
  }
  return Status(StatusCode::kInternal, text);
}

Status NcclCommunicator::call(const char* what, const std::function<ncclResult_t()>& fn) {
  std::lock_guard<std::mutex> lock(handle_->mu);
  if (handle_->aborted) {
    return Status(StatusCode::kAborted, "communicator of group '" + opts_.name + "' was aborted");
  }
  return mapError(what, fn());
}

Status NcclCommunicator::settle(const char* what, const Deadline& dl) {
  return pollUntil(
      [&]() -> Result<bool> {
        ncclResult_t async = ncclSuccess;
        RC_RETURN_IF_ERROR(call("ncclCommGetAsyncError", [&] { return api_->commGetAsyncError(comm_, &async); }));
        if (async == ncclInProgress) {
          return false;
        }
        RC_RETURN_IF_ERROR(mapError(what, async));
        return true;
      },
      dl, abort_, {std::chrono::microseconds(20), std::chrono::microseconds(2000)},
      std::string(what) + " did not finish before the deadline");
}

Status NcclCommunicator::initWithId(const std::string& key, const Deadline& dl) {
  ncclUniqueId id{};
  RC_RETURN_IF_ERROR(exchangeId(
      opts_.store, key, opts_.rank == 0,
      [&](void* out) { return mapError("ncclGetUniqueId", api_->getUniqueId(static_cast<ncclUniqueId*>(out))); },
      &id, sizeof(id), dl, abort_));
  ncclConfig_t cfg = nonBlockingConfig();
  return call("ncclCommInitRankConfig",
              [&] { return api_->commInitRankConfig(&comm_, opts_.size, id, opts_.rank, &cfg); });
}

void NcclCommunicator::start(std::function<Status(NcclCommunicator&, const Deadline&)> plan, const Deadline& dl) {
  std::shared_ptr<NcclCommunicator> self = shared_from_this();
  std::thread([self, plan = std::move(plan), dl] {
    self->streams_->makeCurrent();  // NCCL binds a communicator to the calling thread's device
    Status st = plan(*self, dl);
    if (st.isOk()) {
      st = self->settle("communicator init", dl);
    }
    if (!self->finishInit(st) || st.isOk()) {
      return;  // Ready, or aborted meanwhile
    }
    self->abort_.abort(st.message());
    self->abortNccl();
  }).detach();
}

void NcclCommunicator::abortNccl() {
  Reaper::run(
      [h = handle_, api = api_] {
        std::lock_guard<std::mutex> lock(h->mu);
        if (h->comm != nullptr && !h->aborted) {
          api->commAbort(h->comm);
        }
        h->aborted = true;
      },
      abortBound(), "ncclCommAbort of group '" + opts_.name + "'");
}

void NcclCommunicator::abort(const std::string& reason) {
  markAborted(reason);
  abort_.abort(reason);
  abortNccl();
}

Status NcclCommunicator::fail(const Status& st) {
  if (st.isOk() || st.code() == StatusCode::kInvalidArgument) {
    return st;
  }
  const bool first = markFailed(st);
  abort_.abort(st.message());
  abortNccl();
  return first ? st : error();
}

Status NcclCommunicator::waitDone(uint64_t token, const Deadline& dl) {
  return pollUntil(
      [&]() -> Result<bool> {
        // The error first: an op that "finished" on a communicator with a remote error has no
        // trustworthy result.
        ncclResult_t async = ncclSuccess;
        RC_RETURN_IF_ERROR(call("ncclCommGetAsyncError", [&] { return api_->commGetAsyncError(comm_, &async); }));
        RC_RETURN_IF_ERROR(mapError("the op (asynchronous error)", async));
        return streams_->done(token);
      },
      dl, abort_, {std::chrono::microseconds(5), std::chrono::microseconds(1000)},
      "the op did not complete on the device before its deadline");
}

Status NcclCommunicator::run(OpKind op, const Deadline& dl, const std::function<Status()>& launch) {
  const uint64_t seq = seq_++;
  CommState s = state();
  if (s == CommState::kInitializing) {
    RC_RETURN_IF_ERROR(waitReady(dl));
    s = state();
  }
  if (s != CommState::kReady) {
    return error();
  }
  streams_->makeCurrent();
  streams_->followCaller();
  Status st = launch();
  if (st.isOk()) {
    st = waitDone(streams_->record(), dl);
  }
  if (st.isOk()) {
    return st;
  }
  return fail(st.withContext(std::string(opKindName(op)) + " #" + std::to_string(seq)));
}

Status NcclCommunicator::allReduce(void* buf, size_t count, DataType dt, RedOp op, const Deadline& dl) {
  ncclDataType_t t{};
  RC_ASSIGN_OR_RETURN(t, toNccl(dt));
  return run(OpKind::kAllReduce, dl, [&] {
    return call("ncclAllReduce",
                [&] { return api_->allReduce(buf, buf, count, t, toNccl(op, dt), comm_, streams_->nativeStream()); });
  });
}

Status NcclCommunicator::broadcast(void* buf, size_t count, DataType dt, int root, const Deadline& dl) {
  size_t bytes = count * dataTypeSize(dt);
  return run(OpKind::kBroadcast, dl, [&] {
    return call("ncclBroadcast",
                [&] { return api_->broadcast(buf, buf, bytes, ncclUint8, root, comm_, streams_->nativeStream()); });
  });
}

Status NcclCommunicator::reduce(void* buf, size_t count, DataType dt, RedOp op, int root, const Deadline& dl) {
  ncclDataType_t t{};
  RC_ASSIGN_OR_RETURN(t, toNccl(dt));
  return run(OpKind::kReduce, dl, [&] {
    return call("ncclReduce", [&] {
      return api_->reduce(buf, buf, count, t, toNccl(op, dt), root, comm_, streams_->nativeStream());
    });
  });
}

Status NcclCommunicator::allGather(const void* send, void* recv, size_t count, DataType dt, const Deadline& dl) {
  size_t bytes = count * dataTypeSize(dt);
  return run(OpKind::kAllGather, dl, [&] {
    return call("ncclAllGather",
                [&] { return api_->allGather(send, recv, bytes, ncclUint8, comm_, streams_->nativeStream()); });
  });
}

Status NcclCommunicator::reduceScatter(const void* send, void* recv, size_t count, DataType dt, RedOp op,
                                       const Deadline& dl) {
  ncclDataType_t t{};
  RC_ASSIGN_OR_RETURN(t, toNccl(dt));
  return run(OpKind::kReduceScatter, dl, [&] {
    return call("ncclReduceScatter", [&] {
      return api_->reduceScatter(send, recv, count, t, toNccl(op, dt), comm_, streams_->nativeStream());
    });
  });
}

Status NcclCommunicator::allToAll(const void* send, const std::vector<size_t>& sendCounts,
                                  const std::vector<size_t>& sendDispls, void* recv,
                                  const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                                  DataType dt, const Deadline& dl) {
  const size_t es = dataTypeSize(dt);
  return run(OpKind::kAllToAll, dl, [&] {
    return call("ncclSend/ncclRecv group", [&] {
      api_->groupStart();
      for (int p = 0; p < opts_.size; ++p) {
        api_->send(static_cast<const char*>(send) + sendDispls[p] * es, sendCounts[p] * es, ncclUint8, p, comm_,
                   streams_->nativeStream());
        api_->recv(static_cast<char*>(recv) + recvDispls[p] * es, recvCounts[p] * es, ncclUint8, p, comm_,
                   streams_->nativeStream());
      }
      return api_->groupEnd();
    });
  });
}

Status NcclCommunicator::gather(const void* send, void* recv, size_t count, DataType dt, int root,
                                const Deadline& dl) {
  const size_t bytes = count * dataTypeSize(dt);
  return run(OpKind::kGather, dl, [&] {
    return call("ncclSend/ncclRecv group", [&] {
      api_->groupStart();
      if (opts_.rank == root) {
        for (int p = 0; p < opts_.size; ++p) {
          api_->recv(static_cast<char*>(recv) + p * bytes, bytes, ncclUint8, p, comm_, streams_->nativeStream());
        }
      }
      api_->send(send, bytes, ncclUint8, root, comm_, streams_->nativeStream());
      return api_->groupEnd();
    });
  });
}

Status NcclCommunicator::scatter(const void* send, void* recv, size_t count, DataType dt, int root,
                                 const Deadline& dl) {
  const size_t bytes = count * dataTypeSize(dt);
  return run(OpKind::kScatter, dl, [&] {
    return call("ncclSend/ncclRecv group", [&] {
      api_->groupStart();
      if (opts_.rank == root) {
        for (int p = 0; p < opts_.size; ++p) {
          api_->send(static_cast<const char*>(send) + p * bytes, bytes, ncclUint8, p, comm_, streams_->nativeStream());
        }
      }
      api_->recv(recv, bytes, ncclUint8, root, comm_, streams_->nativeStream());
      return api_->groupEnd();
    });
  });
}

Status NcclCommunicator::barrier(const Deadline& dl) {
  void* one = streams_->scratch(sizeof(float));
  return run(OpKind::kBarrier, dl, [&] {
    return call("ncclAllReduce (barrier)",
                [&] { return api_->allReduce(one, one, 1, ncclFloat32, ncclSum, comm_, streams_->nativeStream()); });
  });
}

Status NcclCommunicator::sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed* feed) {
  for (const P2POp& op : ops) {
    if (op.peer < 0 || op.peer >= opts_.size || op.peer == opts_.rank) {
      return Status(StatusCode::kInvalidArgument, "send/recv: peer " + std::to_string(op.peer) +
                                                      " is not another rank of a group of " +
                                                      std::to_string(opts_.size));
    }
  }
  // NCCL has no tags: messages between two ranks match in order, as on TCP. Ops queued while
  // this group runs are not joined (the group is already on the device): `feed` is unused.
  (void)feed;
  return run(OpKind::kSendRecv, dl, [&] {
    return call("ncclSend/ncclRecv group", [&] {
      api_->groupStart();
      for (const P2POp& op : ops) {
        if (op.kind == P2POp::Kind::kSend) {
          api_->send(op.buf, op.bytes, ncclUint8, op.peer, comm_, streams_->nativeStream());
        } else {
          api_->recv(op.buf, op.bytes, ncclUint8, op.peer, comm_, streams_->nativeStream());
        }
      }
      return api_->groupEnd();
    });
  });
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::adopt(ncclComm_t child, int rank, int size,
                                                              const std::string& prefix, const Deadline& dl) {
  if (child == nullptr) {
    return std::shared_ptr<Communicator>();
  }
  NcclOptions o = opts_;
  o.rank = rank;
  o.size = size;
  o.prefix = prefix;
  std::shared_ptr<NcclCommunicator> c(new NcclCommunicator(api_, streams_, std::move(o)));
  c->comm_ = child;
  c->start([](NcclCommunicator&, const Deadline&) { return Status::ok(); }, dl);
  return std::shared_ptr<Communicator>(c);
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::reinit(int rank, int size,
                                                               const c10::intrusive_ptr<c10d::Store>& store,
                                                               const std::string& prefix, const Deadline& dl) {
  NcclOptions o = opts_;
  o.rank = rank;
  o.size = size;
  o.store = store;
  o.prefix = prefix;  // the child's own: its later moves cannot meet the parent's keys
  std::shared_ptr<NcclCommunicator> c(new NcclCommunicator(api_, streams_, std::move(o)));
  c->start([](NcclCommunicator& self, const Deadline& d) { return self.initWithId(self.opts_.prefix + "uid", d); },
           dl);
  return std::shared_ptr<Communicator>(c);
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::shrink(const std::vector<int>& exclude, bool afterError,
                                                               const Deadline& dl) {
  ShrinkPlan plan;
  RC_ASSIGN_OR_RETURN(plan, planShrink(exclude, opts_.rank, opts_.size));
  std::string tag = "shrink" + std::to_string(derived_++) + "/";
  if (!api_->features().shrink || comm_ == nullptr) {
    if (afterError) {
      abort("shrunk after an error");
    }
    return reinit(plan.newRank, plan.newSize, opts_.store, opts_.prefix + tag + plan.survivorList() + "/", dl);
  }
  std::vector<int> ex(exclude.begin(), exclude.end());
  ncclComm_t child = nullptr;
  ncclConfig_t cfg = nonBlockingConfig();
  Status st = call("ncclCommShrink", [&] {
    return api_->commShrink(comm_, ex.data(), static_cast<int>(ex.size()), &child, &cfg,
                            afterError ? kNcclShrinkAbort : kNcclShrinkDefault);
  });
  if (afterError) {
    abort("shrunk after an error (NCCL_SHRINK_ABORT)");
  }
  RC_RETURN_IF_ERROR(st);
  return adopt(child, plan.newRank, plan.newSize, opts_.prefix + tag, dl);
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::split(int color, int key, const Deadline& dl) {
  std::string tag = "split" + std::to_string(derived_++) + "/";
  std::vector<int> members;
  RC_ASSIGN_OR_RETURN(members, agreeOnMembers(opts_.store, opts_.prefix + tag + "ck/", opts_.rank, opts_.size, color,
                                              key, dl, abort_));
  if (color < 0) {
    if (api_->features().split) {  // NCCL needs every parent member in the split call
      ncclComm_t none = nullptr;
      ncclConfig_t cfg = nonBlockingConfig();
      RC_RETURN_IF_ERROR(
          call("ncclCommSplit", [&] { return api_->commSplit(comm_, kNcclSplitNoColor, key, &none, &cfg); }));
    }
    return std::shared_ptr<Communicator>();
  }
  int newRank = static_cast<int>(std::find(members.begin(), members.end(), opts_.rank) - members.begin());
  int newSize = static_cast<int>(members.size());
  if (!api_->features().split) {
    return reinit(newRank, newSize, opts_.store, opts_.prefix + tag + std::to_string(color) + "/", dl);
  }
  ncclComm_t child = nullptr;
  ncclConfig_t cfg = nonBlockingConfig();
  RC_RETURN_IF_ERROR(call("ncclCommSplit", [&] { return api_->commSplit(comm_, color, key, &child, &cfg); }));
  return adopt(child, newRank, newSize, opts_.prefix + tag, dl);
}

Result<std::shared_ptr<Communicator>> NcclCommunicator::grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                                             const std::string& joinKey, const Deadline& dl) {
  if (newSize <= opts_.size) {
    return Status(StatusCode::kInvalidArgument, "grow: the new size must exceed the current size");
  }
  ++derived_;
  if (!api_->features().grow) {
    return reinit(opts_.rank, newSize, store, joinKey, dl);  // the joiners init under joinKey too
  }
  ncclUniqueId id{};
  if (opts_.rank == 0) {
    RC_RETURN_IF_ERROR(call("ncclCommGetUniqueId", [&] { return api_->commGetUniqueId(comm_, &id); }));
    RC_RETURN_IF_ERROR(storeSet(store, joinKey + "uid", hexEncode(id.internal, sizeof(id.internal))));
  }
  ncclComm_t child = nullptr;
  ncclConfig_t cfg = nonBlockingConfig();
  RC_RETURN_IF_ERROR(call("ncclCommGrow", [&] {
    return api_->commGrow(comm_, newSize, opts_.rank == 0 ? &id : nullptr, -1, &child, &cfg);
  }));
  auto grown = adopt(child, opts_.rank, newSize, joinKey, dl);
  if (grown.isOk() && grown.value()) {
    std::static_pointer_cast<NcclCommunicator>(grown.value())->opts_.store = store;
  }
  return grown;
}

}  // namespace resilient_comm::nccl
