// StreamOps: the device stream an NCCL communicator enqueues on, and how it learns that an op
// finished. The real implementation (makeDeviceStreamOps) uses c10's device-generic
// Stream/Event API, so it serves CUDA (and, for HCCL, NPU) without linking c10_cuda; tests
// use a scripted one (fake_nccl.h).
//
// Threads: used by the communicator's calling thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace resilient_comm::nccl {

class StreamOps {
 public:
  virtual ~StreamOps() = default;
  // Makes this device current on the calling thread (vendor init binds to it).
  virtual void makeCurrent() = 0;
  // The stream handle the vendor library enqueues on (cudaStream_t).
  virtual void* nativeStream() = 0;
  // Orders the communicator's stream after the caller's current stream (inputs are ready).
  virtual void followCaller() = 0;
  // Marks the end of the work enqueued so far; returns a token for done().
  virtual uint64_t record() = 0;
  virtual bool done(uint64_t token) = 0;
  // Device memory of at least `bytes` that lives as long as this object (for barrier).
  virtual void* scratch(size_t bytes) = 0;
};

// Streams of `deviceType` ("cuda", "npu") device `index` through c10; an error if that
// device type has no c10 backend in this process (a CPU-only torch).
Result<std::shared_ptr<StreamOps>> makeDeviceStreamOps(const std::string& deviceType, int index);

}  // namespace resilient_comm::nccl
