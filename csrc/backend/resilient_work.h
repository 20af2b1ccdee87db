// ResilientWork: the c10d::Work of one operation.
//
// Host ops (the TCP transport) complete exactly once, by whichever comes first: the backend's
// worker (the op finished or failed), the watchdog (the deadline passed), or a wait(timeout)
// that expired.
//
// Stream-ordered ops (a device communicator's, attach()) behave as ProcessGroupNCCL's: the op is
// in flight on its communicator's stream when the Work is returned. wait() makes the caller's
// current stream wait for the op's end event and returns at once, without a host wait; the
// host waits only where asked (synchronize(), RESILIENT_COMM_BLOCKING_WAIT=1, a barrier), or
// where the host itself consumes the result (an emulated device's host tensors, see
// emulation/device/emulated_device.h). is_completed() queries the end event; the outcome (an error of the
// communicator, or Ok when the event completed) is recorded once. The Future is marked from the
// op's stream (markFutureReady): for a device, at once with the stream's events, so that its
// consumers order themselves after the op, as ProcessGroupNCCL's futures do.
//
// Threads: any thread may wait(), poll isCompleted(), read exception() or chain on getFuture()
// (DDP comm hooks). A failure is a CommException (see comm_error.h), raised in Python as the
// matching resilient_comm.errors class.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/comm_error.h"
#include "comm/pending_op.h"
#include "common/status.h"

namespace resilient_comm {

class ResilientWork : public c10d::Work {
 public:
  // `site` names the backend, group, rank and op; `abortComm` aborts the group (used when a
  // wait(timeout) expires, as ProcessGroupNCCL does). `devices`: those of a device op's tensors
  // (its Future records events on their streams); empty for host tensors.
  ResilientWork(CommErrorInfo site, c10d::OpType opType, std::vector<at::Tensor> outputs,
                std::function<void(const std::string&)> abortComm, std::vector<c10::Device> devices = {});

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  // timeout 0 waits for the op's own deadline; a shorter expiry aborts the group and raises
  // CommTimeoutError.
  bool wait(std::chrono::milliseconds timeout) override;
  // Waits on the host until the op has an outcome (errors are raised by wait()).
  void synchronize() override;
  void blockCurrentStream() override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;
  // recv from any source: the rank the message came from, once the Work completed.
  int sourceRank() const override;
  void setSourceRank(std::shared_ptr<const std::atomic<int>> source) {
    source_ = std::move(source);
  }

  // The collective's sequence number, known once the op starts.
  void setSeq(uint64_t seq);
  // The first call wins; later ones are ignored.
  void complete(const Status& status);
  // A stream-ordered op: this Work follows `op` (see above); `hostWaits` makes wait() a host
  // wait (a barrier).
  void attach(std::shared_ptr<PendingOp> op, bool hostWaits);
  // Marks the Future (or sets its error, if the op failed already); runs ordered on the op's
  // stream. The first of it and a failing complete() wins.
  void markFutureReady();

 private:
  // Host-waits for the attached op: records its outcome; an expiry of `timeout` aborts the group.
  void hostWait(std::chrono::milliseconds timeout);
  // Work.wait(timeout) ran out: fails the Work with a timeout and aborts the group.
  void expire(std::chrono::milliseconds timeout);
  void raiseIfFailed();

  CommErrorInfo site_;
  std::vector<at::Tensor> outputs_;
  std::function<void(const std::string&)> abortComm_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<PendingOp> op_;  // set once by attach(), before the Work is handed out
  bool hostWaits_ = false;
  bool futureSet_ = false;  // guarded by mutex_
  std::shared_ptr<const std::atomic<int>> source_;  // written by the op, before it completes
};

}  // namespace resilient_comm
