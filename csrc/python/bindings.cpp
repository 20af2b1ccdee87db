// The only place C++ meets Python. Waits release the GIL; Status errors become exceptions.
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>

#include "backend/resilient_backend.h"
#include "common/env.h"
#include "watchdog/reaper.h"
#include "watchdog/watchdog.h"
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

// The resilient_comm.errors exception for `info`.
py::object toPython(const resilient_comm::CommErrorInfo& info) {
  py::object cls = py::module_::import("resilient_comm.errors").attr(info.pythonClass());
  py::object seq = info.seq ? py::object(py::int_(*info.seq)) : py::object(py::none());
  return cls(info.message(), info.rank, info.group, info.op, seq, info.cause);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "resilient_comm native core";
  py::module_::import("torch.distributed");

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
      .def("split_by_color", &ResilientBackend::splitByColor, py::arg("color"), py::arg("key"),
           py::call_guard<py::gil_scoped_release>())
      .def("grow", &ResilientBackend::grow, py::arg("new_size"), py::arg("store"), py::arg("join_key"),
           py::call_guard<py::gil_scoped_release>())
      .def("comm_state",
           [](const ResilientBackend& b) { return std::string(resilient_comm::commStateName(b.cpuComm()->state())); })
      .def("comm_caps", [](const ResilientBackend& b) { return capsDict(b.cpuComm()->caps()); });

  m.def("create_backend", &createBackend, py::arg("backend_name"), py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout_seconds"), py::arg("group_name"));

  m.def(
      "join_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, const std::string& joinKey, int rank, int newSize,
         int existingSize, double timeoutSeconds, const std::string& groupName) {
        BackendOptions opts;
        opts.backendName = "resilient_tcp";
        opts.groupName = groupName;
        opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0));
        return ResilientBackend::join(store, joinKey, rank, newSize, existingSize, std::move(opts));
      },
      py::arg("store"), py::arg("join_key"), py::arg("rank"), py::arg("new_size"), py::arg("existing_size"),
      py::arg("timeout_seconds"), py::arg("group_name"));

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
