// ResilientBackend's communicators: the device one, made on first use for the tensors' device,
// and the moves that make a child group (shrink, split, grow, and a joiner's side of a grow),
// each taking the group's device communicator along. The queue, the device launch, the worker
// and the group's lifecycle are in resilient_backend.cpp; the collectives in backend_ops.cpp.
#include <c10/util/Exception.h>

#include <algorithm>

#include "backend/resilient_backend.h"
#include "backend/tensor_args.h"
#include "comm/store_util.h"
#include "common/check.h"
#include "emulation/device/emulated_device.h"
#include "transport/hccl/hccl_communicator.h"
#include "emulation/nccl/nccl_emulator.h"
#include "transport/nccl/nccl_communicator.h"
#include "transport/tcp/tcp_communicator.h"

namespace resilient_comm {

using c10d::OpType;

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
  const bool cuda = (dev.is_cuda() || (dev.is_cpu() && emulate_)) && opts_.backendName == "resilient_nccl";
  const bool npu = dev.type() == c10::DeviceType::PrivateUse1 && opts_.backendName == "resilient_hccl";
  if (!cuda && !npu) {
    const char* carries = opts_.backendName == "resilient_nccl"   ? "CPU and CUDA"
                          : opts_.backendName == "resilient_hccl" ? "CPU and NPU"
                                                                  : "CPU";
    C10_THROW_ERROR(ValueError, site.prefix() + "tensors on " + dev.str() + " are not supported; " +
                                    opts_.backendName + " carries " + carries + " tensors");
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
  // on NCCL's bootstrap id (HCCL's root info) over the host communicator (outside the lock: it
  // queues a host op).
  DeviceBootstrap how;
  if (reconfigured) {
    how = bootstrapOverHost(dev, site, npu);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (auto d = existing()) {
    return d;  // another thread made it meanwhile
  }
  Result<std::shared_ptr<Communicator>> made =
      npu ? makeHccl(dev, std::move(how.id))
          : (reconfigured ? makeNcclAfterReconfigure(dev, std::move(how)) : makeNccl(dev));
  if (growFrom_) {  // not grown (HCCL, or rank 0 built afresh): done with it
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

ResilientBackend::DeviceBootstrap ResilientBackend::bootstrapOverHost(const at::Device& dev, const OpSite& site,
                                                                     bool hccl) {
  // Rank 0's verdict (1: ok; then 1: grow, 0: afresh) and the id, broadcast from rank 0, queued
  // like any host op: every member takes it at the same point of its program (its first
  // device op). On a grow rank 0 is an old member: the id is its communicator's grow id. HCCL
  // has no grow: its root info makes a fresh world.
  const char* library = hccl ? "HCCL" : "NCCL";
  const size_t idBytes = hccl ? hccl::kHcclRootInfoBytes : sizeof(nccl::ncclUniqueId);
  auto buf = std::make_shared<std::vector<uint8_t>>(2 + idBytes, 0);
  std::string why;
  if (rank_ == 0 && hccl) {
    Result<std::vector<uint8_t>> root = hccl::makeRootInfo();
    if (root.isOk() && root.value().size() == idBytes) {
      std::copy(root.value().begin(), root.value().end(), buf->begin() + 2);
      (*buf)[0] = 1;
    }
    why = root.status().message();
  } else if (rank_ == 0) {
    std::shared_ptr<nccl::NcclCommunicator> from;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (grownFrom_ > 0 && deviceOf_ == dev) {
        from = std::dynamic_pointer_cast<nccl::NcclCommunicator>(growFrom_);
      }
    }
    Status st;
    if (from && from->nativeGrow()) {
      Result<std::vector<uint8_t>> id = from->growId(Deadline::after(timeout_));
      st = id.status();
      if (id.isOk() && id.value().size() == sizeof(nccl::ncclUniqueId)) {
        std::copy(id.value().begin(), id.value().end(), buf->begin() + 2);
        (*buf)[1] = 1;
      }
    } else {
      Result<NcclRuntime> rt = ncclRuntime(dev);
      nccl::ncclResult_t r = rt.isOk() ? rt.value().api->getUniqueId(
                                             reinterpret_cast<nccl::ncclUniqueId*>(buf->data() + 2))
                                       : nccl::ncclInternalError;
      st = !rt.isOk() ? rt.status()
           : r == nccl::ncclSuccess
               ? Status::ok()
               : Status(StatusCode::kInternal, "ncclGetUniqueId failed (" + std::to_string(static_cast<int>(r)) + ")");
    }
    (*buf)[0] = st.isOk() ? 1 : 0;
    why = st.message();
  }
  auto work = enqueue(cpuComm(), OpType::BROADCAST, "device bootstrap", {}, timeout_, /*mayRunInline=*/true,
                      [buf](Communicator& c, const Deadline& dl) {
                        return c.broadcast(buf->data(), buf->size(), DataType::kUInt8, 0, dl);
                      });
  work->wait(kNoTimeout);  // raises the host op's typed error
  if ((*buf)[0] != 1) {
    C10_THROW_ERROR(ValueError, site.prefix() + "rank 0 could not make the " + library + " bootstrap id" +
                                    (why.empty() ? std::string() : ": " + why));
  }
  return DeviceBootstrap{(*buf)[1] == 1, std::vector<uint8_t>(buf->begin() + 2, buf->end())};
}

// Called with mu_ held.
Result<std::shared_ptr<Communicator>> ResilientBackend::makeNcclAfterReconfigure(const at::Device& dev,
                                                                                DeviceBootstrap how) {
  if (!how.grow) {
    return makeNccl(dev, std::move(how.id));
  }
  const std::string prefix = "resilient_comm_nccl/" + opts_.groupName + "/" + configTag_;
  if (rank_ < grownFrom_) {  // an old member: its communicator grows
    auto from = std::dynamic_pointer_cast<nccl::NcclCommunicator>(growFrom_);
    if (!from || deviceOf_ != dev) {
      return Status(StatusCode::kInternal, "rank 0 grows the device communicator, and this old member has none on " +
                                               dev.str() + " to grow");
    }
    Result<std::shared_ptr<Communicator>> grown = from->growWithId(size_, how.id, prefix, store_, Deadline::after(timeout_));
    if (grown.isOk()) {
      lastPlan_ += ",device:grow";
    }
    // Dropped, not aborted: the child's bootstrap runs through the parent's, and the child's
    // start holds it until the grow completed; then it is finalized (NCCL's guide).
    growFrom_.reset();
    return grown;
  }
  NcclRuntime rt;  // a newcomer: it joins the grow
  RC_ASSIGN_OR_RETURN(rt, ncclRuntime(dev));
  nccl::NcclOptions o{opts_.groupName, store_, prefix, rank_, size_, std::move(how.id)};
  std::shared_ptr<nccl::NcclCommunicator> comm;
  RC_ASSIGN_OR_RETURN(comm, nccl::NcclCommunicator::join(rt.api, rt.streams, std::move(o), Deadline::after(timeout_)));
  lastPlan_ += ",device:grow";
  return std::shared_ptr<Communicator>(comm);
}

Result<ResilientBackend::NcclRuntime> ResilientBackend::ncclRuntime(const at::Device& dev) {
  NcclRuntime rt;
  if (dev.is_cpu()) {  // emulating: CPU tensors on the NCCL code path
    rt.api = nccl::processEmulator();
    rt.streams = device::emu::makeEmulatedStreamOps(0);
  } else {
    RC_ASSIGN_OR_RETURN(rt.api, nccl::loadNccl({}));
    RC_ASSIGN_OR_RETURN(rt.streams, device::makeDeviceStreamOps("cuda", dev.index()));
  }
  return rt;
}

Result<std::shared_ptr<Communicator>> ResilientBackend::makeNccl(const at::Device& dev, std::vector<uint8_t> id) {
  NcclRuntime rt;
  RC_ASSIGN_OR_RETURN(rt, ncclRuntime(dev));
  nccl::NcclOptions o{opts_.groupName, store_, "resilient_comm_nccl/" + opts_.groupName + "/" + configTag_, rank_,
                      size_, std::move(id)};
  std::shared_ptr<nccl::NcclCommunicator> comm;
  RC_ASSIGN_OR_RETURN(comm, nccl::NcclCommunicator::create(rt.api, rt.streams, std::move(o), Deadline::after(timeout_)));
  return std::shared_ptr<Communicator>(comm);
}

Result<std::shared_ptr<Communicator>> ResilientBackend::makeHccl(const at::Device& dev, std::vector<uint8_t> rootInfo) {
  // After a reconfigure its bootstrap keys are the configuration's (configTag_), as NCCL's.
  const std::string name = configTag_.empty() ? opts_.groupName : opts_.groupName + "/" + configTag_.substr(0, configTag_.size() - 1);
  return hccl::createHcclCommunicator(store_, name, rank_, size_, Deadline::after(timeout_), dev.index(),
                                      std::move(rootInfo));
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
  const std::string kind = space == std::string::npos ? "" : value.substr(space + 1);
  if ((backendName != "resilient_nccl" && backendName != "resilient_tcp" && backendName != "resilient_hccl") ||
      (kind != "nccl" && kind != "none")) {
    comm->abort("join: malformed store value");
    C10_THROW_ERROR(ValueError, "join of '" + opts.groupName + "': store key '" + joinKey + kGrowDeviceKey +
                                    "' holds '" + value + "', not '<backend> nccl|none' (a stray writer?)");
  }
  opts.backendName = backendName;
  auto joined = c10::make_intrusive<ResilientBackend>(std::move(comm), std::move(opts));
  joined->store_ = store;  // a device communicator made later bootstraps through it
  if (kind == "nccl") {  // the members grow their NCCL communicator: join it
    at::Device dev = at::kCPU;
    if (!joined->emulate_) {
      if (!device || !device->is_cuda()) {
        joined->cpu_->abort("join: no CUDA device");
        C10_THROW_ERROR(ValueError, "join of '" + joined->opts_.groupName + "': the members' group carries CUDA "
                                    "tensors, so the joiner must name its CUDA device (device=" +
                                    (device ? device->str() : std::string("None")) + ")");
      }
      dev = *device;
    }
    auto made = [&]() -> Result<std::shared_ptr<Communicator>> {
      NcclRuntime rt;
      RC_ASSIGN_OR_RETURN(rt, ncclRuntime(dev));
      nccl::NcclOptions o{joined->opts_.groupName, store, joinKey + kGrowNcclPrefix, rank, newSize};
      std::shared_ptr<nccl::NcclCommunicator> c;
      RC_ASSIGN_OR_RETURN(c, nccl::NcclCommunicator::join(rt.api, rt.streams, std::move(o), dl));
      return std::shared_ptr<Communicator>(c);
    }();
    if (!made.isOk()) {
      joined->cpu_->abort("join: " + made.status().message());
      C10_THROW_ERROR(ValueError, "join of '" + joined->opts_.groupName + "': " + made.status().message());
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
  // An NCCL communicator grows with the group (ncclCommGrow, or a fresh init where the library
  // has none); an HCCL one is left behind and the grown group makes one on first use.
  const bool nccl = device && dev.type() != c10::DeviceType::PrivateUse1;
  if (rank_ == 0) {
    Status st = storeSet(store, joinKey + kGrowDeviceKey, opts_.backendName + (nccl ? " nccl" : " none"));
    if (!st.isOk()) {
      throwMoveError("grow", st);
    }
  }
  if (nccl) {
    handDevice(child.get(), device->grow(newSize, store, joinKey + kGrowNcclPrefix, dl), dev, "grow");
  }
  return child;
}

}  // namespace resilient_comm
