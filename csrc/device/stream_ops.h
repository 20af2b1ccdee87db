// Device streams and events as the vendor transports (NCCL, HCCL) use them, in one place that
// neither transport owns.
//
// A communicator enqueues its work on a stream of its own (StreamOps): at each op it makes that
// stream wait for the caller's current stream (so inputs are ready), enqueues the vendor calls
// and the op's own pre- and post-copies, and records an end event (DeviceEvent). Completion is
// learnt by querying the event (never by a blocking device synchronize, which could hang
// forever); a consumer on the device orders itself after the op by making its current stream
// wait on the event, with no host wait.
//
// Implementations:
// - makeDeviceStreamOps (c10_stream_ops.cpp): c10's device-generic Stream/Event API, so one
//   binary serves CUDA and NPU without linking c10_cuda. Every c10 error (a sticky CUDA error,
//   a capture in progress) comes back as a Status, never as an exception.
// - emulated_device.h: streams whose "kernels" are host tasks run in order on a thread of their
//   own, for the NCCL emulator; the calling thread's current stream is the host unless a test
//   makes an emulated stream current.
// - ScriptedStreamOps (scripted_streams.h): events that complete at once or never, as a test
//   script says (the fake HCCL).
//
// Threads: bind/followCurrent/runOnStream/record from the communicator's calling thread;
// DeviceEvent::query from any thread (the watchdog polls it); blockCurrentStream from the
// thread whose current stream should wait.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "common/status.h"

namespace resilient_comm::device {

// The end of an op on a stream.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // True once everything enqueued before the event has finished; a device error is a Status.
  virtual Result<bool> query() = 0;
  // Makes the calling thread's current stream wait for the event without a host wait, and
  // answers true; false when the calling thread's consumer is the host itself (an emulated
  // device's host tensors), which must then wait on the host.
  virtual Result<bool> blockCurrentStream() = 0;
};

// While alive, the device of a StreamOps is current on the thread that made it; the device
// current before is restored when it goes (NCCL binds a communicator to the calling thread's
// device, and the caller's own device must not change under it).
class DeviceGuard {
 public:
  DeviceGuard() = default;
  explicit DeviceGuard(std::function<void()> restore) : restore_(std::move(restore)) {}
  DeviceGuard(DeviceGuard&& o) noexcept : restore_(std::move(o.restore_)) {
    o.restore_ = nullptr;
  }
  DeviceGuard& operator=(DeviceGuard&&) = delete;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_) {
      restore_();
    }
  }

 private:
  std::function<void()> restore_;
};

class StreamOps {
 public:
  virtual ~StreamOps() = default;
  // Makes this device current on the calling thread until the guard goes.
  virtual Result<DeviceGuard> bind() = 0;
  // The vendor's handle of the communicator's stream (cudaStream_t, aclrtStream).
  virtual void* nativeStream() = 0;
  // The communicator's stream waits for the work enqueued so far on the calling thread's
  // current stream (the op's inputs are produced there).
  virtual Status followCurrent() = 0;
  // Runs `fn` ordered on the communicator's stream: on a device, at once with that stream
  // current on the calling thread (so the ATen work it does is enqueued there); on an emulated
  // device, as a task of the stream (host tensors are touched when the stream gets there).
  // An exception from fn is a Status.
  virtual Status runOnStream(std::function<void()> fn) = 0;
  // Marks the end of the work enqueued so far.
  virtual Result<std::shared_ptr<DeviceEvent>> record() = 0;
  // Device memory of at least `bytes` that lives as long as this object (barrier's one float).
  virtual Result<void*> scratch(size_t bytes) = 0;
  // The same device with a stream of its own: each communicator (a shrunk or split child too)
  // keeps its own stream and events.
  virtual Result<std::shared_ptr<StreamOps>> fork() = 0;
  // "cuda:0", "emulated:0": for messages.
  virtual std::string describe() const = 0;
};

// Streams of `deviceType` ("cuda", "npu") device `index` through c10; an error if that device
// type has no c10 backend in this process (a CPU-only torch).
Result<std::shared_ptr<StreamOps>> makeDeviceStreamOps(const std::string& deviceType, int index);

}  // namespace resilient_comm::device
