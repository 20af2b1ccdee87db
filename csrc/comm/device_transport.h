// Device transports: the libraries that carry a backend's device tensors, each one entry in a
// small registry, so the backend knows none of them by name.
//
// An entry says which backend it serves and which device type's tensors it carries (NCCL for
// resilient_nccl's CUDA tensors, HCCL for resilient_hccl's NPU tensors, and the NCCL emulator
// for resilient_nccl's CPU tensors when RESILIENT_COMM_NCCL_EMULATE=1: a test double is one
// registered choice among them), how its members agree on a bootstrap id, and how it makes,
// grows and joins a communicator. The extension's composition root (csrc/python) registers
// the entries at import; the backend (csrc/backend) looks one up by its name and the tensors'
// device type.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/store_util.h"
#include "common/deadline.h"
#include "common/status.h"

namespace resilient_comm {

// What a device communicator is made from, the same for every library.
struct DeviceCommSpec {
  std::string name;  // the group's, for messages
  StorePtr store;    // bootstrap keys live under `prefix` (when `id` is empty)
  std::string prefix;
  int rank = 0;
  int size = 0;
  c10::Device device{c10::DeviceType::CPU};
  std::vector<uint8_t> id;  // a bootstrap id the members agreed on already; empty: through the store
};

using DeviceCommResult = Result<std::shared_ptr<Communicator>>;
using MakeDeviceComm = std::function<DeviceCommResult(DeviceCommSpec, const Deadline&)>;

struct DeviceTransport {
  std::string backend;                           // the torch backend it serves: "resilient_nccl"
  c10::DeviceType deviceType = c10::DeviceType::CPU;  // the tensors it carries
  std::string deviceName;                        // for messages: "CUDA", "NPU"
  std::string library;                           // for messages and store keys: "NCCL", "HCCL"
  size_t idBytes = 0;                            // its bootstrap id (ncclUniqueId, HcclRootInfo)
  // Rank 0's fresh bootstrap id for `device` (ncclGetUniqueId, HcclGetRootInfo).
  std::function<Result<std::vector<uint8_t>>(const c10::Device&)> makeId;
  MakeDeviceComm create;

  // How a communicator grows with its group, where the library's does (see Communicator::grow);
  // where it does not, a grown group makes a fresh one on first use.
  struct Growth {
    // Whether `from` grows in place (ncclCommGrow); where not, the grow is a fresh init.
    std::function<bool(Communicator& from)> native;
    // The old members' rank 0: the id the grow bootstraps from, handed to every member.
    std::function<Result<std::vector<uint8_t>>(Communicator& from, const Deadline&)> id;
    // An old member: `from` grown to spec.size ranks (spec.prefix and spec.store are the grown
    // communicator's, for its own later moves).
    std::function<DeviceCommResult(Communicator& from, DeviceCommSpec, const Deadline&)> withId;
    // A newcomer's side (spec.id empty: the id comes through the store under spec.prefix).
    MakeDeviceComm join;
  };
  std::optional<Growth> growth;

  // Empty: always. The emulator's entry is there only when a run asks for it.
  std::function<bool()> enabled;
};

class DeviceTransports {
 public:
  // Adds `t`, replacing an entry for the same backend and device type.
  static void add(DeviceTransport t);
  // The enabled entry for `backend`'s tensors of `type`, or null.
  static std::shared_ptr<const DeviceTransport> find(const std::string& backend, c10::DeviceType type);
  // "CPU and CUDA": the tensors `backend` carries (CPU always, over the host transport).
  static std::string carried(const std::string& backend);
  // Whether any entry serves `backend`.
  static bool serves(const std::string& backend);
  // Every entry, enabled or not, in the order they were added.
  static std::vector<std::shared_ptr<const DeviceTransport>> all();
};

}  // namespace resilient_comm
