// The HCCL transport's registry entry: where it meets c10's device API (the "npu" device that
// torch_npu registers), so that hccl_communicator.cpp stays free of it and runs on any torch.
#include <c10/core/Device.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/check.h"
#include "common/logging.h"
#include "transport/hccl/hccl_communicator.h"

namespace resilient_comm::hccl {

namespace {

Result<std::shared_ptr<Communicator>> createHcclCommunicator(DeviceCommSpec spec, const Deadline& initDeadline) {
  const int deviceIndex = spec.device.index();
  std::shared_ptr<HcclApi> api;
  RC_ASSIGN_OR_RETURN(api, loadHccl());
  c10::Device device(c10::DeviceType::CPU);
  try {
    device = c10::Device(c10::Device("npu").type(), static_cast<c10::DeviceIndex>(deviceIndex));
  } catch (const std::exception& e) {
    return Status(StatusCode::kNotSupported,
                  std::string("no \"npu\" device in this process (import torch_npu before resilient_comm): ") +
                      e.what());
  }
  HcclOptions o;
  o.name = std::move(spec.name);
  o.store = std::move(spec.store);
  o.prefix = std::move(spec.prefix);
  o.rank = spec.rank;
  o.size = spec.size;
  o.rootInfo = std::move(spec.id);
  o.makeStreams = [deviceIndex]() -> Result<std::shared_ptr<StreamOps>> {
    std::shared_ptr<StreamOps> streams;
    RC_ASSIGN_OR_RETURN(streams, device::makeDeviceStreamOps("npu", deviceIndex));
    try {
      streams->nativeStream();  // HCCL needs the aclrtStream behind c10's stream
    } catch (const std::exception& e) {
      return Status(StatusCode::kNotSupported,
                    std::string("this torch_npu gives no native handle for NPU streams: ") + e.what());
    }
    return streams;
  };
  o.bindDevice = [device] {
    try {
      c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
    } catch (const std::exception& e) {
      RC_LOG(kError, "could not make " << device.str() << " current on this thread: " << e.what());
    }
  };
  std::shared_ptr<HcclCommunicator> comm;
  RC_ASSIGN_OR_RETURN(comm, HcclCommunicator::create(std::move(api), std::move(o), initDeadline));
  return std::shared_ptr<Communicator>(std::move(comm));
}

// makeRootInfo through the libhccl createHcclCommunicator loads.
Result<std::vector<uint8_t>> loadedRootInfo() {
  std::shared_ptr<HcclApi> api;
  RC_ASSIGN_OR_RETURN(api, loadHccl());
  return makeRootInfo(*api);
}

}  // namespace

DeviceTransport hcclTransport(std::string backend) {
  DeviceTransport t;
  t.backend = std::move(backend);
  t.deviceType = c10::DeviceType::PrivateUse1;  // torch_npu's "npu"
  t.deviceName = "NPU";
  t.library = "HCCL";
  t.idBytes = kHcclRootInfoBytes;
  t.makeId = [](const c10::Device&) { return loadedRootInfo(); };
  t.create = createHcclCommunicator;
  // No growth: HCCL has no grow, so a grown group makes a fresh world on first use.
  return t;
}

}  // namespace resilient_comm::hccl
