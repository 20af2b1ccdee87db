#include "transport/hccl/hccl_communicator.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "comm/bootstrap_id.h"
#include "comm/group_moves.h"
#include "comm/poll_loop.h"
#include "common/check.h"
#include "common/logging.h"
#include "watchdog/reaper.h"

namespace resilient_comm::hccl {

namespace {

Status mapError(HcclApi& api, const std::string& what, HcclResult r) {
  if (r == HCCL_SUCCESS) {
    return Status::ok();
  }
  const std::string name = hcclResultName(r);
  const std::string text = api.getErrorString(r);
  const std::string msg = what + " failed: " + text + (text == name ? "" : " (" + name + ")");
  switch (r) {
    case HCCL_E_REMOTE:
    case HCCL_E_TCP_CONNECT:
    case HCCL_E_ROCE_CONNECT:
    case HCCL_E_TCP_TRANSFER:
    case HCCL_E_ROCE_TRANSFER:
      return Status(StatusCode::kPeerFailure, msg);
    case HCCL_E_TIMEOUT:
      return Status(StatusCode::kTimeout, msg);
    case HCCL_E_SUSPENDING:
      return Status(StatusCode::kAborted, msg);
    case HCCL_E_NOT_SUPPORT:
      return Status(StatusCode::kNotSupported, msg);
    default:
      return Status(StatusCode::kInternal, msg);
  }
}

Result<HcclDataType> toHccl(DataType dt) {
  switch (dt) {
    case DataType::kInt8:
      return HCCL_DATA_TYPE_INT8;
    case DataType::kUInt8:
    case DataType::kBool:
      return HCCL_DATA_TYPE_UINT8;
    case DataType::kInt16:
      return HCCL_DATA_TYPE_INT16;
    case DataType::kInt32:
      return HCCL_DATA_TYPE_INT32;
    case DataType::kInt64:
      return HCCL_DATA_TYPE_INT64;
    case DataType::kFloat16:
      return HCCL_DATA_TYPE_FP16;
    case DataType::kBFloat16:
      return HCCL_DATA_TYPE_BFP16;
    case DataType::kFloat32:
      return HCCL_DATA_TYPE_FP32;
    case DataType::kFloat64:
      return HCCL_DATA_TYPE_FP64;
  }
  return Status(StatusCode::kInvalidArgument, std::string("HCCL has no ") + dataTypeName(dt) + " type");
}

Result<HcclReduceOp> toHccl(RedOp op, DataType dt) {
  if (dt == DataType::kBool) {  // or / and, as the TCP transport does
    return (op == RedOp::kProd || op == RedOp::kMin) ? HCCL_REDUCE_MIN : HCCL_REDUCE_MAX;
  }
  switch (op) {
    case RedOp::kSum:
      return HCCL_REDUCE_SUM;
    case RedOp::kProd:
      return HCCL_REDUCE_PROD;
    case RedOp::kMin:
      return HCCL_REDUCE_MIN;
    case RedOp::kMax:
      return HCCL_REDUCE_MAX;
    case RedOp::kAvg:
      break;
  }
  return Status(StatusCode::kNotSupported, "HCCL has no average: reduce with sum and divide by the group size");
}

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h = (h ^ p[i]) * 0x100000001b3ULL;
  }
  return h;
}
constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ULL;

// Suspends (a failed communicator, where the library can) and destroys `comm`, on the calling
// thread, after binding it to the device.
void destroyComm(HcclApi& api, HcclComm comm, bool suspend, const std::function<void()>& bindDevice) {
  if (bindDevice) {
    bindDevice();
  }
  if (suspend && api.features().suspend) {
    api.commSuspend(comm);
  }
  api.commDestroy(comm);
}

// Every rank inits with `root` (blocking).
Result<BuiltComm> initWithRootInfo(const std::shared_ptr<HcclApi>& api, const HcclRootInfo& root, int rank, int size) {
  HcclCommConfig cfg = commConfig();
  HcclComm comm = nullptr;
  RC_RETURN_IF_ERROR(mapError(*api, "HcclCommInitRootInfoConfig",
                              api->commInitRootInfoConfig(static_cast<uint32_t>(size), &root,
                                                          static_cast<uint32_t>(rank), &cfg, &comm)));
  return BuiltComm{comm, fnv1a(kFnvBasis, root.internal, sizeof(root.internal))};
}

// Rank 0 makes the root info and publishes it under `key`; every rank inits with it (blocking).
Result<BuiltComm> initWorld(const std::shared_ptr<HcclApi>& api, const StorePtr& store, const std::string& key, int rank,
                        int size, const Deadline& dl, AbortToken& abort) {
  HcclRootInfo root{};
  RC_RETURN_IF_ERROR(exchangeId(
      store, key, rank == 0,
      [&](void* out) { return mapError(*api, "HcclGetRootInfo", api->getRootInfo(static_cast<HcclRootInfo*>(out))); },
      &root, sizeof(root), dl, abort));
  return initWithRootInfo(api, root, rank, size);
}

}  // namespace

// One HcclComm and what a thread other than its communicator's needs to use or destroy it: the
// build thread, reaper threads, and (for a world) the communicators derived from it. The last
// holder destroys a comm nobody released, on the Reaper.
struct CommHandle {
  CommHandle(std::shared_ptr<HcclApi> a, std::function<void()> bind, std::string w)
      : api(std::move(a)), bindDevice(std::move(bind)), what(std::move(w)) {}
  ~CommHandle() {
    if (comm == nullptr) {
      return;
    }
    Reaper::run([api = api, comm = comm, suspend = failed.load(),
                 bind = bindDevice] { destroyComm(*api, comm, suspend, bind); },
                Reaper::abortBound(), "HcclCommDestroy of " + what);
  }

  const std::shared_ptr<HcclApi> api;
  const std::function<void()> bindDevice;
  const std::string what;  // "group 'g' rank r", for messages

  std::mutex mu;  // serializes HCCL calls on comm; guards comm and the build fields
  HcclComm comm = nullptr;
  bool building = false;  // a build thread has not returned yet
  bool built = false;     // it returned, with buildStatus
  Status buildStatus;
  uint64_t worldId = 0;  // a world's root-info hash: names its sub-communicators
  std::atomic<bool> usable{false};    // comm was built and not released (set last, read without mu)
  std::atomic<bool> released{false};  // its communicator gave it up: destroy as soon as nobody uses it
  std::atomic<bool> failed{false};    // it saw an error or an abort: suspend before destroying
};

HcclCommunicator::HcclCommunicator(std::shared_ptr<HcclApi> api, std::shared_ptr<StreamOps> streams,
                                   HcclOptions opts, const Deadline& initDeadline)
    : CommLifecycle(opts.name, opts.rank, opts.size),
      api_(std::move(api)),
      streams_(std::move(streams)),
      stream_(streams_->nativeStream()),
      opts_(std::move(opts)),
      initDeadline_(initDeadline) {
  own_ = std::make_shared<CommHandle>(api_, opts_.bindDevice,
                                      "group '" + opts_.name + "' rank " + std::to_string(opts_.rank));
  world_ = own_;
  for (int r = 0; r < opts_.size; ++r) {
    worldRanks_.push_back(static_cast<uint32_t>(r));
  }
}

Result<std::shared_ptr<HcclCommunicator>> HcclCommunicator::make(std::shared_ptr<HcclApi> api, HcclOptions opts,
                                                                 const Deadline& initDeadline) {
  if (!opts.makeStreams) {
    return Status(StatusCode::kInvalidArgument, "HcclOptions::makeStreams is not set");
  }
  std::shared_ptr<StreamOps> streams;
  RC_ASSIGN_OR_RETURN(streams, opts.makeStreams());
  return std::shared_ptr<HcclCommunicator>(
      new HcclCommunicator(std::move(api), std::move(streams), std::move(opts), initDeadline));
}

Result<std::shared_ptr<HcclCommunicator>> HcclCommunicator::create(std::shared_ptr<HcclApi> api, HcclOptions opts,
                                                                   const Deadline& initDeadline) {
  if (!opts.rootInfo.empty() && opts.rootInfo.size() != sizeof(HcclRootInfo)) {
    return Status(StatusCode::kInvalidArgument, "a root info of " + std::to_string(opts.rootInfo.size()) +
                                                    " bytes; an HcclRootInfo has " +
                                                    std::to_string(sizeof(HcclRootInfo)));
  }
  std::shared_ptr<HcclCommunicator> c;
  RC_ASSIGN_OR_RETURN(c, make(std::move(api), std::move(opts), initDeadline));
  if (!c->opts_.rootInfo.empty()) {  // handed over: no store
    auto root = std::make_shared<HcclRootInfo>();
    std::memcpy(root->internal, c->opts_.rootInfo.data(), sizeof(root->internal));
    c->opts_.rootInfo.clear();  // once: a later re-init makes its own
    c->startBuild([api = c->api_, root, rank = c->opts_.rank, size = c->opts_.size](const Deadline&) {
      return initWithRootInfo(api, *root, rank, size);
    });
    return c;
  }
  c->startBuild([api = c->api_, store = c->opts_.store, prefix = c->opts_.prefix, rank = c->opts_.rank,
                 size = c->opts_.size, abort = c->abort_](const Deadline& dl) -> Result<BuiltComm> {
    int64_t incarnation = 0;
    RC_ASSIGN_OR_RETURN(incarnation, storeAdd(store, prefix + "incarnation/" + std::to_string(rank), 1));
    return initWorld(api, store, prefix + "e" + std::to_string(incarnation) + "/uid", rank, size, dl, *abort);
  });
  return c;
}

Result<std::shared_ptr<HcclCommunicator>> HcclCommunicator::join(std::shared_ptr<HcclApi> api, HcclOptions opts,
                                                                 const Deadline& dl) {
  std::shared_ptr<HcclCommunicator> c;
  RC_ASSIGN_OR_RETURN(c, make(std::move(api), std::move(opts), dl));
  c->startBuild(c->rootInfoPlan(c->opts_.prefix + "uid", c->opts_.rank, c->opts_.size, c->opts_.store));
  return c;
}

HcclCommunicator::~HcclCommunicator() {
  if (state() == CommState::kInitializing) {
    own_->released = true;  // an init still running: its thread destroys what it returns
    abort_->abort("communicator of group '" + opts_.name + "' destroyed during its init");
  }
}

Result<std::vector<uint8_t>> makeRootInfo(HcclApi& api) {
  std::vector<uint8_t> out(sizeof(HcclRootInfo));
  RC_RETURN_IF_ERROR(mapError(api, "HcclGetRootInfo", api.getRootInfo(reinterpret_cast<HcclRootInfo*>(out.data()))));
  return out;
}

HcclCommunicator::Plan HcclCommunicator::rootInfoPlan(const std::string& key, int rank, int size,
                                                      StorePtr store) const {
  return [api = api_, store = std::move(store), key, rank, size, abort = abort_](const Deadline& dl) {
    return initWorld(api, store, key, rank, size, dl, *abort);
  };
}

void HcclCommunicator::startBuild(Plan plan) {
  {
    std::lock_guard<std::mutex> lock(own_->mu);
    own_->building = true;
  }
  // [Note: HCCL init runs on an abandoned-able thread]: only shared state goes in.
  std::thread([h = own_, plan = std::move(plan), dl = initDeadline_] {
    if (h->bindDevice) {
      h->bindDevice();
    }
    Result<BuiltComm> r = plan(dl);
    std::lock_guard<std::mutex> lock(h->mu);
    h->building = false;
    h->built = true;
    h->buildStatus = r.status();
    if (!r.isOk()) {
      return;
    }
    BuiltComm b = r.take();
    if (h->released) {
      RC_LOG(kWarning, "an abandoned HCCL init of " << h->what << " returned; destroying what it built");
      destroyComm(*h->api, b.comm, false, nullptr);  // the device is bound on this thread already
      return;
    }
    h->comm = b.comm;
    h->worldId = b.worldId;
    h->usable = true;
  }).detach();
}

Caps HcclCommunicator::caps() const {
  Caps c;
  c.nonBlockingInit = true;  // emulated: the blocking HCCL init runs on a build thread
  c.abort = false;           // HCCL cannot cancel device work; abort stops issuing and destroys
  c.split = true;            // from the world where the library can, else by re-init
  c.shrink = true;
  c.grow = true;  // by re-init
  return c;
}

Status HcclCommunicator::poll() {
  if (state() == CommState::kInitializing) {
    bool built = false;
    Status st;
    {
      std::lock_guard<std::mutex> lock(own_->mu);  // held only briefly while initializing
      built = own_->built;
      st = own_->buildStatus;
    }
    const std::string where = "group '" + opts_.name + "' on rank " + std::to_string(opts_.rank);
    if (built && st.isOk()) {
      leaveInit(CommState::kReady, Status::ok());
    } else if (built || initDeadline_.passed()) {
      Status failed = built ? st.withContext("building " + where)
                            : Status(StatusCode::kTimeout, "init of " + where +
                                                               " did not finish before its deadline; the HCCL init "
                                                               "thread is abandoned");
      if (leaveInit(CommState::kError, failed)) {
        abort_->abort(failed.message());
        release();
      }
    }
  }
  return CommLifecycle::poll();
}

void HcclCommunicator::release() {
  own_->failed = true;
  if (own_ == world_ && canDerive()) {
    return;  // [Note: the world communicator outlives its failure]
  }
  if (own_->released.exchange(true)) {
    return;
  }
  own_->usable = false;
  Reaper::run(
      [h = own_] {
        std::lock_guard<std::mutex> lock(h->mu);
        if (h->building || h->comm == nullptr) {
          return;  // a build still running destroys what it returns
        }
        destroyComm(*h->api, h->comm, true, h->bindDevice);
        h->comm = nullptr;
      },
      Reaper::abortBound(), "HcclCommDestroy of " + own_->what);
}

void HcclCommunicator::abort(const std::string& reason) {
  markAborted(reason);
  abort_->abort(reason);
  release();
}

Status HcclCommunicator::fail(const Status& st) {
  if (st.isOk() || st.code() == StatusCode::kInvalidArgument) {
    return st;
  }
  const bool first = markFailed(st);
  abort_->abort(st.message());
  release();
  return first ? st : error();
}

Status HcclCommunicator::call(const char* what, const Deadline& dl, const std::function<HcclResult(HcclComm)>& fn) {
  std::unique_lock<std::mutex> lock(own_->mu, std::defer_lock);
  RC_RETURN_IF_ERROR(pollUntil([&]() -> Result<bool> { return lock.try_lock(); }, dl, *abort_,
                               {std::chrono::microseconds(20), std::chrono::microseconds(1000)},
                               std::string(what) + ": the communicator stayed busy until the deadline"));
  if (abort_->aborted() || own_->comm == nullptr) {  // stop issuing, the world included
    return Status(StatusCode::kAborted, "communicator of group '" + opts_.name + "' was aborted");
  }
  return mapError(*api_, what, fn(own_->comm));
}

Status HcclCommunicator::waitDone(device::DeviceEvent& end, const Deadline& dl) {
  return pollUntil(
      [&]() -> Result<bool> {
        // The error first: an op that "finished" on a communicator with an error has no
        // trustworthy result.
        HcclResult async = HCCL_SUCCESS;
        RC_RETURN_IF_ERROR(
            call("HcclGetCommAsyncError", dl, [&](HcclComm c) { return api_->getCommAsyncError(c, &async); }));
        RC_RETURN_IF_ERROR(mapError(*api_, "the op (asynchronous error)", async));
        return end.query();
      },
      dl, *abort_, {std::chrono::microseconds(5), std::chrono::microseconds(1000)},
      "the op did not complete on the device before its deadline");
}

Status HcclCommunicator::run(OpKind op, const Deadline& dl,
                             const std::function<HcclResult(HcclComm, aclrtStream)>& launch, const char* what) {
  const uint64_t seq = seq_++;
  CommState s = state();
  if (s == CommState::kInitializing) {
    RC_RETURN_IF_ERROR(waitReady(dl));
    s = state();
  }
  if (s != CommState::kReady) {
    return error();
  }
  if (opts_.bindDevice) {
    opts_.bindDevice();
  }
  Status st = streams_->followCurrent();
  if (st.isOk()) {
    st = call(what, dl, [&](HcclComm c) { return launch(c, stream_); });
  }
  if (st.isOk()) {
    Result<std::shared_ptr<device::DeviceEvent>> end = streams_->record();
    st = end.isOk() ? waitDone(*end.value(), dl) : end.status();
  }
  if (st.isOk()) {
    return st;
  }
  return fail(st.withContext(std::string(opKindName(op)) + " #" + std::to_string(seq)));
}

Status HcclCommunicator::allReduce(void* buf, size_t count, DataType dt, RedOp op, const Deadline& dl) {
  HcclDataType t{};
  RC_ASSIGN_OR_RETURN(t, toHccl(dt));
  HcclReduceOp o{};
  RC_ASSIGN_OR_RETURN(o, toHccl(op, dt));
  return run(
      OpKind::kAllReduce, dl,
      [&](HcclComm c, aclrtStream s) { return api_->allReduce(buf, buf, count, t, o, c, s); }, "HcclAllReduce");
}

Status HcclCommunicator::broadcast(void* buf, size_t count, DataType dt, int root, const Deadline& dl) {
  const uint64_t bytes = count * dataTypeSize(dt);
  return run(
      OpKind::kBroadcast, dl,
      [&](HcclComm c, aclrtStream s) {
        return api_->broadcast(buf, bytes, HCCL_DATA_TYPE_UINT8, static_cast<uint32_t>(root), c, s);
      },
      "HcclBroadcast");
}

Status HcclCommunicator::reduce(void* buf, size_t count, DataType dt, RedOp op, int root, const Deadline& dl) {
  if (!api_->features().reduce) {
    return Status(StatusCode::kNotSupported, "reduce: " + api_->path() + " has no HcclReduce");
  }
  HcclDataType t{};
  RC_ASSIGN_OR_RETURN(t, toHccl(dt));
  HcclReduceOp o{};
  RC_ASSIGN_OR_RETURN(o, toHccl(op, dt));
  return run(
      OpKind::kReduce, dl,
      [&](HcclComm c, aclrtStream s) {
        return api_->reduce(buf, buf, count, t, o, static_cast<uint32_t>(root), c, s);
      },
      "HcclReduce");
}

Status HcclCommunicator::allGather(const void* send, void* recv, size_t count, DataType dt, const Deadline& dl) {
  const uint64_t bytes = count * dataTypeSize(dt);
  return run(
      OpKind::kAllGather, dl,
      [&](HcclComm c, aclrtStream s) {
        return api_->allGather(const_cast<void*>(send), recv, bytes, HCCL_DATA_TYPE_UINT8, c, s);
      },
      "HcclAllGather");
}

Status HcclCommunicator::reduceScatter(const void* send, void* recv, size_t count, DataType dt, RedOp op,
                                       const Deadline& dl) {
  HcclDataType t{};
  RC_ASSIGN_OR_RETURN(t, toHccl(dt));
  HcclReduceOp o{};
  RC_ASSIGN_OR_RETURN(o, toHccl(op, dt));
  return run(
      OpKind::kReduceScatter, dl,
      [&](HcclComm c, aclrtStream s) { return api_->reduceScatter(const_cast<void*>(send), recv, count, t, o, c, s); },
      "HcclReduceScatter");
}

Status HcclCommunicator::allToAll(const void* send, const std::vector<size_t>& sendCounts,
                                  const std::vector<size_t>& sendDispls, void* recv,
                                  const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                                  DataType dt, const Deadline& dl) {
  if (!api_->features().allToAllV) {
    return Status(StatusCode::kNotSupported, "all_to_all: " + api_->path() + " has no HcclAlltoAllV");
  }
  const uint64_t es = dataTypeSize(dt);
  auto bytes = [es](const std::vector<size_t>& v) {
    std::vector<uint64_t> out;
    for (size_t x : v) {
      out.push_back(x * es);
    }
    return out;
  };
  const std::vector<uint64_t> sc = bytes(sendCounts), sd = bytes(sendDispls), rc = bytes(recvCounts),
                              rd = bytes(recvDispls);
  return run(
      OpKind::kAllToAll, dl,
      [&](HcclComm c, aclrtStream s) {
        return api_->allToAllV(send, sc.data(), sd.data(), HCCL_DATA_TYPE_UINT8, recv, rc.data(), rd.data(),
                               HCCL_DATA_TYPE_UINT8, c, s);
      },
      "HcclAlltoAllV");
}

Status HcclCommunicator::gather(const void* send, void* recv, size_t count, DataType dt, int root,
                                const Deadline& dl) {
  const uint64_t bytes = count * dataTypeSize(dt);
  void* into = recv;
  if (opts_.rank != root) {
    RC_ASSIGN_OR_RETURN(into, streams_->scratch(bytes * static_cast<uint64_t>(opts_.size)));
  }
  return run(
      OpKind::kGather, dl,
      [&](HcclComm c, aclrtStream s) {
        return api_->allGather(const_cast<void*>(send), into, bytes, HCCL_DATA_TYPE_UINT8, c, s);
      },
      "HcclAllGather (gather)");
}

Status HcclCommunicator::scatter(const void* send, void* recv, size_t count, DataType dt, int root,
                                 const Deadline& dl) {
  if (!api_->features().scatter) {
    return Status(StatusCode::kNotSupported, "scatter: " + api_->path() + " has no HcclScatter");
  }
  const uint64_t bytes = count * dataTypeSize(dt);
  return run(
      OpKind::kScatter, dl,
      [&](HcclComm c, aclrtStream s) {
        return api_->scatter(const_cast<void*>(send), recv, bytes, HCCL_DATA_TYPE_UINT8, static_cast<uint32_t>(root),
                             c, s);
      },
      "HcclScatter");
}

Status HcclCommunicator::barrier(const Deadline& dl) {
  return run(
      OpKind::kBarrier, dl, [&](HcclComm c, aclrtStream s) { return api_->barrier(c, s); }, "HcclBarrier");
}

Status HcclCommunicator::sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed* feed) {
  for (const P2POp& op : ops) {
    if (op.peer < 0 || op.peer >= opts_.size || op.peer == opts_.rank) {
      return Status(StatusCode::kInvalidArgument, "send/recv: peer " + std::to_string(op.peer) +
                                                      " is not another rank of a group of " +
                                                      std::to_string(opts_.size));
    }
  }
  if (ops.empty()) {
    return Status::ok();
  }
  if (ops.size() > 1 && !api_->features().batchSendRecv) {
    return Status(StatusCode::kNotSupported, "send/recv: a group of " + std::to_string(ops.size()) +
                                                 " ops needs HcclBatchSendRecv, which " + api_->path() + " lacks");
  }
  // HCCL has no tags: messages between two ranks match in order, as on TCP. Ops queued while
  // this group runs are not joined (the group is already on the device): `feed` is unused.
  (void)feed;
  std::vector<HcclSendRecvItem> items;
  for (const P2POp& op : ops) {
    items.push_back(HcclSendRecvItem{op.kind == P2POp::Kind::kSend ? HCCL_SEND : HCCL_RECV, op.buf, op.bytes,
                                     HCCL_DATA_TYPE_UINT8, static_cast<uint32_t>(op.peer)});
  }
  return run(
      OpKind::kSendRecv, dl,
      [&](HcclComm c, aclrtStream s) {
        if (items.size() > 1) {
          return api_->batchSendRecv(items.data(), static_cast<uint32_t>(items.size()), c, s);
        }
        const HcclSendRecvItem& i = items.front();
        return i.sendRecvType == HCCL_SEND ? api_->send(i.buf, i.count, i.dataType, i.remoteRank, c, s)
                                           : api_->recv(i.buf, i.count, i.dataType, i.remoteRank, c, s);
      },
      ops.size() > 1 ? "HcclBatchSendRecv" : (ops.front().kind == P2POp::Kind::kSend ? "HcclSend" : "HcclRecv"));
}

uint64_t HcclCommunicator::subCommId(uint64_t worldId, const std::string& path) {
  return fnv1a(fnv1a(kFnvBasis, &worldId, sizeof(worldId)), path.data(), path.size());
}

bool HcclCommunicator::canDerive() const {
  return api_->features().subComm && world_->usable.load();
}

Result<std::shared_ptr<Communicator>> HcclCommunicator::derive(int newRank, std::vector<uint32_t> worldRanks,
                                                               const std::string& tag, const Deadline& dl) {
  HcclOptions o = opts_;
  o.rank = newRank;
  o.size = static_cast<int>(worldRanks.size());
  o.prefix = opts_.prefix + tag;
  std::shared_ptr<HcclCommunicator> c;
  RC_ASSIGN_OR_RETURN(c, make(api_, std::move(o), dl));
  c->world_ = world_;
  c->worldRanks_ = worldRanks;
  const uint64_t id = subCommId(world_->worldId, c->opts_.prefix);
  c->startBuild([api = api_, world = world_, ids = std::move(worldRanks), id,
                 rank = static_cast<uint32_t>(newRank)](const Deadline&) mutable -> Result<BuiltComm> {
    std::lock_guard<std::mutex> lock(world->mu);  // serialized with the world's own calls
    if (world->comm == nullptr) {
      return Status(StatusCode::kAborted, "the world communicator of " + world->what + " is gone");
    }
    HcclComm w = world->comm;
    HcclCommConfig cfg = commConfig();
    HcclComm sub = nullptr;
    RC_RETURN_IF_ERROR(mapError(*api, "HcclCreateSubCommConfig",
                                api->createSubCommConfig(&w, static_cast<uint32_t>(ids.size()), ids.data(), id, rank,
                                                         &cfg, &sub)));
    return BuiltComm{sub, 0};
  });
  return std::shared_ptr<Communicator>(c);
}

Result<std::shared_ptr<Communicator>> HcclCommunicator::reinit(int newRank, int newSize, StorePtr store,
                                                               const std::string& prefix, const Deadline& dl) {
  HcclOptions o = opts_;
  o.rank = newRank;
  o.size = newSize;
  o.store = store;
  o.prefix = prefix;
  std::shared_ptr<HcclCommunicator> c;
  RC_ASSIGN_OR_RETURN(c, make(api_, std::move(o), dl));
  c->startBuild(c->rootInfoPlan(prefix + "uid", newRank, newSize, std::move(store)));
  return std::shared_ptr<Communicator>(c);
}

Result<std::shared_ptr<Communicator>> HcclCommunicator::shrink(const std::vector<int>& exclude, bool afterError,
                                                               const Deadline& dl) {
  ShrinkPlan plan;
  RC_ASSIGN_OR_RETURN(plan, planShrink(exclude, opts_.rank, opts_.size));
  const std::string tag = "shrink" + std::to_string(derived_++) + "/";
  if (afterError) {
    abort("shrunk after an error");  // stops issuing; a world stays for the derivation
  }
  if (canDerive()) {
    std::vector<uint32_t> ids;
    for (int r : plan.survivors) {
      ids.push_back(worldRanks_[r]);
    }
    return derive(plan.newRank, std::move(ids), tag, dl);
  }
  return reinit(plan.newRank, plan.newSize, opts_.store, opts_.prefix + tag + plan.survivorList() + "/", dl);
}

Result<std::shared_ptr<Communicator>> HcclCommunicator::split(int color, int key, const Deadline& dl) {
  const std::string tag = "split" + std::to_string(derived_++) + "/";
  std::vector<int> members;
  RC_ASSIGN_OR_RETURN(members, agreeOnMembers(opts_.store, opts_.prefix + tag + "ck/", opts_.rank, opts_.size, color,
                                              key, dl, *abort_));
  if (color < 0) {
    return std::shared_ptr<Communicator>();  // HCCL needs no call from non-members
  }
  const int newRank = static_cast<int>(std::find(members.begin(), members.end(), opts_.rank) - members.begin());
  const std::string path = tag + std::to_string(color) + "/";
  if (canDerive()) {
    std::vector<uint32_t> ids;
    for (int r : members) {
      ids.push_back(worldRanks_[r]);
    }
    return derive(newRank, std::move(ids), path, dl);
  }
  return reinit(newRank, static_cast<int>(members.size()), opts_.store, opts_.prefix + path, dl);
}

Result<std::shared_ptr<Communicator>> HcclCommunicator::grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                                             const std::string& joinKey, const Deadline& dl) {
  if (newSize <= opts_.size) {
    return Status(StatusCode::kInvalidArgument, "grow: the new size must exceed the current size");
  }
  ++derived_;
  // HCCL has no grow: members and joiners (join()) build a fresh world under the join key.
  return reinit(opts_.rank, newSize, store, joinKey, dl);
}

}  // namespace resilient_comm::hccl
