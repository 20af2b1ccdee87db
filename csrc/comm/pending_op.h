// PendingOp: one stream-ordered op in flight on a device communicator (Communicator::launch).
//
// It ends twice, and the two ends are kept apart:
// - its outcome (status): Ok when its end event completed on a healthy communicator, or the
//   communicator's first error when that came first (fail()). Whoever sees it first (the
//   watchdog's poll, a waiter, Work.is_completed) records it; the callbacks then run once.
// - its retirement: the end event completed, so nothing on the device still reads or writes the
//   op's buffers, and `keep` (the op's tensors and temporaries) is released. A failed op retires
//   only when its event completes (after an abort its kernels exit); until then it holds `keep`,
//   so no buffer goes back to the allocator while a kernel may write it.
//
// Threads: any. Callbacks run on the thread that recorded the outcome, with no lock held.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "device/stream_ops.h"

namespace resilient_comm {

class PendingOp {
 public:
  PendingOp(uint64_t seq, std::string what, std::shared_ptr<device::DeviceEvent> end, Deadline deadline,
            std::shared_ptr<void> keep);

  uint64_t seq() const {
    return seq_;
  }
  const std::string& what() const {
    return what_;
  }
  const Deadline& deadline() const {
    return deadline_;
  }
  // Queries the end event once: kInProgress while it runs, else the outcome. A device error in
  // the query is the op's outcome.
  Status poll();
  // Records `st` as the outcome unless one is recorded already.
  void fail(const Status& st);
  // The outcome so far (kInProgress until there is one), without touching the device.
  Status outcome() const;
  // True once the end event completed and `keep` was released.
  bool retired() const;
  // Makes the calling thread's current stream wait for the op's end (no host wait); false where
  // the host is the consumer and must wait (see DeviceEvent::blockCurrentStream).
  Result<bool> blockCurrentStream();
  // Polls until the op has an outcome, `dl` passes (kTimeout; the op goes on) or `abort` fires.
  Status hostWait(const Deadline& dl, AbortToken* abort);
  // Runs fn(outcome) once the op has one (at once if it has).
  void onDone(std::function<void(const Status&)> fn);

 private:
  // Records `st` if the op has no outcome yet; runs the callbacks. `retire` releases keep.
  void settle(const Status& st, bool retire);

  const uint64_t seq_;
  const std::string what_;
  const std::shared_ptr<device::DeviceEvent> end_;
  const Deadline deadline_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Status outcome_{StatusCode::kInProgress, "in flight"};
  bool retired_ = false;
  std::shared_ptr<void> keep_;
  std::vector<std::function<void(const Status&)>> callbacks_;
};

}  // namespace resilient_comm
