// ScriptedStreamOps: streams for scripted fakes of a vendor library (the fake HCCL). Nothing is
// enqueued anywhere: tasks run at once on the caller's thread, and events are done at once, or
// never when the script says ops hang. Not a model of a device; the NCCL emulator has one
// (emulated_device.h).
//
// Threads: as StreamOps.
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "device/stream_ops.h"

namespace resilient_comm::device {

class ScriptedStreamOps : public StreamOps {
 public:
  explicit ScriptedStreamOps(bool opsHang) : hang_(opsHang) {}

  Result<DeviceGuard> bind() override {
    return DeviceGuard();
  }
  void* nativeStream() override {
    return nullptr;
  }
  Status followCurrent() override {
    return Status::ok();
  }
  Status runOnStream(std::function<void()> fn) override {
    try {
      fn();
      return Status::ok();
    } catch (const std::exception& e) {
      return Status(StatusCode::kInternal, e.what());
    }
  }
  Result<std::shared_ptr<DeviceEvent>> record() override {
    return std::shared_ptr<DeviceEvent>(std::make_shared<Event>(hang_));
  }
  Result<void*> scratch(size_t bytes) override {
    if (scratch_.size() < bytes) {
      scratch_.resize(bytes);
    }
    return static_cast<void*>(scratch_.data());
  }
  Result<std::shared_ptr<StreamOps>> fork() override {
    return std::shared_ptr<StreamOps>(std::make_shared<ScriptedStreamOps>(hang_));
  }
  std::string describe() const override {
    return "scripted";
  }

 private:
  class Event : public DeviceEvent {
   public:
    explicit Event(bool hang) : hang_(hang) {}
    Result<bool> query() override {
      return !hang_;
    }
    Result<bool> blockCurrentStream() override {
      return false;
    }

   private:
    bool hang_;
  };

  bool hang_;
  std::vector<char> scratch_;
};

}  // namespace resilient_comm::device
