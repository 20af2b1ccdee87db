// torch's fault-tolerance API on ResilientBackend (torch >= 2.14: C10D_BACKEND_HAS_RECONFIGURE,
// C10D_BACKEND_HAS_HOOKS): get_reconfigure_handle(), reconfigure(), abort hooks.
//
// A reconfigure replaces the group's communicators in place (torch keeps the ProcessGroup
// object; rank and size follow the backend's):
// 1. The handles are checked and the plan made (reconfigure_plan.h): bad input raises a
//    ValueError and leaves the group as it was, old communicator included.
// 2. The old communicator is superseded: queued ops fail at once (CommAbortedError), a running
//    one is stopped by aborting it, the device communicator is aborted and dropped (a later
//    device op makes one afresh).
// 3. The new host communicator is made without blocking: a shrink of the one this process last
//    built (connections resynchronised, not redialled), or a fresh one over the handles'
//    listeners. It replaces the old at once, so ops issued from now on queue behind its build.
// 4. The returned Work completes when the new communicator is Ready, within the timeout (the
//    watchdog aborts it at the deadline), or fails with the typed error. A shrink that fails
//    on a member (a peer's stream cannot be resynchronised, say) fails on its peers too, and
//    they all build a fresh communicator in the time left (the fallback), so no member is
//    left on a different one.
#include <c10/util/Exception.h>

#include <algorithm>

#include "backend/reconfigure_plan.h"
#include "backend/resilient_backend.h"
#include "backend/tensor_args.h"
#include "backend/unconfigured.h"
#include "common/logging.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_communicator.h"
#include "watchdog/reaper.h"

namespace resilient_comm {

void AbortHooks::add(int64_t id, std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_[id] = std::move(hook);
}

void AbortHooks::remove(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_.erase(id);
}

void AbortHooks::run(const std::string& why) {
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, hook] : hooks_) {
      hooks.push_back(hook);
    }
  }
  for (auto& hook : hooks) {
    try {
      hook();
    } catch (const std::exception& e) {
      RC_LOG(kWarning, "an abort hook raised (" << e.what() << "); the abort goes on: " << why);
    } catch (...) {
      RC_LOG(kWarning, "an abort hook raised; the abort goes on: " << why);
    }
  }
}

void ResilientBackend::checkConfigured(const char* op) const {
  if (!configured_.load()) {
    OpSite at{opts_.backendName, opts_.groupName, rank_, op};
    TORCH_CHECK(false, at.prefix() + unconfiguredMessage(opts_.groupName));
  }
}

std::string ResilientBackend::lastReconfigure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lastPlan_;
}

#ifdef C10D_BACKEND_HAS_RECONFIGURE

std::shared_ptr<tcp::TcpCommunicator> ResilientBackend::refreshBase() const {
  auto host = std::dynamic_pointer_cast<tcp::TcpCommunicator>(cpuComm());
  if (host && host != base_ && host->everBuilt()) {
    const std::vector<std::string>& book = host->addressBook();
    for (auto& [identity, since] : replaced_) {
      since.insert(book.begin(), book.end());
    }
    if (base_) {
      replaced_[base_->identity()].insert(book.begin(), book.end());
    }
    base_ = host;
  }
  return base_;
}

void ResilientBackend::fixHandle() const {
  if (!handle_.empty()) {
    return;
  }
  auto base = refreshBase();
  std::string addr;
  std::shared_ptr<tcp::Listener> listener;
  if (base) {
    addr = base->addressBook()[base->rank()];
    listener = base->listener();
  } else {
    if (!ownListener_) {
      int port = 0;
      Result<tcp::Socket> sock = tcp::listenPublished(&port);
      if (!sock.isOk()) {
        throwMoveError("get_reconfigure_handle", sock.status());
      }
      ownListener_ = std::make_shared<tcp::Listener>(sock.take());
      ownAddr_ = tcp::publishedHost() + ":" + std::to_string(port);
    }
    addr = ownAddr_;
    listener = ownListener_;
  }
  const uint64_t identity = base ? base->identity() : 0;
  const int rank = base ? base->rank() : rank_;
  const int size = base ? base->size() : size_;
  handle_ = formatReconfigureHandle(addr, identity, rank, size, tcp::JobKey::fromEnv());
  handleBase_ = base;
  handleListener_ = listener;
}

std::string ResilientBackend::reconfigureHandle() const {
  std::lock_guard<std::mutex> rc(rcMu_);
  fixHandle();
  return handle_;
}

c10d::ReconfigureHandle ResilientBackend::get_reconfigure_handle() const {
  return reconfigureHandle();
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::reconfigure(const c10d::ReconfigureOptions& opts) {
  std::vector<std::string> handles;
  bool ordered = true;
  if (const auto* list = std::get_if<std::vector<c10d::ReconfigureHandle>>(&opts.handles)) {
    handles = *list;
  } else {
    const auto& set = std::get<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles);
    handles.assign(set.begin(), set.end());
    ordered = false;
  }
  std::chrono::milliseconds timeout = opts.timeout.value_or(std::chrono::milliseconds(-1));
  auto path = opts.hints.find("resilient_comm.path");
  bool forceFresh = false;
  if (path != opts.hints.end()) {
    if (path->second != "fresh" && path->second != "auto") {
      OpSite at{opts_.backendName, opts_.groupName, rank_, "reconfigure"};
      C10_THROW_ERROR(ValueError, at.prefix() + "hint resilient_comm.path='" + path->second +
                                      "': expected 'auto' (shrink where the handles allow it) or 'fresh'");
    }
    forceFresh = path->second == "fresh";
  }
  return reconfigureWith(opts.uuid, handles, ordered, timeout, forceFresh);
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::reconfigureWith(int64_t uuid, const std::vector<std::string>& handles,
                                                                 bool ordered, std::chrono::milliseconds timeout,
                                                                 bool forceFresh) {
  std::unique_lock<std::mutex> rc(rcMu_);
  OpSite at{opts_.backendName, opts_.groupName, rank_, "reconfigure"};
  if (timeout.count() < 0) {
    std::lock_guard<std::mutex> lock(mu_);
    timeout = timeout_;
  }
  const Deadline dl = Deadline::after(timeout);
  if (uuids_.count(uuid) != 0) {
    C10_THROW_ERROR(ValueError, at.prefix() + "uuid " + std::to_string(uuid) +
                                    " was already used on this group; every reconfigure needs a fresh uuid");
  }
  fixHandle();
  const tcp::JobKey key = tcp::JobKey::fromEnv();
  Result<ReconfigurePlan> planned = planReconfigure(handles, ordered, handle_, uuid, replaced_, key);
  if (!planned.isOk()) {
    C10_THROW_ERROR(ValueError, at.prefix() + planned.status().message());
  }
  ReconfigurePlan plan = planned.take();
  if (forceFresh) {
    plan.kind = ReconfigurePlan::Kind::kFresh;
  }
  uuids_.insert(uuid);
  const std::string why = "superseded by reconfigure (uuid " + std::to_string(uuid) + ")";

  std::shared_ptr<Communicator> old = cpuComm();
  supersede(old, why);

  tcp::TcpOptions o;
  o.name = opts_.groupName;
  o.rank = plan.rank;
  o.size = static_cast<int>(plan.members.size());
  std::vector<std::string> addrs;
  for (const ReconfigureHandle& h : plan.members) {
    addrs.push_back(h.addr);
  }
  std::shared_ptr<tcp::Listener> listener = handleListener_;
  auto fresh = [o, listener, addrs](const std::string& epoch, const Deadline& d) {
    return tcp::TcpCommunicator::fromAddressBook(o, listener, addrs, epoch, d);
  };
  // [Note: a healthy communicator ends once its successor is Ready]
  // A member may still be finishing its last op on a healthy old communicator (its peers
  // returned from theirs first): ending it now would fail that op. The new communicator is
  // Ready only once every member has connected to it, so every member has left the old one
  // by then: a healthy old communicator is ended at that point, not before. One that failed
  // (or that a running op had to be aborted on) ends now, and a shrink reuses its
  // connections (tcp_communicator.h, [Note: shrink reuses connections]).
  const bool healthy = old == handleBase_ && old->error().isOk();
  std::shared_ptr<Communicator> next;
  if (plan.kind == ReconfigurePlan::Kind::kShrink) {
    if (old != handleBase_) {
      abortComm(old, why);  // a failed attempt since
    }
    auto r = handleBase_->shrink(plan.exclude, /*afterError=*/!healthy, dl);
    if (r.isOk()) {
      next = r.take();
    } else {
      RC_LOG(kWarning, at.prefix() << "shrink failed (" << r.status().message() << "); building afresh");
      plan.kind = ReconfigurePlan::Kind::kFresh;
    }
  }
  if (!next) {
    if (!healthy) {
      abortComm(old, why);
      if (handleBase_ && handleBase_ != old) {
        abortComm(handleBase_, why);
      }
    }
    next = fresh(plan.epoch, dl);
  }
  std::shared_ptr<Communicator> endLater = healthy ? old : nullptr;

  // The device communicator: shrunk with the host one (ncclCommShrink, revoking it first where
  // it failed); on a grow, kept to grow at its first use (ncclCommGrow, the newcomers joining:
  // deviceCommFor); else aborted and made afresh on first use under this configuration's keys.
  std::shared_ptr<Communicator> device;
  std::shared_ptr<Communicator> unusedGrow;  // a previous grow that never reached a device op
  {
    std::lock_guard<std::mutex> lock(mu_);
    device.swap(device_);
    unusedGrow.swap(growFrom_);
  }
  if (unusedGrow) {
    abortComm(unusedGrow, why);
  }
  std::shared_ptr<Communicator> nextDevice;
  std::shared_ptr<Communicator> growFrom;
  std::string devicePath;
  if (device) {
    devicePath = ",device:fresh";
    if (plan.kind == ReconfigurePlan::Kind::kGrow && device->error().isOk()) {
      growFrom = device;
      devicePath = "";  // said at the first device op, where it grows (deviceCommFor)
    }
    if (plan.kind == ReconfigurePlan::Kind::kShrink) {
      auto r = device->shrink(plan.exclude, /*afterError=*/!healthy || !device->error().isOk(), dl);
      if (r.isOk() && r.value()) {
        nextDevice = r.take();
        devicePath = ",device:shrink";
      } else {
        RC_LOG(kWarning, at.prefix() << "device shrink failed (" << r.status().message() << "); made afresh on first use");
      }
    }
    if (!nextDevice && !growFrom) {
      abortComm(device, why);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    cpu_ = next;
    device_ = nextDevice;
    growFrom_ = growFrom;
    grownFrom_ = plan.kind == ReconfigurePlan::Kind::kGrow ? plan.grownFrom : 0;
    rank_ = plan.rank;
    size_ = static_cast<int>(plan.members.size());
    lastPlan_ = planKindName(plan.kind) + devicePath;
    configTag_ = "u" + std::to_string(uuid) + "/";
  }
  configured_.store(true);
  handle_.clear();
  handleBase_.reset();
  handleListener_.reset();
  RC_LOG(kInfo, at.prefix() << "reconfigure uuid " << uuid << ": " << planKindName(plan.kind) << " to "
                            << plan.members.size() << " ranks, this one rank " << plan.rank);

  const bool shrink = plan.kind == ReconfigurePlan::Kind::kShrink;
  const std::string fallbackEpoch = plan.epoch + "fallback/";
  return push(next, c10d::OpType::UNKNOWN, "reconfigure", {}, timeout, /*mayRunInline=*/false,
              [this, shrink, fresh, fallbackEpoch, endLater, why](Communicator& c, const Deadline& d) -> Status {
                Status st = c.waitReady(d);
                if (endLater) {  // see [Note: a healthy communicator ends once its successor is Ready]
                  abortComm(endLater, why);
                }
                if (st.isOk() || !shrink || st.code() == StatusCode::kAborted || st.code() == StatusCode::kTimeout) {
                  return st;
                }
                // The shrink failed here, so it fails on the peers this rank reaches too:
                // every member builds the same fresh communicator (see the file's comment).
                RC_LOG(kWarning, "reconfigure of group '" << opts_.groupName << "': the shrink failed (" << st.message()
                                                       << "); building a fresh communicator");
                std::shared_ptr<Communicator> again = fresh(fallbackEpoch, d);
                {
                  std::lock_guard<std::mutex> lock(mu_);
                  cpu_ = again;
                  lastPlan_ = "shrink+fallback";
                }
                return again->waitReady(d);
              },
              std::nullopt);
}

#endif  // C10D_BACKEND_HAS_RECONFIGURE

void ResilientBackend::supersede(const std::shared_ptr<Communicator>& old, const std::string& why) {
  std::vector<Task> dropped;
  bool running = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Task& t : queue_) {
      dropped.push_back(std::move(t));
    }
    queue_.clear();
    for (Task& t : coalescedHost_) {
      dropped.push_back(std::move(t));
    }
    coalescedHost_.clear();
    coalescing_ = false;
    running = running_;
  }
  const Status st(StatusCode::kAborted, why + ", before it started");
  for (Task& t : dropped) {
    finishTask(t, st);
  }
  if (!running) {
    return;
  }
  // An op is running on the old membership: it fails now, not at its deadline.
  hooks_->run(why);
  abortComm(old, why);
  std::unique_lock<std::mutex> lock(mu_);
  const bool ended = cv_.wait_for(lock, Reaper::abortBound() + std::chrono::seconds(1), [this] { return !running_; });
  if (!ended) {
    lock.unlock();
    throwMoveError("reconfigure", Status(StatusCode::kInternal, "the op running on the old communicator did not end "
                                                                "after its abort; the group is unusable"));
  }
}

}  // namespace resilient_comm
