// The device-transport registry (comm/device_transport.h): entries found by backend and device
// type, replaced, hidden while disabled; and the NCCL emulator's entry, one registered choice
// among them, makes a working communicator from a spec alone.
#include <cstdlib>

#include "comm/device_transport.h"
#include "nccl_rig.h"

namespace rc_test {

namespace {

using resilient_comm::DeviceTransport;
using resilient_comm::DeviceTransports;

DeviceTransport entry(const std::string& backend, c10::DeviceType type, const std::string& name,
                      const std::string& library) {
  DeviceTransport t;
  t.backend = backend;
  t.deviceType = type;
  t.deviceName = name;
  t.library = library;
  return t;
}

}  // namespace

TEST(device_transports_are_found_by_backend_and_device_type_replaced_and_hidden_while_disabled) {
  CHECK(!DeviceTransports::serves("test_backend"));
  CHECK(DeviceTransports::carried("test_backend") == "CPU") << DeviceTransports::carried("test_backend");
  DeviceTransports::add(entry("test_backend", c10::DeviceType::CUDA, "CUDA", "A"));
  DeviceTransports::add(entry("test_backend", c10::DeviceType::PrivateUse1, "NPU", "B"));
  bool on = false;
  DeviceTransport cpu = entry("test_backend", c10::DeviceType::CPU, "CPU", "C");
  cpu.enabled = [&on] { return on; };
  DeviceTransports::add(cpu);

  CHECK(DeviceTransports::serves("test_backend"));
  CHECK(DeviceTransports::find("test_backend", c10::DeviceType::CUDA)->library == "A");
  CHECK(DeviceTransports::find("test_backend", c10::DeviceType::PrivateUse1)->library == "B");
  CHECK(DeviceTransports::find("other_backend", c10::DeviceType::CUDA) == nullptr);
  CHECK(DeviceTransports::find("test_backend", c10::DeviceType::CPU) == nullptr) << "disabled: not found";
  on = true;
  CHECK(DeviceTransports::find("test_backend", c10::DeviceType::CPU)->library == "C");
  CHECK(DeviceTransports::carried("test_backend") == "CPU and CUDA and NPU") << DeviceTransports::carried("test_backend");

  DeviceTransports::add(entry("test_backend", c10::DeviceType::CUDA, "CUDA", "A2"));  // replaces
  CHECK(DeviceTransports::find("test_backend", c10::DeviceType::CUDA)->library == "A2");
  int mine = 0;
  for (const auto& t : DeviceTransports::all()) {
    mine += t->backend == "test_backend" ? 1 : 0;
  }
  CHECK(mine == 3) << mine;
}

TEST(device_transports_the_emulators_entry_makes_a_working_nccl_communicator_from_a_spec) {
  DeviceTransports::add(resilient_comm::nccl::emulatedNcclTransport("test_emulated"));
  ::unsetenv("RESILIENT_COMM_NCCL_EMULATE");
  CHECK(DeviceTransports::find("test_emulated", c10::DeviceType::CPU) == nullptr) << "off unless a run asks for it";
  ::setenv("RESILIENT_COMM_NCCL_EMULATE", "1", 1);
  auto t = DeviceTransports::find("test_emulated", c10::DeviceType::CPU);
  ::unsetenv("RESILIENT_COMM_NCCL_EMULATE");
  CHECK(t != nullptr);
  CHECK(t->library == "NCCL" && t->growth.has_value());

  auto id = t->makeId(c10::Device(c10::DeviceType::CPU));
  CHECK(id.isOk()) << id.status().toString();
  CHECK(id.value().size() == t->idBytes) << id.value().size();

  // Two ranks, through the store (no id) and through a handed-over id.
  for (bool handed : {false, true}) {
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
    onEachRank(2, [&](int r) {
      resilient_comm::DeviceCommSpec spec{"t", store, handed ? "h/" : "s/", r, 2, c10::Device(c10::DeviceType::CPU),
                                          handed ? id.value() : std::vector<uint8_t>{}};
      auto comm = t->create(std::move(spec), in(10000));
      CHECK(comm.isOk()) << comm.status().toString();
      float x[4] = {1.0f + r, 1.0f + r, 1.0f + r, 1.0f + r};
      resilient_comm::Status st = comm.value()->allReduce(x, 4, resilient_comm::DataType::kFloat32,
                                                          resilient_comm::RedOp::kSum, in(10000));
      CHECK(st.isOk()) << st.toString();
      CHECK(x[3] == 3.0f) << x[3];
    });
  }
}

}  // namespace rc_test
