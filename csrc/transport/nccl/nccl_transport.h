// The NCCL transport's entry in the device-transport registry (comm/device_transport.h): an
// NCCL communicator over a library and a device's streams, both from `runtime`. The library
// is libnccl and the streams CUDA's for resilient_nccl's CUDA tensors (cudaRuntime); the NCCL
// emulator supplies another runtime for CPU tensors (emulation/nccl/nccl_emulator.h).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "comm/device_transport.h"
#include "device/stream_ops.h"

namespace resilient_comm::nccl {

class NcclApi;

struct NcclRuntime {
  std::shared_ptr<NcclApi> api;
  std::shared_ptr<device::StreamOps> streams;
};
using NcclRuntimeFor = std::function<Result<NcclRuntime>(const c10::Device&)>;

// libnccl (found as loadNccl finds it) and the CUDA streams of `device`.
Result<NcclRuntime> cudaRuntime(const c10::Device& device);

// The entry: `backend`'s tensors of `type` (named `deviceName` in messages) over NCCL.
DeviceTransport ncclTransport(std::string backend, c10::DeviceType type, std::string deviceName,
                              NcclRuntimeFor runtime);

}  // namespace resilient_comm::nccl
