#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <deque>
#include <utility>

#include "transport/nccl/stream_ops.h"

namespace resilient_comm::nccl {

namespace {

class DeviceStreamOps : public StreamOps {
 public:
  explicit DeviceStreamOps(c10::Device device)
      : device_(device),
        impl_(device.type()),
        stream_(impl_.getStreamFromGlobalPool(device, /*isHighPriority=*/false)) {}

  void makeCurrent() override {
    impl_.setDevice(device_);
  }

  void* nativeStream() override {
    return stream_.native_handle();
  }

  void followCaller() override {
    c10::Stream caller = impl_.getStream(device_);
    c10::Event ready(device_.type());
    ready.record(caller);
    ready.block(stream_);
  }

  uint64_t record() override {
    events_.emplace_back(next_, c10::Event(device_.type()));
    events_.back().second.record(stream_);
    return next_++;
  }

  bool done(uint64_t token) override {
    while (!events_.empty() && events_.front().first < token) {
      events_.pop_front();  // earlier ops on the same stream finished before this one
    }
    if (events_.empty() || events_.front().first != token) {
      return true;
    }
    if (!events_.front().second.query()) {
      return false;
    }
    events_.pop_front();
    return true;
  }

  void* scratch(size_t bytes) override {
    if (scratchBytes_ < bytes) {
      scratch_ = c10::GetAllocator(device_.type())->allocate(bytes);
      scratchBytes_ = bytes;
    }
    return scratch_.get();
  }

 private:
  c10::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream stream_;
  std::deque<std::pair<uint64_t, c10::Event>> events_;
  uint64_t next_ = 1;
  c10::DataPtr scratch_;
  size_t scratchBytes_ = 0;
};

}  // namespace

Result<std::shared_ptr<StreamOps>> makeDeviceStreamOps(const std::string& deviceType, int index) {
  try {
    c10::Device device(c10::Device(deviceType).type(), static_cast<c10::DeviceIndex>(index));
    return std::shared_ptr<StreamOps>(std::make_shared<DeviceStreamOps>(device));
  } catch (const std::exception& e) {
    return Status(StatusCode::kNotSupported, "no " + deviceType + " streams in this process: " + e.what());
  }
}

}  // namespace resilient_comm::nccl
