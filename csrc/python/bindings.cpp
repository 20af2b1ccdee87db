// The only place C++ meets Python. Waits release the GIL; Status errors become exceptions.
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>

#include "backend/resilient_backend.h"
#include "common/env.h"
#include "transport/nccl/nccl_api.h"
#include "transport/tcp/tcp_communicator.h"

namespace py = pybind11;
using resilient_comm::BackendOptions;
using resilient_comm::ResilientBackend;

namespace {

c10::intrusive_ptr<ResilientBackend> createBackend(const std::string& backendName,
                                                   const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                   double timeoutSeconds, const std::string& groupName) {
  BackendOptions opts;
  opts.backendName = backendName;
  opts.groupName = groupName;
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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "resilient_comm native core";
  py::module_::import("torch.distributed");

  py::class_<ResilientBackend, c10d::Backend, c10::intrusive_ptr<ResilientBackend>>(m, "ResilientBackend")
      .def("abort_with_reason", &ResilientBackend::abortWithReason, py::arg("reason"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "comm_error",
          [](const ResilientBackend& b) -> py::object {
            resilient_comm::Status st = b.commError();
            if (st.isOk()) {
              return py::none();
            }
            return py::str(st.toString());
          },
          "The communicator's first error as text, or None while it is healthy.")
      .def("comm_state",
           [](const ResilientBackend& b) { return std::string(resilient_comm::commStateName(b.cpuComm()->state())); })
      .def("comm_caps", [](const ResilientBackend& b) { return capsDict(b.cpuComm()->caps()); });

  m.def("create_backend", &createBackend, py::arg("backend_name"), py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout_seconds"), py::arg("group_name"));

  m.def("knobs", [] {
    py::list out;
    for (const auto& k : resilient_comm::env::allKnobs()) {
      out.append(py::make_tuple(k.name, k.defaultValue, k.doc));
    }
    return out;
  });

  m.def("tcp_caps", [] { return capsDict(resilient_comm::tcp::TcpCommunicator::transportCaps()); });

  m.def(
      "probe_nccl",
      [](const std::vector<std::string>& candidates) {
        py::dict d;
        auto r = resilient_comm::nccl::probeNccl(candidates);
        d["found"] = r.isOk();
        if (r.isOk()) {
          d["path"] = r.value().path;
          d["version"] = r.value().versionString();
          d["version_code"] = r.value().version;
        } else {
          d["error"] = r.status().message();
        }
        return d;
      },
      py::arg("candidates"));
}
