#include "backend/resilient_backend.h"

#include <c10/util/Exception.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <numeric>

#include "backend/tensor_args.h"
#include "common/env.h"
#include "watchdog/reaper.h"
#include "transport/nccl/nccl_communicator.h"
#include "transport/tcp/tcp_communicator.h"

namespace resilient_comm {

namespace {

using c10d::OpType;

void* ptr(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : t.data_ptr();
}

// Aborts `comm` through the Reaper: bounded even if the transport's abort blocks.
void abortComm(const std::shared_ptr<Communicator>& comm, const std::string& why) {
  static const std::chrono::milliseconds bound(env::getInt(env::Knob::kAbortBoundMs));
  Reaper::run([comm, why] { comm->abort(why); }, bound, "abort of group '" + comm->name() + "'");
}

// A flat buffer of `n` elements like `like`.
at::Tensor flat(const at::Tensor& like, int64_t n) {
  return at::empty({n}, like.options());
}

}  // namespace

ResilientBackend::ResilientBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size, BackendOptions opts)
    : c10d::Backend(rank, size), opts_(std::move(opts)), timeout_(opts_.timeout) {
  store_ = store;
  tcp::TcpOptions t;
  t.name = opts_.groupName;
  t.store = std::move(store);
  t.prefix = "resilient_comm/";
  t.rank = rank;
  t.size = size;
  cpu_ = tcp::TcpCommunicator::create(std::move(t), Deadline::after(timeout_));
  startWorker();
}

ResilientBackend::ResilientBackend(std::shared_ptr<Communicator> comm, BackendOptions opts)
    : c10d::Backend(comm->rank(), comm->size()), opts_(std::move(opts)), timeout_(opts_.timeout), cpu_(std::move(comm)) {
  startWorker();
}

void ResilientBackend::startWorker() {
  p2pWake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  TORCH_CHECK(p2pWake_ >= 0, "eventfd failed: ", std::strerror(errno));
  worker_ = std::thread([this] { workerLoop(); });
}

c10::intrusive_ptr<ResilientBackend> ResilientBackend::join(const c10::intrusive_ptr<c10d::Store>& store,
                                                            const std::string& joinKey, int rank, int newSize,
                                                            int existingSize, BackendOptions opts) {
  if (existingSize < 1 || rank < existingSize || rank >= newSize) {
    C10_THROW_ERROR(ValueError, "join: rank " + std::to_string(rank) + " must be in [" + std::to_string(existingSize) +
                                    ", " + std::to_string(newSize) + ") (the ranks after the existing members)");
  }
  tcp::TcpOptions t;
  t.name = opts.groupName;
  t.store = store;
  t.prefix = joinKey;
  t.rank = rank;
  t.size = newSize;
  auto comm = tcp::TcpCommunicator::join(std::move(t), existingSize, Deadline::after(opts.timeout));
  return c10::make_intrusive<ResilientBackend>(std::move(comm), std::move(opts));
}

c10::intrusive_ptr<ResilientBackend> ResilientBackend::adopt(Result<std::shared_ptr<Communicator>> r, const char* move,
                                                             const std::string& suffix) {
  if (!r.isOk()) {
    if (r.status().code() == StatusCode::kInvalidArgument) {
      C10_THROW_ERROR(ValueError, opts_.backendName + " " + move + " of group '" + opts_.groupName + "' on rank " +
                                      std::to_string(rank_) + ": " + r.status().message());
    }
    CommErrorInfo info = site(move);
    info.code = r.status().code();
    info.cause = r.status().message();
    throw CommException(std::move(info));
  }
  if (!r.value()) {
    return {};
  }
  BackendOptions o = opts_;
  o.groupName = opts_.groupName + suffix;
  o.timeout = timeout_;
  auto child = c10::make_intrusive<ResilientBackend>(r.take(), std::move(o));
  child->store_ = store_;  // a later CUDA communicator bootstraps through the same store
  return child;
}

c10::intrusive_ptr<c10d::Backend> ResilientBackend::shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                           const c10::intrusive_ptr<Options>& optsOverride) {
  std::vector<int> exclude(ranksToExclude.begin(), ranksToExclude.end());
  bool afterError = (shrinkFlags & 1) != 0 || !cpu_->error().isOk();
  auto child = adopt(cpu_->shrink(exclude, afterError, Deadline::after(timeout_)), "shrink", ":shrunk");
  std::shared_ptr<Communicator> cuda;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cuda = cuda_;
  }
  if (cuda) {  // resilient_nccl that has carried CUDA tensors: shrink its NCCL communicator too
    bool cudaAfterError = afterError || !cuda->error().isOk();
    auto r = cuda->shrink(exclude, cudaAfterError, Deadline::after(timeout_));
    if (!r.isOk()) {
      CommErrorInfo info = site("shrink");
      info.code = r.status().code();
      info.cause = r.status().message();
      throw CommException(std::move(info));
    }
    std::lock_guard<std::mutex> lock(child->mu_);
    child->store_ = store_;
    child->cuda_ = r.take();
    child->cudaDevice_ = cudaDevice_;
  }
  return child;
}

c10::intrusive_ptr<c10d::Backend> ResilientBackend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                          const std::vector<int>& ranks,
                                                          const c10::intrusive_ptr<Options>& opts) {
  bool member = std::find(ranks.begin(), ranks.end(), rank_) != ranks.end();
  // The group's lowest parent rank names it: disjoint groups get distinct colors.
  return splitByColor(member ? *std::min_element(ranks.begin(), ranks.end()) : -1, rank_);
}

c10::intrusive_ptr<ResilientBackend> ResilientBackend::splitByColor(int color, int key) {
  auto out = std::make_shared<Result<std::shared_ptr<Communicator>>>(Status(StatusCode::kInternal, "not run"));
  auto work = enqueue(cpu_, OpType::UNKNOWN, "split", {}, timeout_, false, [out, color, key](Communicator& c, const Deadline& dl) {
    *out = c.split(color, key, dl);
    return out->isOk() ? Status::ok() : out->status();
  });
  work->wait(kNoTimeout);  // raises the split's failure; on success `out` is complete
  return adopt(std::move(*out), "split", ":split");
}

c10::intrusive_ptr<ResilientBackend> ResilientBackend::grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                                            const std::string& joinKey) {
  return adopt(cpu_->grow(newSize, store, joinKey, Deadline::after(timeout_)), "grow", ":grown");
}

ResilientBackend::~ResilientBackend() {
  bool busy = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    busy = !queue_.empty();
  }
  if (busy || cpu_->state() == CommState::kInitializing) {
    abortWithReason("process group destroyed with operations pending");
  }
  cv_.notify_all();
  if (worker_.joinable()) {
    worker_.join();
  }
  ::close(p2pWake_);
}

void ResilientBackend::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  timeout_ = timeout;
}

c10::intrusive_ptr<c10d::Backend::Options> ResilientBackend::getBackendOptions() {
  std::lock_guard<std::mutex> lock(mu_);
  auto o = c10::make_intrusive<Options>(opts_.backendName, timeout_);
  o->group_name = opts_.groupName;
  return o;
}

c10d::ErrorType ResilientBackend::getError() {
  Status st = cpu_->error();
  switch (st.code()) {
    case StatusCode::kOk:
      return c10d::ErrorType::SUCCESS;
    case StatusCode::kTimeout:
      return c10d::ErrorType::TIMEOUT;
    case StatusCode::kPeerFailure:
      return c10d::ErrorType::REMOTE_ERROR;
    default:
      return c10d::ErrorType::COMM_ERROR;
  }
}

void ResilientBackend::abort() {
  abortWithReason("abort() called on rank " + std::to_string(rank_));
}

void ResilientBackend::abortWithReason(const std::string& reason) {
  abortComm(cpu_, reason);
  std::shared_ptr<Communicator> cuda;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cuda = cuda_;
  }
  if (cuda) {
    abortComm(cuda, reason);
  }
}

Status ResilientBackend::commError() const {
  return cpu_->error();
}

std::optional<CommErrorInfo> ResilientBackend::errorInfo() const {
  Status st = cpu_->error();
  if (st.isOk()) {
    return std::nullopt;
  }
  CommErrorInfo info = site("communicator");
  info.code = st.code();
  info.cause = st.message();
  return info;
}

void ResilientBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // Rank 0 hears from every rank, then releases them. All of rank 0's receives progress
  // together, so on timeout the error lists every rank that did not arrive (waitAllRanks is
  // therefore always honoured).
  (void)waitAllRanks;
  std::chrono::milliseconds timeout = opts.timeout.count() < 0 ? timeout_ : opts.timeout;
  constexpr uint64_t kTag = 0x6d6f6e69746f72ULL;  // "monitor"
  // Shared with the task: a watchdog expiry can release this thread while the task runs.
  auto bytes = std::make_shared<std::vector<uint8_t>>(size_, 1);
  std::vector<P2POp> ops;
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && (rank_ == 0 || p == 0)) {
      ops.push_back(P2POp{P2POp::Kind::kRecv, p, bytes->data() + p, 1, kTag});
    }
  }
  auto work = enqueue(cpu_, OpType::BARRIER, "monitored_barrier", {}, timeout, false,
                      [this, ops, bytes](Communicator& c, const Deadline& dl) {
                        Status st = c.sendRecv(rank_ == 0 ? ops : std::vector<P2POp>{P2POp{
                                                                       P2POp::Kind::kSend, 0, bytes->data(), 1, kTag}},
                                               dl);
                        if (!st.isOk()) {
                          return st;
                        }
                        std::vector<P2POp> release;
                        for (const P2POp& op : ops) {
                          release.push_back(P2POp{rank_ == 0 ? P2POp::Kind::kSend : P2POp::Kind::kRecv, op.peer,
                                                  op.buf, 1, kTag});
                        }
                        return c.sendRecv(release, dl);
                      });
  work->wait(kNoTimeout);
}

void ResilientBackend::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable() && std::this_thread::get_id() != worker_.get_id()) {
    worker_.join();
  }
}

uint64_t ResilientBackend::getSequenceNumberForGroup() {
  return cpu_->nextSeq();
}

std::shared_ptr<Communicator> ResilientBackend::commFor(const std::vector<at::Tensor>& tensors, const char* op) {
  const at::Device dev = tensors.front().device();
  if (dev.is_cpu()) {
    return cpu_;
  }
  OpSite site{opts_.backendName, opts_.groupName, rank_, op};
  if (!dev.is_cuda() || opts_.backendName != "resilient_nccl") {
    C10_THROW_ERROR(ValueError, site.prefix() + "tensors on " + dev.str() + " are not supported; " +
                                    opts_.backendName + " carries CPU" +
                                    (opts_.backendName == "resilient_nccl" ? " and CUDA" : "") + " tensors");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (cuda_) {
    if (dev != cudaDevice_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "this group's NCCL communicator is on " + cudaDevice_.str() +
                                      ", the tensors on " + dev.str());
    }
    return cuda_;
  }
  auto api = nccl::loadNccl({});
  if (!api.isOk()) {
    C10_THROW_ERROR(ValueError, site.prefix() + api.status().message());
  }
  auto streams = nccl::makeDeviceStreamOps("cuda", dev.index());
  if (!streams.isOk()) {
    C10_THROW_ERROR(ValueError, site.prefix() + streams.status().message());
  }
  nccl::NcclOptions o{opts_.groupName, store_, "resilient_comm_nccl/" + opts_.groupName + "/", rank_, size_};
  auto comm = nccl::NcclCommunicator::create(api.take(), streams.take(), std::move(o), Deadline::after(timeout_));
  if (!comm.isOk()) {
    C10_THROW_ERROR(ValueError, site.prefix() + comm.status().message());
  }
  cuda_ = comm.take();
  cudaDevice_ = dev;
  return cuda_;
}

CommErrorInfo ResilientBackend::site(const char* op) const {
  CommErrorInfo info;
  info.backend = opts_.backendName;
  info.group = opts_.groupName;
  info.rank = rank_;
  info.op = op;
  return info;
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::push(std::shared_ptr<Communicator> comm, OpType type,
                                                      const char* opName, std::vector<at::Tensor> outputs,
                                                      std::chrono::milliseconds timeout, bool mayRunInline, Body body,
                                                      std::optional<P2POp> p2p) {
  auto work = c10::make_intrusive<ResilientWork>(site(opName), type, std::move(outputs),
                                                 [comm](const std::string& why) { abortComm(comm, why); });
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout.count() < 0) {
    timeout = timeout_;
  }
  if (stopping_) {
    lock.unlock();
    work->complete(Status(StatusCode::kAborted, "process group " + opts_.groupName + " was shut down"));
    return work;
  }
  Deadline dl = Deadline::after(timeout);
  std::string why = std::string(opName) + " did not finish within " + std::to_string(timeout.count()) +
                    " ms (watchdog)";
  Watchdog::Id id = Watchdog::instance().watch(dl, [work, comm, why] {
    work->complete(Status(StatusCode::kTimeout, why));
    abortComm(comm, why);
  });
  Task task{comm, work, dl, std::move(body), p2p, id};
  if (p2p && p2pRunning_ && queue_.empty() && comm == p2pComm_) {
    p2pJoin_.push_back(std::move(task));
    lock.unlock();
    uint64_t one = 1;
    (void)!::write(p2pWake_, &one, sizeof(one));
    return work;
  }
  if (mayRunInline && queue_.empty() && !running_) {
    // [Note: synchronous ops on an idle group run on the caller's thread]
    // Nothing is queued or running, so running the op here keeps the group's order, and saves
    // two thread hand-offs per op (tens of microseconds; far more on an oversubscribed host).
    // torch releases the GIL around the call, so other Python threads (an abort) still run.
    running_ = true;
    lock.unlock();
    runTask(task);
    lock.lock();
    running_ = false;
    lock.unlock();
    cv_.notify_all();
    return work;
  }
  queue_.push_back(std::move(task));
  lock.unlock();
  cv_.notify_one();
  return work;
}

void ResilientBackend::runTask(Task& task) {
  task.work->setSeq(task.comm->nextSeq());
  Status st;
  try {
    st = task.body(*task.comm, task.deadline);
  } catch (const std::exception& e) {
    st = Status(StatusCode::kInternal, e.what());
  }
  finishTask(task, st);
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::enqueue(std::shared_ptr<Communicator> comm, OpType type,
                                                         const char* opName, std::vector<at::Tensor> outputs,
                                                         std::chrono::milliseconds timeout, bool mayRunInline,
                                                         Body body) {
  return push(std::move(comm), type, opName, std::move(outputs), timeout, mayRunInline, std::move(body),
              std::nullopt);
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::enqueueP2P(std::shared_ptr<Communicator> comm, OpType type,
                                                            const char* opName, const at::Tensor& t, P2POp op) {
  // The tensor stays alive through the Work's outputs until the op completes.
  return push(std::move(comm), type, opName, {t}, c10d::kUnsetTimeout, false, nullptr, op);
}

void ResilientBackend::finishTask(Task& task, const Status& st) {
  Watchdog::instance().unwatch(task.watchId);
  task.work->complete(st);
}

void ResilientBackend::runP2PGroup(std::vector<Task>& group) {
  std::vector<P2POp> ops;
  Deadline dl = group.front().deadline;
  for (const Task& t : group) {
    ops.push_back(*t.p2p);
    dl = dl.earliest(t.deadline);
  }
  // Send/recv queued while this group runs (and nothing else queued before them) joins it:
  // see push(). The feed hands them over from the worker's own thread.
  P2PFeed feed;
  feed.wakeFd = p2pWake_;
  feed.take = [this, &group] {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<P2POp> more;
    for (Task& t : p2pJoin_) {
      more.push_back(*t.p2p);
      group.push_back(std::move(t));
    }
    p2pJoin_.clear();
    return more;
  };
  Status st = group.front().comm->sendRecv(ops, dl, &feed);
  {
    // Ops that arrived after the transfer's last wake-up were never taken: they are next.
    std::lock_guard<std::mutex> lock(mu_);
    p2pRunning_ = false;
    for (auto it = p2pJoin_.rbegin(); it != p2pJoin_.rend(); ++it) {
      queue_.push_front(std::move(*it));
    }
    p2pJoin_.clear();
  }
  for (Task& t : group) {
    finishTask(t, st);
  }
}

void ResilientBackend::workerLoop() {
  for (;;) {
    Task task{nullptr, nullptr, Deadline::never(), nullptr, std::nullopt, 0};
    std::vector<Task> p2pGroup;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return (stopping_ && !running_) || (!queue_.empty() && !running_); });
      if (queue_.empty()) {
        return;  // stopping, and nothing left
      }
      running_ = true;
      while (!queue_.empty() && queue_.front().p2p.has_value() &&
             (p2pGroup.empty() || queue_.front().comm == p2pGroup.front().comm)) {
        p2pGroup.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      p2pRunning_ = !p2pGroup.empty();
      p2pComm_ = p2pRunning_ ? p2pGroup.front().comm : nullptr;
      if (p2pGroup.empty()) {
        task = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (!p2pGroup.empty()) {
      runP2PGroup(p2pGroup);
    } else {
      runTask(task);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
  }
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "broadcast"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, opts.rootRank, size_, "root");
  auto comm = commFor(tensors, site.op);
  at::Tensor t = tensors[0];
  DataType dt = toDataType(site, t.scalar_type());
  int root = static_cast<int>(opts.rootRank);
  return enqueue(comm, OpType::BROADCAST, site.op, tensors, opts.timeout, !opts.asyncOp, [t, dt, root](Communicator& c, const Deadline& dl) {
    return c.broadcast(ptr(t), t.numel(), dt, root, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_reduce"};
  checkSingle(site, tensors, "tensors");
  auto comm = commFor(tensors, site.op);
  at::Tensor t = tensors[0];
  DataType dt = toDataType(site, t.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, t.scalar_type());
  return enqueue(comm, OpType::ALLREDUCE, site.op, tensors, opts.timeout, !opts.asyncOp, [t, dt, op](Communicator& c, const Deadline& dl) {
    return c.allReduce(ptr(t), t.numel(), dt, op, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_reduce_coalesced"};
  checkTensors(site, tensors, "tensors");
  auto comm = commFor(tensors, site.op);
  DataType dt = toDataType(site, tensors[0].scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, tensors[0].scalar_type());
  std::vector<at::Tensor> ts = tensors;
  return enqueue(comm, OpType::ALLREDUCE_COALESCED, site.op, tensors, opts.timeout, !opts.asyncOp, [ts, dt, op](Communicator& c, const Deadline& dl) {
    std::vector<at::Tensor> views;
    for (const at::Tensor& t : ts) {
      views.push_back(t.reshape({-1}));
    }
    at::Tensor buf = at::cat(views);
    Status st = c.allReduce(ptr(buf), buf.numel(), dt, op, dl);
    if (st.isOk()) {
      int64_t off = 0;
      for (const at::Tensor& t : ts) {
        t.view({-1}).copy_(buf.narrow(0, off, t.numel()));
        off += t.numel();
      }
    }
    return st;
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "reduce"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, opts.rootRank, size_, "root");
  auto comm = commFor(tensors, site.op);
  at::Tensor t = tensors[0];
  DataType dt = toDataType(site, t.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, t.scalar_type());
  int root = static_cast<int>(opts.rootRank);
  return enqueue(comm, OpType::REDUCE, site.op, tensors, opts.timeout, !opts.asyncOp, [t, dt, op, root](Communicator& c, const Deadline& dl) {
    return c.reduce(ptr(t), t.numel(), dt, op, root, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_gather"};
  checkSingle(site, inputs, "input");
  if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "output must be a list of " + std::to_string(size_) +
                                    " tensors (one per rank)");
  }
  checkSameShape(site, outputs[0], "output");
  checkSameDtype(site, outputs[0][0], inputs[0], "output", "input");
  if (outputs[0][0].numel() != inputs[0].numel()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "output tensors have " + std::to_string(outputs[0][0].numel()) +
                                    " elements but the input has " + std::to_string(inputs[0].numel()));
  }
  auto comm = commFor(inputs, site.op);
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = outputs[0];
  DataType dt = toDataType(site, in.scalar_type());
  int n = size_;
  return enqueue(comm, OpType::ALLGATHER, site.op, outs, opts.timeout, !opts.asyncOp, [in, outs, dt, n](Communicator& c, const Deadline& dl) {
    at::Tensor buf = flat(in, in.numel() * n);
    Status st = c.allGather(ptr(in), ptr(buf), in.numel(), dt, dl);
    if (st.isOk()) {
      for (int i = 0; i < n; ++i) {
        outs[i].view({-1}).copy_(buf.narrow(0, i * in.numel(), in.numel()));
      }
    }
    return st;
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_gather_into_tensor"};
  checkSingle(site, {input}, "input");
  checkSingle(site, {output}, "output");
  checkSameDtype(site, output, input, "output", "input");
  if (output.numel() != input.numel() * size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "output has " + std::to_string(output.numel()) +
                                    " elements; expected world size (" + std::to_string(size_) + ") x input (" +
                                    std::to_string(input.numel()) + ")");
  }
  auto comm = commFor({input}, site.op);
  at::Tensor in = input;
  at::Tensor out = output;
  DataType dt = toDataType(site, in.scalar_type());
  return enqueue(comm, OpType::_ALLGATHER_BASE, site.op, {out}, opts.timeout, !opts.asyncOp, [in, out, dt](Communicator& c, const Deadline& dl) {
    return c.allGather(ptr(in), ptr(out), in.numel(), dt, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                 std::vector<at::Tensor>& inputs,
                                                                                 const c10d::AllgatherOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_gather_into_tensor_coalesced"};
  checkTensors(site, inputs, "inputs");
  checkTensors(site, outputs, "outputs");
  if (inputs.size() != outputs.size()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "got " + std::to_string(inputs.size()) + " inputs but " +
                                    std::to_string(outputs.size()) + " outputs");
  }
  std::vector<DataType> dts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameDtype(site, outputs[i], inputs[i], "output", "input");
    if (outputs[i].numel() != inputs[i].numel() * size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "outputs[" + std::to_string(i) + "] must have world size x " +
                                      "inputs[" + std::to_string(i) + "] elements");
    }
    dts.push_back(toDataType(site, inputs[i].scalar_type()));
  }
  auto comm = commFor(inputs, site.op);
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return enqueue(comm, OpType::COALESCED, site.op, outs, opts.timeout, !opts.asyncOp, [ins, outs, dts](Communicator& c, const Deadline& dl) {
    for (size_t i = 0; i < ins.size(); ++i) {
      Status st = c.allGather(ptr(ins[i]), ptr(outs[i]), ins[i].numel(), dts[i], dl);
      if (!st.isOk()) {
        return st;
      }
    }
    return Status::ok();
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "gather"};
  checkSingle(site, inputs, "input");
  checkRank(site, opts.rootRank, size_, "root");
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "the root needs a gather_list of " + std::to_string(size_) +
                                      " tensors");
    }
    checkSameShape(site, outputs[0], "gather_list");
    checkSameDtype(site, outputs[0][0], inputs[0], "gather_list", "input");
    if (outputs[0][0].numel() != inputs[0].numel()) {
      C10_THROW_ERROR(ValueError, site.prefix() + "gather_list tensors must have as many elements as the input");
    }
    outs = outputs[0];
  } else if (!outputs.empty() && !outputs[0].empty()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "only the root (rank " + std::to_string(root) +
                                    ") may pass a gather_list");
  }
  auto comm = commFor(inputs, site.op);
  at::Tensor in = inputs[0];
  DataType dt = toDataType(site, in.scalar_type());
  int n = size_;
  return enqueue(comm, OpType::GATHER, site.op, outs, opts.timeout, !opts.asyncOp, [in, outs, dt, root, n](Communicator& c, const Deadline& dl) {
    at::Tensor buf = outs.empty() ? at::Tensor() : flat(in, in.numel() * n);
    Status st = c.gather(ptr(in), buf.defined() ? ptr(buf) : nullptr, in.numel(), dt, root, dl);
    if (st.isOk()) {
      for (size_t i = 0; i < outs.size(); ++i) {
        outs[i].view({-1}).copy_(buf.narrow(0, static_cast<int64_t>(i) * in.numel(), in.numel()));
      }
    }
    return st;
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "scatter"};
  checkSingle(site, outputs, "output");
  checkRank(site, opts.rootRank, size_, "root");
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "the root needs a scatter_list of " + std::to_string(size_) +
                                      " tensors");
    }
    checkSameShape(site, inputs[0], "scatter_list");
    checkSameDtype(site, inputs[0][0], outputs[0], "scatter_list", "output");
    if (inputs[0][0].numel() != outputs[0].numel()) {
      C10_THROW_ERROR(ValueError, site.prefix() + "scatter_list tensors must have as many elements as the output");
    }
    ins = inputs[0];
  } else if (!inputs.empty() && !inputs[0].empty()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "only the root (rank " + std::to_string(root) +
                                    ") may pass a scatter_list");
  }
  auto comm = commFor(outputs, site.op);
  at::Tensor out = outputs[0];
  DataType dt = toDataType(site, out.scalar_type());
  return enqueue(comm, OpType::SCATTER, site.op, {out}, opts.timeout, !opts.asyncOp, [ins, out, dt, root](Communicator& c, const Deadline& dl) {
    at::Tensor buf;
    if (!ins.empty()) {
      std::vector<at::Tensor> views;
      for (const at::Tensor& t : ins) {
        views.push_back(t.reshape({-1}));
      }
      buf = at::cat(views);
    }
    return c.scatter(buf.defined() ? ptr(buf) : nullptr, ptr(out), out.numel(), dt, root, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "reduce_scatter"};
  checkSingle(site, outputs, "output");
  if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "input must be a list of " + std::to_string(size_) +
                                    " tensors (one per rank)");
  }
  checkSameShape(site, inputs[0], "input");
  checkSameDtype(site, outputs[0], inputs[0][0], "output", "input");
  if (inputs[0][0].numel() != outputs[0].numel()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "input tensors must have as many elements as the output");
  }
  auto comm = commFor(outputs, site.op);
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins = inputs[0];
  DataType dt = toDataType(site, out.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, out.scalar_type());
  return enqueue(comm, OpType::REDUCE_SCATTER, site.op, {out}, opts.timeout, !opts.asyncOp, [ins, out, dt, op](Communicator& c, const Deadline& dl) {
    std::vector<at::Tensor> views;
    for (const at::Tensor& t : ins) {
      views.push_back(t.reshape({-1}));
    }
    at::Tensor buf = at::cat(views);
    return c.reduceScatter(ptr(buf), ptr(out), out.numel(), dt, op, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "reduce_scatter_tensor"};
  checkSingle(site, {input}, "input");
  checkSingle(site, {output}, "output");
  checkSameDtype(site, output, input, "output", "input");
  if (input.numel() != output.numel() * size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "input has " + std::to_string(input.numel()) +
                                    " elements; expected world size (" + std::to_string(size_) + ") x output (" +
                                    std::to_string(output.numel()) + ")");
  }
  auto comm = commFor({input}, site.op);
  at::Tensor in = input;
  at::Tensor out = output;
  DataType dt = toDataType(site, in.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, in.scalar_type());
  return enqueue(comm, OpType::_REDUCE_SCATTER_BASE, site.op, {out}, opts.timeout, !opts.asyncOp,
                 [in, out, dt, op](Communicator& c, const Deadline& dl) {
                   return c.reduceScatter(ptr(in), ptr(out), out.numel(), dt, op, dl);
                 });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "reduce_scatter_tensor_coalesced"};
  checkTensors(site, inputs, "inputs");
  checkTensors(site, outputs, "outputs");
  if (inputs.size() != outputs.size()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "got " + std::to_string(inputs.size()) + " inputs but " +
                                    std::to_string(outputs.size()) + " outputs");
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameDtype(site, outputs[i], inputs[i], "output", "input");
    if (inputs[i].numel() != outputs[i].numel() * size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "inputs[" + std::to_string(i) + "] must have world size x " +
                                      "outputs[" + std::to_string(i) + "] elements");
    }
  }
  auto comm = commFor(inputs, site.op);
  DataType dt = toDataType(site, inputs[0].scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, inputs[0].scalar_type());
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return enqueue(comm, OpType::COALESCED, site.op, outs, opts.timeout, !opts.asyncOp, [ins, outs, dt, op](Communicator& c, const Deadline& dl) {
    for (size_t i = 0; i < ins.size(); ++i) {
      Status st = c.reduceScatter(ptr(ins[i]), ptr(outs[i]), outs[i].numel(), dt, op, dl);
      if (!st.isOk()) {
        return st;
      }
    }
    return Status::ok();
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& outputSplitSizes,
                                                               std::vector<int64_t>& inputSplitSizes,
                                                               const c10d::AllToAllOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_to_all_single"};
  checkSingle(site, {input}, "input");
  checkSingle(site, {output}, "output");
  checkSameDtype(site, output, input, "output", "input");
  auto layout = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what,
                    std::vector<size_t>* counts, std::vector<size_t>* displs) {
    int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
    std::vector<int64_t> s = splits;
    if (s.empty()) {
      if (rows % size_ != 0) {
        C10_THROW_ERROR(ValueError, site.prefix() + what + " has " + std::to_string(rows) +
                                        " rows, which the world size (" + std::to_string(size_) +
                                        ") does not divide; pass split sizes");
      }
      s.assign(size_, rows / size_);
    }
    if (static_cast<int>(s.size()) != size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + what + " split sizes need " + std::to_string(size_) +
                                      " entries, got " + std::to_string(s.size()));
    }
    int64_t sum = 0;
    for (int64_t v : s) {
      if (v < 0) {
        C10_THROW_ERROR(ValueError, site.prefix() + what + " split sizes must not be negative");
      }
      displs->push_back(static_cast<size_t>(sum * rowElems));
      counts->push_back(static_cast<size_t>(v * rowElems));
      sum += v;
    }
    if (sum != rows) {
      C10_THROW_ERROR(ValueError, site.prefix() + what + " split sizes add up to " + std::to_string(sum) +
                                      " but its first dimension is " + std::to_string(rows));
    }
  };
  std::vector<size_t> sc, sd, rc, rd;
  layout(input, inputSplitSizes, "input", &sc, &sd);
  layout(output, outputSplitSizes, "output", &rc, &rd);
  auto comm = commFor({input}, site.op);
  at::Tensor in = input;
  at::Tensor out = output;
  DataType dt = toDataType(site, in.scalar_type());
  return enqueue(comm, OpType::ALLTOALL_BASE, site.op, {out}, opts.timeout, !opts.asyncOp,
                 [in, out, dt, sc, sd, rc, rd](Communicator& c, const Deadline& dl) {
                   return c.allToAll(ptr(in), sc, sd, ptr(out), rc, rd, dt, dl);
                 });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_to_all"};
  checkTensors(site, inputs, "input");
  checkTensors(site, outputs, "output");
  if (static_cast<int>(inputs.size()) != size_ || static_cast<int>(outputs.size()) != size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "input and output must be lists of " + std::to_string(size_) +
                                    " tensors (one per rank)");
  }
  checkSameDtype(site, outputs[0], inputs[0], "output", "input");
  auto comm = commFor(inputs, site.op);
  std::vector<size_t> sc, sd, rc, rd;
  size_t so = 0;
  size_t ro = 0;
  for (int i = 0; i < size_; ++i) {
    sc.push_back(inputs[i].numel());
    sd.push_back(so);
    so += inputs[i].numel();
    rc.push_back(outputs[i].numel());
    rd.push_back(ro);
    ro += outputs[i].numel();
  }
  DataType dt = toDataType(site, inputs[0].scalar_type());
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  int64_t total = static_cast<int64_t>(ro);
  return enqueue(comm, OpType::ALLTOALL, site.op, outs, opts.timeout, !opts.asyncOp,
                 [ins, outs, dt, sc, sd, rc, rd, total](Communicator& c, const Deadline& dl) {
                   std::vector<at::Tensor> views;
                   for (const at::Tensor& t : ins) {
                     views.push_back(t.reshape({-1}));
                   }
                   at::Tensor sendBuf = at::cat(views);
                   at::Tensor recvBuf = flat(outs[0], total);
                   Status st = c.allToAll(ptr(sendBuf), sc, sd, ptr(recvBuf), rc, rd, dt, dl);
                   if (st.isOk()) {
                     for (size_t i = 0; i < outs.size(); ++i) {
                       outs[i].view({-1}).copy_(recvBuf.narrow(0, rd[i], rc[i]));
                     }
                   }
                   return st;
                 });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "send"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, dstRank, size_, "destination rank");
  if (dstRank == rank_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "cannot send to itself");
  }
  auto comm = commFor(tensors, site.op);
  toDataType(site, tensors[0].scalar_type());
  const at::Tensor& t = tensors[0];
  return enqueueP2P(comm, OpType::SEND, site.op, t, P2POp{P2POp::Kind::kSend, dstRank, ptr(t), t.nbytes(), static_cast<uint64_t>(tag)});
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "recv"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, srcRank, size_, "source rank");
  if (srcRank == rank_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "cannot receive from itself");
  }
  auto comm = commFor(tensors, site.op);
  toDataType(site, tensors[0].scalar_type());
  const at::Tensor& t = tensors[0];
  return enqueueP2P(comm, OpType::RECV, site.op, t, P2POp{P2POp::Kind::kRecv, srcRank, ptr(t), t.nbytes(), static_cast<uint64_t>(tag)});
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "recv"};
  C10_THROW_ERROR(ValueError, site.prefix() + "receiving from any source is not supported; pass src");
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(cpu_, OpType::BARRIER, "barrier", {}, opts.timeout, !opts.asyncOp,
                 [](Communicator& c, const Deadline& dl) { return c.barrier(dl); });
}

}  // namespace resilient_comm
