// StreamOps over c10's device-generic Stream/Event API (see stream_ops.h): serves CUDA and NPU
// without linking c10_cuda. Every c10 call is wrapped: a c10::Error (a sticky CUDA error, an
// event recorded during graph capture) becomes a kInternal Status naming the device, so the
// communicator fails instead of an exception escaping through it.
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <exception>
#include <utility>

#include "common/check.h"
#include "device/stream_ops.h"

namespace resilient_comm::device {

namespace {

Status deviceError(const c10::Device& d, const char* what, const std::exception& e) {
  const auto* c10e = dynamic_cast<const c10::Error*>(&e);
  return Status(StatusCode::kInternal, std::string(what) + " on " + d.str() + " failed: " +
                                           (c10e != nullptr ? c10e->what_without_backtrace() : e.what()));
}

// Runs fn, turning any exception into a Status about `what` on `d`.
template <typename Fn>
Status guarded(const c10::Device& d, const char* what, Fn&& fn) {
  try {
    fn();
    return Status::ok();
  } catch (const std::exception& e) {
    return deviceError(d, what, e);
  }
}

class C10Event : public DeviceEvent {
 public:
  C10Event(c10::Device device, c10::Event event) : device_(device), event_(std::move(event)) {}

  Result<bool> query() override {
    bool done = false;
    RC_RETURN_IF_ERROR(guarded(device_, "querying an op's end event", [&] { done = event_.query(); }));
    return done;
  }

  Result<bool> blockCurrentStream() override {
    RC_RETURN_IF_ERROR(guarded(device_, "ordering the current stream after an op", [&] {
      c10::impl::VirtualGuardImpl impl(device_.type());
      event_.block(impl.getStream(device_));
    }));
    return true;
  }

 private:
  c10::Device device_;
  c10::Event event_;
};

class C10StreamOps : public StreamOps {
 public:
  C10StreamOps(c10::Device device, c10::Stream stream) : device_(device), impl_(device.type()), stream_(stream) {}

  Result<DeviceGuard> bind() override {
    c10::Device previous = device_;
    RC_RETURN_IF_ERROR(guarded(device_, "making the device current", [&] { previous = impl_.exchangeDevice(device_); }));
    if (previous == device_) {
      return DeviceGuard();
    }
    return DeviceGuard([impl = impl_, previous] {
      try {
        impl.setDevice(previous);
      } catch (const std::exception&) {  // restoring the caller's device cannot fail it
      }
    });
  }

  void* nativeStream() override {
    return stream_.native_handle();
  }

  Status followCurrent() override {
    return guarded(device_, "ordering the communicator's stream after the caller's", [&] {
      c10::Event ready(device_.type());
      ready.record(impl_.getStream(device_));
      ready.block(stream_);
    });
  }

  Status runOnStream(std::function<void()> fn) override {
    return guarded(device_, "a copy on the communicator's stream", [&] {
      c10::Stream previous = impl_.exchangeStream(stream_);
      try {
        fn();
      } catch (...) {
        impl_.exchangeStream(previous);
        throw;
      }
      impl_.exchangeStream(previous);
    });
  }

  Result<std::shared_ptr<DeviceEvent>> record() override {
    std::shared_ptr<DeviceEvent> out;
    RC_RETURN_IF_ERROR(guarded(device_, "recording an op's end event", [&] {
      c10::Event e(device_.type());
      e.record(stream_);
      out = std::make_shared<C10Event>(device_, std::move(e));
    }));
    return out;
  }

  Result<void*> scratch(size_t bytes) override {
    if (scratchBytes_ < bytes) {
      RC_RETURN_IF_ERROR(guarded(device_, "allocating scratch memory", [&] {
        scratch_ = c10::GetAllocator(device_.type())->allocate(bytes);
        scratchBytes_ = bytes;
      }));
    }
    return scratch_.get();
  }

  Result<std::shared_ptr<StreamOps>> fork() override {
    return makeDeviceStreamOps(c10::DeviceTypeName(device_.type(), /*lower_case=*/true), device_.index());
  }

  std::string describe() const override {
    return device_.str();
  }

 private:
  c10::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream stream_;
  c10::DataPtr scratch_;
  size_t scratchBytes_ = 0;
};

}  // namespace

Result<std::shared_ptr<StreamOps>> makeDeviceStreamOps(const std::string& deviceType, int index) {
  try {
    c10::Device device(c10::Device(deviceType).type(), static_cast<c10::DeviceIndex>(index));
    c10::impl::VirtualGuardImpl impl(device.type());
    c10::Stream stream = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
    return std::shared_ptr<StreamOps>(std::make_shared<C10StreamOps>(device, stream));
  } catch (const std::exception& e) {
    const auto* c10e = dynamic_cast<const c10::Error*>(&e);
    return Status(StatusCode::kNotSupported, "no " + deviceType + " streams in this process: " +
                                                 (c10e != nullptr ? c10e->what_without_backtrace() : e.what()));
  }
}

}  // namespace resilient_comm::device
