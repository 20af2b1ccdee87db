// ResilientBackend's communicators: the device one, made on first use for the tensors' device
// by the device transport registered for it (comm/device_transport.h),
// and the moves that make a child group (shrink, split, grow, and a joiner's side of a grow),
// each taking the group's device communicator along. The queue, the device launch, the worker
// and the group's lifecycle are in resilient_backend.cpp; the collectives in backend_ops.cpp.
#include <c10/util/Exception.h>

#include <algorithm>

#include "backend/resilient_backend.h"
#include "backend/tensor_args.h"
#include "comm/store_util.h"
#include "common/check.h"
#include "comm/device_transport.h"
#include "transport/tcp/tcp_communicator.h"

namespace resilient_comm {

using c10d::OpType;

namespace {

std::string lowered(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

}  // namespace

std::shared_ptr<Communicator> ResilientBackend::commFor(const std::vector<at::Tensor>& tensors, const char* op) {
  checkConfigured(op);
  const at::Device dev = tensors.front().device();
  if (dev.is_cpu() && !emulate_) {
    return cpuComm();
  }
  return deviceCommFor(dev, op);
}

std::shared_ptr<Communicator> ResilientBackend::deviceCommFor(const at::Device& dev, const char* op) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, op};
  std::shared_ptr<const DeviceTransport> transport = DeviceTransports::find(opts_.backendName, dev.type());
  if (!transport) {
    C10_THROW_ERROR(ValueError, site.prefix() + "tensors on " + dev.str() + " are not supported; " +
                                    opts_.backendName + " carries " + DeviceTransports::carried(opts_.backendName) +
                                    " tensors");
  }
  auto existing = [&]() -> std::shared_ptr<Communicator> {
    if (device_ && dev != deviceOf_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "this group's device communicator is on " + deviceOf_.str() +
                                      ", the tensors on " + dev.str());
    }
    return device_;
  };
  bool reconfigured = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto d = existing()) {
      return d;
    }
    reconfigured = !configTag_.empty();
  }
  // After torch's reconfigure the members share handles, not necessarily a store: they agree
  // on the bootstrap id (NCCL's unique id, HCCL's root info) over the host communicator
  // (outside the lock: it queues a host op).
  DeviceBootstrap how;
  if (reconfigured) {
    how = bootstrapOverHost(*transport, dev, site);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (auto d = existing()) {
    return d;  // another thread made it meanwhile
  }
  Result<std::shared_ptr<Communicator>> made = makeDevice(*transport, dev, std::move(how));
  if (growFrom_) {  // not grown (a library without growth, or rank 0 built afresh): done with it
    abortComm(growFrom_, "superseded by a device communicator made afresh");
  }
  growFrom_.reset();
  grownFrom_ = 0;
  if (!made.isOk()) {
    C10_THROW_ERROR(ValueError, site.prefix() + made.status().message());
  }
  device_ = made.take();
  deviceOf_ = dev;
  return device_;
}

ResilientBackend::DeviceBootstrap ResilientBackend::bootstrapOverHost(const DeviceTransport& t, const at::Device& dev,
                                                                     const OpSite& site) {
  // Rank 0's verdict (1: ok; then 1: grow, 0: afresh) and the id, broadcast from rank 0, queued
  // like any host op: every member takes it at the same point of its program (its first
  // device op). On a grow rank 0 is an old member: the id is its communicator's grow id where
  // the library grows one in place; elsewhere a fresh id makes a fresh world.
  auto buf = std::make_shared<std::vector<uint8_t>>(2 + t.idBytes, 0);
  std::string why;
  if (rank_ == 0) {
    std::shared_ptr<Communicator> from;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (grownFrom_ > 0 && deviceOf_ == dev) {
        from = growFrom_;
      }
    }
    const bool grow = t.growth && from && t.growth->native(*from);
    Result<std::vector<uint8_t>> id = grow ? t.growth->id(*from, Deadline::after(timeout_)) : t.makeId(dev);
    if (id.isOk() && id.value().size() == t.idBytes) {
      std::copy(id.value().begin(), id.value().end(), buf->begin() + 2);
      (*buf)[0] = 1;
      (*buf)[1] = grow ? 1 : 0;
    } else if (id.isOk()) {
      why = "it has " + std::to_string(id.value().size()) + " bytes, not " + std::to_string(t.idBytes);
    }
    if (!id.isOk()) {
      why = id.status().message();
    }
  }
  auto work = enqueue(cpuComm(), OpType::BROADCAST, "device bootstrap", {}, timeout_, /*mayRunInline=*/true,
                      [buf](Communicator& c, const Deadline& dl) {
                        return c.broadcast(buf->data(), buf->size(), DataType::kUInt8, 0, dl);
                      });
  work->wait(kNoTimeout);  // raises the host op's typed error
  if ((*buf)[0] != 1) {
    C10_THROW_ERROR(ValueError, site.prefix() + "rank 0 could not make the " + t.library + " bootstrap id" +
                                    (why.empty() ? std::string() : ": " + why));
  }
  return DeviceBootstrap{(*buf)[1] == 1, std::vector<uint8_t>(buf->begin() + 2, buf->end())};
}

std::string ResilientBackend::devicePrefix(const DeviceTransport& t) const {
  return "resilient_comm_" + lowered(t.library) + "/" + opts_.groupName + "/" + configTag_;
}

// Called with mu_ held.
Result<std::shared_ptr<Communicator>> ResilientBackend::makeDevice(const DeviceTransport& t, const at::Device& dev,
                                                                   DeviceBootstrap how) {
  DeviceCommSpec spec{opts_.groupName, store_, devicePrefix(t), rank_, size_, dev, std::move(how.id)};
  const Deadline dl = Deadline::after(timeout_);
  if (!how.grow) {
    return t.create(std::move(spec), dl);
  }
  if (!t.growth) {
    return Status(StatusCode::kInternal, "rank 0 grows the device communicator, and " + t.library + " has no grow");
  }
  if (rank_ < grownFrom_) {  // an old member: its communicator grows
    if (!growFrom_ || deviceOf_ != dev) {
      return Status(StatusCode::kInternal, "rank 0 grows the device communicator, and this old member has none on " +
                                               dev.str() + " to grow");
    }
    Result<std::shared_ptr<Communicator>> grown = t.growth->withId(*growFrom_, std::move(spec), dl);
    if (grown.isOk()) {
      lastPlan_ += ",device:grow";
    }
    // Dropped, not aborted: the child's bootstrap runs through the parent's, and the child's
    // start holds it until the grow completed; then it is finalized (NCCL's guide).
    growFrom_.reset();
    return grown;
  }
  Result<std::shared_ptr<Communicator>> joined = t.growth->join(std::move(spec), dl);  // a newcomer
  if (joined.isOk()) {
    lastPlan_ += ",device:grow";
  }
  return joined;
}

c10::intrusive_ptr<ResilientBackend> ResilientBackend::join(const c10::intrusive_ptr<c10d::Store>& store,
                                                            const std::string& joinKey, int rank, int newSize,
                                                            int existingSize, BackendOptions opts,
                                                            std::optional<at::Device> device) {
  if (existingSize < 1 || rank < existingSize || rank >= newSize) {
    C10_THROW_ERROR(ValueError, "join: rank " + std::to_string(rank) + " must be in [" + std::to_string(existingSize) +
                                    ", " + std::to_string(newSize) + ") (the ranks after the existing members)");
  }
  const Deadline dl = Deadline::after(opts.timeout);
  tcp::TcpOptions t;
  t.name = opts.groupName;
  t.store = store;
  t.prefix = joinKey;
  t.rank = rank;
  t.size = newSize;
  auto comm = tcp::TcpCommunicator::join(std::move(t), existingSize, dl);
  // The members' rank 0 says which backend the group is and whether its device communicator
  // grows with it ("<backend> nccl") or is made afresh on first use ("<backend> none").
  AbortToken never;
  auto said = storeFetch(store, {joinKey + kGrowDeviceKey}, dl, never);
  if (!said.isOk()) {
    comm->abort("join: " + said.status().message());
    C10_THROW_ERROR(DistBackendError, "join of '" + opts.groupName + "' as rank " + std::to_string(rank) + ": " +
                                          said.status().message());
  }
  const std::string& value = said.value()[0];
  const size_t space = value.find(' ');
  const std::string backendName = value.substr(0, space);
  const std::string grows = space == std::string::npos ? "" : value.substr(space + 1);
  if ((backendName != "resilient_tcp" && !DeviceTransports::serves(backendName)) || grows.empty()) {
    comm->abort("join: malformed store value");
    C10_THROW_ERROR(ValueError, "join of '" + opts.groupName + "': store key '" + joinKey + kGrowDeviceKey +
                                    "' holds '" + value + "', not '<backend> <library>|none' (a stray writer?)");
  }
  opts.backendName = backendName;
  auto joined = c10::make_intrusive<ResilientBackend>(std::move(comm), std::move(opts));
  joined->store_ = store;  // a device communicator made later bootstraps through it
  if (grows != "none") {  // the members grow their device communicator: join it
    auto refuse = [&](const std::string& why) {
      joined->cpu_->abort("join: " + why);
      C10_THROW_ERROR(ValueError, "join of '" + joined->opts_.groupName + "': " + why);
    };
    at::Device dev = at::kCPU;
    std::shared_ptr<const DeviceTransport> t;
    if (joined->emulate_) {
      t = DeviceTransports::find(backendName, c10::DeviceType::CPU);
    } else {
      // The members' library names the device type: the entry of this backend that grows with it.
      for (const auto& entry : DeviceTransports::all()) {
        if (entry->backend == backendName && entry->deviceType != c10::DeviceType::CPU && entry->growth &&
            lowered(entry->library) == grows) {
          t = DeviceTransports::find(backendName, entry->deviceType);  // (enabled)
        }
      }
      if (t && (!device || device->type() != t->deviceType)) {
        refuse("the members' group carries " + t->deviceName + " tensors, so the joiner must name its " +
               t->deviceName + " device (device=" + (device ? device->str() : std::string("None")) + ")");
      }
      if (t) {
        dev = *device;
      }
    }
    if (!t || !t->growth || lowered(t->library) != grows) {
      refuse("the members grow a '" + grows + "' device communicator, which " + backendName +
             " has no growing transport for here");
    }
    DeviceCommSpec spec{joined->opts_.groupName, store, joinKey + kGrowDevicePrefix, rank, newSize, dev, {}};
    Result<std::shared_ptr<Communicator>> made = t->growth->join(std::move(spec), dl);
    if (!made.isOk()) {
      refuse(made.status().message());
    }
    std::lock_guard<std::mutex> lock(joined->mu_);
    joined->device_ = made.take();
    joined->deviceOf_ = dev;
  }
  return joined;
}

c10::intrusive_ptr<ResilientBackend> ResilientBackend::adopt(Result<std::shared_ptr<Communicator>> r, const char* move,
                                                             const std::string& name) {
  if (!r.isOk()) {
    if (r.status().code() == StatusCode::kInvalidArgument) {
      C10_THROW_ERROR(ValueError, opts_.backendName + " " + move + " of group '" + opts_.groupName + "' on rank " +
                                      std::to_string(rank_) + ": " + r.status().message());
    }
    throwMoveError(move, r.status());
  }
  if (!r.value()) {
    return {};
  }
  BackendOptions o = opts_;
  o.groupName = name;
  o.timeout = timeout_;
  auto child = c10::make_intrusive<ResilientBackend>(r.take(), std::move(o));
  child->store_ = store_;  // a later CUDA communicator bootstraps through the same store
  return child;
}

void ResilientBackend::throwMoveError(const char* move, const Status& st) const {
  CommErrorInfo info = site(move);
  info.code = st.code();
  info.cause = st.message();
  throw CommException(std::move(info));
}

std::pair<std::shared_ptr<Communicator>, at::Device> ResilientBackend::deviceSnapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {device_, deviceOf_};
}

void ResilientBackend::handDevice(ResilientBackend* child, Result<std::shared_ptr<Communicator>> r,
                                  const at::Device& dev, const char* move) const {
  if (!r.isOk()) {
    throwMoveError(move, r.status());
  }
  if (child == nullptr || !r.value()) {
    return;  // this rank is in no group of the move (a split's negative color)
  }
  std::lock_guard<std::mutex> lock(child->mu_);
  child->device_ = r.take();
  child->deviceOf_ = dev;
}

c10::intrusive_ptr<c10d::Backend> ResilientBackend::shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                           const c10::intrusive_ptr<Options>& optsOverride) {
  std::vector<int> exclude(ranksToExclude.begin(), ranksToExclude.end());
  checkConfigured("shrink");
  auto host = cpuComm();
  bool afterError = (shrinkFlags & 1) != 0 || !host->error().isOk();
  auto child = adopt(host->shrink(exclude, afterError, Deadline::after(timeout_)), "shrink",
                     opts_.groupName + ":shrunk");
  auto [device, dev] = deviceSnapshot();
  if (device) {  // the group has carried device tensors: shrink its NCCL/HCCL communicator too
    bool deviceAfterError = afterError || !device->error().isOk();
    handDevice(child.get(), device->shrink(exclude, deviceAfterError, Deadline::after(timeout_)), dev, "shrink");
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
  checkConfigured("split");
  auto work = enqueue(cpuComm(), OpType::UNKNOWN, "split", {}, timeout_, false, [out, color, key](Communicator& c, const Deadline& dl) {
    *out = c.split(color, key, dl);
    return out->isOk() ? Status::ok() : out->status();
  });
  work->wait(kNoTimeout);  // raises the split's failure; on success `out` is complete
  // Every member splits in the same order, so the count names this split alike on all of them;
  // the color keeps the groups of one split apart (a device communicator made later bootstraps
  // under the name).
  const int nth = splits_++;
  auto child = adopt(std::move(*out), "split",
                     opts_.groupName + ":split" + std::to_string(nth) + ":" + std::to_string(std::max(color, -1)));
  auto [device, dev] = deviceSnapshot();
  if (device) {  // every member takes part in the device split, colorless ones included
    handDevice(child.get(), device->split(color, key, Deadline::after(timeout_)), dev, "split");
  }
  return child;
}

c10::intrusive_ptr<ResilientBackend> ResilientBackend::grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                                            const std::string& joinKey) {
  const Deadline dl = Deadline::after(timeout_);
  checkConfigured("grow");
  auto child = adopt(cpuComm()->grow(newSize, store, joinKey, dl), "grow", kGrownPrefix + joinKey);
  child->store_ = store;  // the joiners know this store, not the one the group was made with
  auto [device, dev] = deviceSnapshot();
  // A device communicator whose transport grows (NCCL: ncclCommGrow, or a fresh init where the
  // library has none) grows with the group; another (HCCL) is left behind and the grown group
  // makes one on first use.
  std::shared_ptr<const DeviceTransport> t = device ? DeviceTransports::find(opts_.backendName, dev.type()) : nullptr;
  const bool grows = t && t->growth;
  if (rank_ == 0) {
    Status st = storeSet(store, joinKey + kGrowDeviceKey, opts_.backendName + " " + (grows ? lowered(t->library) : "none"));
    if (!st.isOk()) {
      throwMoveError("grow", st);
    }
  }
  if (grows) {
    handDevice(child.get(), device->grow(newSize, store, joinKey + kGrowDevicePrefix, dl), dev, "grow");
  }
  return child;
}

}  // namespace resilient_comm
