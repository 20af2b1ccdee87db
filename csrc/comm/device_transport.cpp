#include "comm/device_transport.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <mutex>

namespace resilient_comm {

namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<const DeviceTransport>> entries;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: lookups may run during exit
  return *r;
}

}  // namespace

void DeviceTransports::add(DeviceTransport t) {
  auto entry = std::make_shared<const DeviceTransport>(std::move(t));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& e : r.entries) {
    if (e->backend == entry->backend && e->deviceType == entry->deviceType) {
      e = std::move(entry);
      return;
    }
  }
  r.entries.push_back(std::move(entry));
}

std::shared_ptr<const DeviceTransport> DeviceTransports::find(const std::string& backend, c10::DeviceType type) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& e : r.entries) {
    if (e->backend == backend && e->deviceType == type && (!e->enabled || e->enabled())) {
      return e;
    }
  }
  return nullptr;
}

std::string DeviceTransports::carried(const std::string& backend) {
  std::string out = "CPU";
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& e : r.entries) {
    if (e->backend == backend && e->deviceType != c10::DeviceType::CPU) {
      out += " and " + e->deviceName;
    }
  }
  return out;
}

bool DeviceTransports::serves(const std::string& backend) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& e : r.entries) {
    if (e->backend == backend) {
      return true;
    }
  }
  return false;
}

std::vector<std::shared_ptr<const DeviceTransport>> DeviceTransports::all() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.entries;
}

}  // namespace resilient_comm
