// The only place C++ meets Python. Waits release the GIL; Status errors become exceptions.
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>

#include "backend/resilient_backend.h"
#include "common/env.h"
#include "common/liveness.h"
#include "watchdog/reaper.h"
#include "watchdog/watchdog.h"
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/device_transport.h"
#include "emulation/device/scripted_streams.h"
#include "emulation/nccl/nccl_emulator.h"
#include "transport/hccl/hccl_api.h"
#include "transport/hccl/hccl_communicator.h"
#include "transport/nccl/nccl_api.h"
#include "transport/nccl/nccl_communicator.h"
#include "transport/nccl/nccl_transport.h"
#include "transport/tcp/tcp_communicator.h"

namespace py = pybind11;
using resilient_comm::BackendOptions;
using resilient_comm::ResilientBackend;

namespace {

// A Result's value, or an OSError (a system call) / ValueError (bad input) with its message.
template <typename T>
T unwrap(resilient_comm::Result<T> r) {
  if (!r.isOk()) {
    if (r.status().code() == resilient_comm::StatusCode::kInvalidArgument) {
      throw py::value_error(r.status().message());
    }
    throw std::system_error(std::error_code(EIO, std::generic_category()), r.status().message());
  }
  return r.take();
}

c10::intrusive_ptr<ResilientBackend> createBackend(const std::string& backendName,
                                                   const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                   double timeoutSeconds, const std::string& groupName,
                                                   bool enableReconfigure) {
  BackendOptions opts;
  opts.backendName = backendName;
  opts.groupName = groupName;
  opts.enableReconfigure = enableReconfigure;
  opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0));
  return c10::make_intrusive<ResilientBackend>(store, rank, size, std::move(opts));
}

py::dict capsDict(const resilient_comm::Caps& c) {
  py::dict d;
  d["non_blocking_init"] = c.nonBlockingInit;
  d["abort"] = c.abort;
  d["split"] = c.split;
  d["shrink"] = c.shrink;
  d["revoke"] = c.revoke;
  d["grow"] = c.grow;
  d["multi_rank_per_device"] = c.multiRankPerDevice;
  return d;
}

// What a vendor library loader found, for doctor and tests: {"found": False, "error": what was
// tried and why it failed}, or {"found": True, "path", <what describe(api, d) adds>, "caps",
// "symbols": {name: resolved}}. describe() answers the library's capabilities as a dict.
template <typename Api, typename Describe>
py::dict probeVendor(resilient_comm::Result<std::shared_ptr<Api>> r, const std::vector<const char*>& symbols,
                     Describe describe) {
  py::dict d;
  d["found"] = r.isOk();
  if (!r.isOk()) {
    d["error"] = r.status().message();
    return d;
  }
  const auto& api = r.value();
  d["path"] = api->path();
  d["caps"] = describe(*api, d);
  py::dict syms;
  for (const char* s : symbols) {
    syms[s] = api->hasSymbol(s);
  }
  d["symbols"] = syms;
  return d;
}

// The resilient_comm.errors exception for `info`.
py::object toPython(const resilient_comm::CommErrorInfo& info) {
  py::object cls = py::module_::import("resilient_comm.errors").attr(info.pythonClass());
  py::object seq = info.seq ? py::object(py::int_(*info.seq)) : py::object(py::none());
  return cls(info.message(), info.rank, info.group, info.op, seq, info.cause);
}

}  // namespace

// The composition root: which library carries which backend's device tensors. The backend
// finds them here by name and device type and names none of them itself.
void registerDeviceTransports() {
  using resilient_comm::DeviceTransports;
  namespace nccl = resilient_comm::nccl;
  DeviceTransports::add(nccl::ncclTransport("resilient_nccl", c10::DeviceType::CUDA, "CUDA", nccl::cudaRuntime));
  DeviceTransports::add(nccl::emulatedNcclTransport("resilient_nccl"));  // RESILIENT_COMM_NCCL_EMULATE=1
  DeviceTransports::add(resilient_comm::hccl::hcclTransport("resilient_hccl"));
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "resilient_comm native core";
  py::module_::import("torch.distributed");
  registerDeviceTransports();

  // Torch's bindings (Work.wait, futures) rethrow our CommException; translators are shared
  // with torch's pybind11 and tried newest first, so this one turns it into the matching
  // resilient_comm.errors class before torch's maps it to a plain DistBackendError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const resilient_comm::CommException& e) {
      py::object exc = toPython(e.info());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("tainted", [] {
    return resilient_comm::Reaper::tainted() ? py::object(py::str(resilient_comm::Reaper::taintReason()))
                                             : py::object(py::none());
  });
  m.def("watchdog_watching", [] { return resilient_comm::Watchdog::instance().watching(); });

  // [Note: the liveness lock] (common/liveness.h), for resilient-run and the tests.
  namespace live = resilient_comm::liveness;
  m.attr("LIVENESS_SLOT_ENV") = live::kSlotEnv;
  m.def("liveness_slot", [] { return unwrap(live::makeSlot()); });
  m.def("liveness_hold", []() -> py::object {
    const live::Held* h = live::hold();
    return h == nullptr ? py::object(py::none()) : py::make_tuple(h->pid, h->fd, h->ino);
  });
  m.def("liveness_release", &live::release);
  m.def("liveness_exiting", &live::exiting, py::arg("pid"));
  py::class_<live::Watch, std::shared_ptr<live::Watch>>(m, "LivenessWatch")
      .def(py::init([](int fd, int pid) { return unwrap(live::Watch::open(fd, pid)); }), py::arg("fd"),
           py::arg("pid"))
      .def("fileno", &live::Watch::fd)
      .def_property_readonly("pid", &live::Watch::pid)
      .def_property_readonly("verdict", [](const live::Watch& w) { return live::verdictName(w.verdict()); })
      .def_property_readonly("noticed_ns", &live::Watch::noticedNs)
      .def_property_readonly("why", &live::Watch::why);

  py::class_<ResilientBackend, c10d::Backend, c10::intrusive_ptr<ResilientBackend>>(m, "ResilientBackend")
      .def("abort_with_reason", &ResilientBackend::abortWithReason, py::arg("reason"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "comm_error",
          [](const ResilientBackend& b) -> py::object {
            auto info = b.errorInfo();
            return info ? toPython(*info) : py::none();
          },
          "The communicator's first error as a resilient_comm.errors exception, or None while it is healthy.")
      .def(
          "_direct_all_reduce",
          [](ResilientBackend& b, at::Tensor& t, int iters) {
            // Benchmark only: runs `iters` SUM all-reduces on the communicator from the calling
            // thread, bypassing the worker. Only valid while no op is in flight on the group.
            TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat,
                        "_direct_all_reduce takes a contiguous CPU float32 tensor");
            py::gil_scoped_release release;
            for (int i = 0; i < iters; ++i) {
              resilient_comm::Status st = b.cpuComm()->allReduce(
                  t.data_ptr(), t.numel(), resilient_comm::DataType::kFloat32, resilient_comm::RedOp::kSum,
                  resilient_comm::Deadline::after(std::chrono::seconds(60)));
              TORCH_CHECK(st.isOk(), st.toString());
            }
          },
          py::arg("tensor"), py::arg("iters"))
      .def("last_reconfigure", &ResilientBackend::lastReconfigure,
           "the last reconfigure's path: 'shrink', 'fresh' or 'shrink+fallback'; '' before any")
      .def("get_error", &ResilientBackend::getError,
           "c10d's ErrorType of the group's first error (its host or device communicator's); torch binds "
           "Backend.get_error only in CUDA builds")
      .def("split_by_color", &ResilientBackend::splitByColor, py::arg("color"), py::arg("key"),
           py::call_guard<py::gil_scoped_release>())
      .def("grow", &ResilientBackend::grow, py::arg("new_size"), py::arg("store"), py::arg("join_key"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("group_name", &ResilientBackend::groupName,
                             "the group's name in errors and in its device communicator's bootstrap keys")
      .def("comm_state",
           [](const ResilientBackend& b) { return std::string(resilient_comm::commStateName(b.cpuComm()->state())); })
      .def("comm_caps", [](const ResilientBackend& b) { return capsDict(b.cpuComm()->caps()); })
      .def("shm_peers",
           [](const ResilientBackend& b) {
             auto* tcp = dynamic_cast<const resilient_comm::tcp::TcpCommunicator*>(b.cpuComm().get());
             return tcp != nullptr ? tcp->shmPeers() : std::vector<int>{};
           },
           "ranks of this group whose large payloads go through shared memory (RESILIENT_COMM_SHM)")
      .def("receive_rates",
           [](const ResilientBackend& b) {
             auto* tcp = dynamic_cast<const resilient_comm::tcp::TcpCommunicator*>(b.cpuComm().get());
             return tcp != nullptr ? tcp->receiveRates() : std::vector<std::pair<int, std::vector<uint32_t>>>{};
           },
           "the large frames received through the socket, by rate: [(rank, counts per bucket)] for the ranks "
           "that sent any; bucket b holds rates from 2**(20 + b/4) bytes/s (csrc/transport/tcp/transfer.h); "
           "empty if the communicator is not TCP")
      .def("reused_connections",
           [](const ResilientBackend& b) {
             auto* tcp = dynamic_cast<const resilient_comm::tcp::TcpCommunicator*>(b.cpuComm().get());
             return tcp != nullptr ? tcp->reusedConnections() : -1;
           },
           "connections the CPU communicator took over from its parent (a shrink after an error); -1 if "
           "it is not TCP");

  m.def("create_backend", &createBackend, py::arg("backend_name"), py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout_seconds"), py::arg("group_name"), py::arg("enable_reconfigure") = false);

  m.def(
      "join_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, const std::string& joinKey, int rank, int newSize,
         int existingSize, double timeoutSeconds, const std::string& groupName, std::optional<at::Device> device) {
        BackendOptions opts;
        opts.groupName = groupName;  // the backend's name comes from the members
        opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0));
        return ResilientBackend::join(store, joinKey, rank, newSize, existingSize, std::move(opts), device);
      },
      py::arg("store"), py::arg("join_key"), py::arg("rank"), py::arg("new_size"), py::arg("existing_size"),
      py::arg("timeout_seconds"), py::arg("group_name"), py::arg("device") = py::none(),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "device_transports",
      [] {
        py::list out;
        for (const auto& t : resilient_comm::DeviceTransports::all()) {
          py::dict d;
          d["backend"] = t->backend;
          d["device"] = c10::DeviceTypeName(t->deviceType, /*lower_case=*/true);
          d["library"] = t->library;
          d["grows"] = t->growth.has_value();
          d["enabled"] = !t->enabled || t->enabled();
          out.append(d);
        }
        return out;
      },
      "The device-transport registry: which library carries which backend's tensors of which device type");
  m.def("knobs", [] {
    py::list out;
    for (const auto& k : resilient_comm::env::allKnobs()) {
      out.append(py::make_tuple(k.name, k.defaultValue, k.doc));
    }
    return out;
  });

  m.def("shm_self_test", [] { return resilient_comm::tcp::shmSelfTest(); },
        "'' if this process can set up the TCP transport's shared-memory rings (RESILIENT_COMM_SHM), else why not");
  m.def("tcp_caps", [] { return capsDict(resilient_comm::tcp::TcpCommunicator::transportCaps()); });

  m.def("probe_hccl", [] {
    // The libhccl loader, for doctor and tests: what was found, or what was tried and why it failed.
    return probeVendor(resilient_comm::hccl::loadHccl(), resilient_comm::hccl::hcclSymbols(),
                       [](const resilient_comm::hccl::HcclApi& api, py::dict&) {
                         auto f = api.features();
                         py::dict caps;
                         caps["sub_comm"] = f.subComm;
                         caps["reduce"] = f.reduce;
                         caps["all_to_all"] = f.allToAllV;
                         caps["scatter"] = f.scatter;
                         caps["batch_send_recv"] = f.batchSendRecv;
                         caps["suspend"] = f.suspend;
                         caps["resume"] = f.resume;
                         return caps;
                       });
  });
  m.def("set_nccl_candidates", &resilient_comm::nccl::setNcclCandidates, py::arg("paths"));
  m.def("nccl_emulator_stats", [] {
    // What this process's NCCL emulator (RESILIENT_COMM_NCCL_EMULATE=1) was asked to do, for tests
    // and benchmarks: calls by kind, kernels launched, and misuse (calls NCCL leaves undefined).
    auto& s = resilient_comm::nccl::processEmulator()->stats();
    py::dict d;
    d["inits"] = s.inits.load();
    d["aborts"] = s.aborts.load();
    d["destroys"] = s.destroys.load();
    d["finalizes"] = s.finalizes.load();
    d["revokes"] = s.revokes.load();
    d["shrinks"] = s.shrinks.load();
    d["splits"] = s.splits.load();
    d["grows"] = s.grows.load();
    d["kernels"] = s.kernels.load();
    d["last_shrink_flags"] = s.lastShrinkFlags.load();
    d["misuse"] = s.misuse.load();
    return d;
  });
  m.def(
      "nccl_unique_id",
      []() {
        // The real library's ncclGetUniqueId (needs no GPU): a loader check for doctor and tests.
        auto api = resilient_comm::nccl::loadNccl({});
        if (!api.isOk()) {
          throw std::runtime_error(api.status().message());
        }
        resilient_comm::nccl::ncclUniqueId id{};
        auto r = api.value()->getUniqueId(&id);
        if (r != resilient_comm::nccl::ncclSuccess) {
          throw std::runtime_error(std::string("ncclGetUniqueId failed: ") + api.value()->getErrorString(r));
        }
        return py::bytes(id.internal, sizeof(id.internal));
      });
  m.def(
      "nccl_init_check",
      [](double timeoutSeconds) {
        // A one-rank NCCL communicator on cuda:0 over a private store: Ok on a GPU machine, else the
        // clear error resilient_nccl gives (no crash).
        py::gil_scoped_release release;
        auto api = resilient_comm::nccl::loadNccl({});
        if (!api.isOk()) {
          return api.status().toString();
        }
        auto streams = resilient_comm::device::makeDeviceStreamOps("cuda", 0);
        std::shared_ptr<resilient_comm::device::StreamOps> ops;
        if (streams.isOk()) {
          ops = streams.take();
        } else {
          // No CUDA in this torch: NCCL's own init still runs (and reports the missing device).
          ops = std::make_shared<resilient_comm::device::ScriptedStreamOps>(/*opsHang=*/false);
        }
        resilient_comm::nccl::NcclOptions o{"nccl_init_check", c10::make_intrusive<c10d::HashStore>(), "check/", 0, 1};
        auto dl = resilient_comm::Deadline::after(std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000)));
        auto comm = resilient_comm::nccl::NcclCommunicator::create(api.take(), ops, std::move(o), dl);
        if (!comm.isOk()) {
          return comm.status().toString();
        }
        return comm.value()->waitReady(dl).toString();
      },
      py::arg("timeout_seconds") = 30.0);
  m.def(
      "probe_nccl",
      [](const std::vector<std::string>& candidates) {
        return probeVendor(resilient_comm::nccl::loadNccl(candidates), resilient_comm::nccl::ncclSymbols(),
                           [](const resilient_comm::nccl::NcclApi& api, py::dict& d) {
                             d["version"] = api.versionString();
                             d["version_code"] = api.version();
                             // What the library itself can do (the communicator emulates split,
                             // shrink and grow by re-init where it cannot).
                             auto f = api.features();
                             resilient_comm::Caps c;
                             c.nonBlockingInit = f.nonBlockingInit;
                             c.abort = f.nonBlockingInit;
                             c.split = f.split;
                             c.shrink = f.shrink;
                             c.revoke = f.revoke;
                             c.grow = f.grow;
                             c.multiRankPerDevice = f.multiRankPerDevice;
                             return capsDict(c);
                           });
      },
      py::arg("candidates"));
}
