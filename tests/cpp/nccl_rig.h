// Helpers for the NCCL tests: a world of NcclCommunicators on one NCCL emulator, one rank per
// thread of this process (the emulator moves real bytes between them over loopback TCP).
#pragma once

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "emulation/device/emulated_device.h"
#include "emulation/nccl/nccl_emulator.h"
#include "transport/nccl/nccl_communicator.h"

#include "check.h"  // last: it replaces c10's CHECK

namespace rc_test {

using Clock = std::chrono::steady_clock;

inline resilient_comm::Deadline in(int ms) {
  return resilient_comm::Deadline::after(std::chrono::milliseconds(ms));
}

inline double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Polls pred until it holds or `ms` pass (teardown happens on threads that outlive the call).
template <typename Pred>
bool eventually(Pred pred, int ms = 3000) {
  resilient_comm::Deadline dl = in(ms);
  while (!pred()) {
    if (dl.passed()) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // pacing of the poll; pred ends it
  }
  return true;
}

// Runs fn(rank) on n threads at once and joins them; a failed CHECK on any rank is rethrown here.
inline void onEachRank(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  std::mutex mu;
  std::exception_ptr first;
  for (int r = 0; r < n; ++r) {
    ts.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) {
          first = std::current_exception();
        }
      }
    });
  }
  for (auto& t : ts) {
    t.join();
  }
  if (first) {
    std::rethrow_exception(first);
  }
}

struct World {
  std::shared_ptr<resilient_comm::nccl::NcclEmulator> api;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<resilient_comm::device::StreamOps>> streams;
  std::vector<std::shared_ptr<resilient_comm::nccl::NcclCommunicator>> comms;

  resilient_comm::nccl::NcclCommunicator& operator[](int r) {
    return *comms.at(r);
  }
  int size() const {
    return static_cast<int>(comms.size());
  }
};

// n communicators of one group on a fresh emulator, each with an emulated stream of `device`.
inline World makeWorld(int n, resilient_comm::nccl::EmulatorOptions options = {}, int initTimeoutMs = 5000,
                       int device = 0) {
  World w;
  w.api = std::make_shared<resilient_comm::nccl::NcclEmulator>(options);
  for (int r = 0; r < n; ++r) {
    resilient_comm::nccl::NcclOptions o;
    o.name = "t";
    o.store = w.store;
    o.prefix = "nccl/";
    o.rank = r;
    o.size = n;
    w.streams.push_back(resilient_comm::device::emu::makeEmulatedStreamOps(device));
    auto c = resilient_comm::nccl::NcclCommunicator::create(w.api, w.streams.back(), o, in(initTimeoutMs));
    CHECK(c.isOk()) << c.status().toString();
    w.comms.push_back(c.take());
  }
  return w;
}

inline void allReady(World& w, int ms = 5000) {
  for (auto& c : w.comms) {
    resilient_comm::Status st = c->waitReady(in(ms));
    CHECK(st.isOk()) << st.toString();
  }
}

// The emulated stream behind a StreamOps (its native handle).
inline resilient_comm::device::emu::Stream& streamOf(resilient_comm::device::StreamOps& s) {
  return *static_cast<resilient_comm::device::emu::Stream*>(s.nativeStream());
}

}  // namespace rc_test
