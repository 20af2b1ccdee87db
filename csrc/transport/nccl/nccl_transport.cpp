#include "transport/nccl/nccl_transport.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/check.h"
#include "transport/nccl/nccl_api.h"
#include "transport/nccl/nccl_communicator.h"

namespace resilient_comm::nccl {

namespace {

NcclOptions optionsOf(DeviceCommSpec s) {
  return NcclOptions{std::move(s.name), std::move(s.store), std::move(s.prefix), s.rank, s.size, std::move(s.id)};
}

using Make = Result<std::shared_ptr<NcclCommunicator>> (*)(std::shared_ptr<NcclApi>, std::shared_ptr<device::StreamOps>,
                                                           NcclOptions, const Deadline&);

// A communicator by `make` (NcclCommunicator::create, or ::join for a grow's newcomer) on the
// library and streams `runtime` gives for the spec's device.
MakeDeviceComm making(const NcclRuntimeFor& runtime, Make make) {
  return [runtime, make](DeviceCommSpec s, const Deadline& dl) -> DeviceCommResult {
    NcclRuntime rt;
    RC_ASSIGN_OR_RETURN(rt, runtime(s.device));
    std::shared_ptr<NcclCommunicator> comm;
    RC_ASSIGN_OR_RETURN(comm, make(rt.api, rt.streams, optionsOf(std::move(s)), dl));
    return std::shared_ptr<Communicator>(comm);
  };
}

Result<NcclCommunicator*> asNccl(Communicator& from) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&from);
  if (nccl == nullptr) {
    return Status(StatusCode::kInternal, "the communicator to grow is not an NCCL one");
  }
  return nccl;
}

}  // namespace

Result<NcclRuntime> cudaRuntime(const c10::Device& device) {
  NcclRuntime rt;
  RC_ASSIGN_OR_RETURN(rt.api, loadNccl({}));
  RC_ASSIGN_OR_RETURN(rt.streams, device::makeDeviceStreamOps("cuda", device.index()));
  return rt;
}

DeviceTransport ncclTransport(std::string backend, c10::DeviceType type, std::string deviceName,
                              NcclRuntimeFor runtime) {
  DeviceTransport t;
  t.backend = std::move(backend);
  t.deviceType = type;
  t.deviceName = std::move(deviceName);
  t.library = "NCCL";
  t.idBytes = sizeof(ncclUniqueId);
  t.makeId = [runtime](const c10::Device& dev) -> Result<std::vector<uint8_t>> {
    NcclRuntime rt;
    RC_ASSIGN_OR_RETURN(rt, runtime(dev));
    std::vector<uint8_t> id(sizeof(ncclUniqueId), 0);
    ncclResult_t r = rt.api->getUniqueId(reinterpret_cast<ncclUniqueId*>(id.data()));
    if (r != ncclSuccess) {
      return Status(StatusCode::kInternal, "ncclGetUniqueId failed (" + std::to_string(static_cast<int>(r)) + ")");
    }
    return id;
  };
  t.create = making(runtime, &NcclCommunicator::create);
  DeviceTransport::Growth g;
  g.native = [](Communicator& from) {
    auto* nccl = dynamic_cast<NcclCommunicator*>(&from);
    return nccl != nullptr && nccl->nativeGrow();
  };
  g.id = [](Communicator& from, const Deadline& dl) -> Result<std::vector<uint8_t>> {
    NcclCommunicator* nccl = nullptr;
    RC_ASSIGN_OR_RETURN(nccl, asNccl(from));
    return nccl->growId(dl);
  };
  g.withId = [](Communicator& from, DeviceCommSpec s, const Deadline& dl) -> DeviceCommResult {
    NcclCommunicator* nccl = nullptr;
    RC_ASSIGN_OR_RETURN(nccl, asNccl(from));
    return nccl->growWithId(s.size, s.id, s.prefix, s.store, dl);
  };
  g.join = making(runtime, &NcclCommunicator::join);
  t.growth = std::move(g);
  return t;
}

}  // namespace resilient_comm::nccl
