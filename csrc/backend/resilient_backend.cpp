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
#include "common/check.h"
#include "transport/hccl/hccl_communicator.h"
#include "transport/nccl/nccl_communicator.h"
#include "transport/tcp/tcp_communicator.h"

namespace resilient_comm {

namespace {

using c10d::OpType;

// Aborts `comm` through the Reaper: bounded even if the transport's abort blocks.
void abortComm(const std::shared_ptr<Communicator>& comm, const std::string& why) {
  static const std::chrono::milliseconds bound(env::getInt(env::Knob::kAbortBoundMs));
  Reaper::run([comm, why] { comm->abort(why); }, bound, "abort of group '" + comm->name() + "'");
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
  std::shared_ptr<Communicator> device;
  {
    std::lock_guard<std::mutex> lock(mu_);
    device = device_;
  }
  if (device) {  // the group has carried device tensors: shrink its NCCL/HCCL communicator too
    bool deviceAfterError = afterError || !device->error().isOk();
    auto r = device->shrink(exclude, deviceAfterError, Deadline::after(timeout_));
    if (!r.isOk()) {
      CommErrorInfo info = site("shrink");
      info.code = r.status().code();
      info.cause = r.status().message();
      throw CommException(std::move(info));
    }
    std::lock_guard<std::mutex> lock(child->mu_);
    child->store_ = store_;
    child->device_ = r.take();
    child->deviceOf_ = deviceOf_;
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
  std::shared_ptr<Communicator> device;
  {
    std::lock_guard<std::mutex> lock(mu_);
    device = device_;
  }
  if (device) {
    abortComm(device, reason);
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
  if (rank_ != 0) {
    // Rank 0 judges who is missing; the others wait a little longer, so that rank 0's verdict
    // (forwarded to them in an error frame) is what every rank reports, not their own timeout.
    timeout += std::max(timeout / 4, std::chrono::milliseconds(200));
  }
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
  const bool cuda = dev.is_cuda() && opts_.backendName == "resilient_nccl";
  const bool npu = dev.type() == c10::DeviceType::PrivateUse1 && opts_.backendName == "resilient_hccl";
  if (!cuda && !npu) {
    const char* carries = opts_.backendName == "resilient_nccl"   ? "CPU and CUDA"
                          : opts_.backendName == "resilient_hccl" ? "CPU and NPU"
                                                                  : "CPU";
    C10_THROW_ERROR(ValueError, site.prefix() + "tensors on " + dev.str() + " are not supported; " +
                                    opts_.backendName + " carries " + carries + " tensors");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (device_) {
    if (dev != deviceOf_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "this group's device communicator is on " + deviceOf_.str() +
                                      ", the tensors on " + dev.str());
    }
    return device_;
  }
  Result<std::shared_ptr<Communicator>> made = npu ? makeHccl(dev) : makeNccl(dev);
  if (!made.isOk()) {
    C10_THROW_ERROR(ValueError, site.prefix() + made.status().message());
  }
  device_ = made.take();
  deviceOf_ = dev;
  return device_;
}

Result<std::shared_ptr<Communicator>> ResilientBackend::makeNccl(const at::Device& dev) {
  std::shared_ptr<nccl::NcclApi> api;
  RC_ASSIGN_OR_RETURN(api, nccl::loadNccl({}));
  std::shared_ptr<nccl::StreamOps> streams;
  RC_ASSIGN_OR_RETURN(streams, nccl::makeDeviceStreamOps("cuda", dev.index()));
  nccl::NcclOptions o{opts_.groupName, store_, "resilient_comm_nccl/" + opts_.groupName + "/", rank_, size_};
  std::shared_ptr<nccl::NcclCommunicator> comm;
  RC_ASSIGN_OR_RETURN(comm, nccl::NcclCommunicator::create(api, streams, std::move(o), Deadline::after(timeout_)));
  return std::shared_ptr<Communicator>(comm);
}

Result<std::shared_ptr<Communicator>> ResilientBackend::makeHccl(const at::Device& dev) {
  return hccl::createHcclCommunicator(store_, opts_.groupName, rank_, size_, Deadline::after(timeout_), dev.index());
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

}  // namespace resilient_comm
