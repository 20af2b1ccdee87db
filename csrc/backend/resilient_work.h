// ResilientWork: the c10d::Work of one queued operation.
//
// Completed exactly once, by whichever comes first: the backend's worker (the op finished or
// failed), the watchdog (the deadline passed), or a wait(timeout) that expired. Any thread may
// wait(), poll isCompleted(), read exception() or chain on getFuture() (DDP comm hooks).
// A failure is a CommException (see comm_error.h), raised in Python as the matching
// resilient_comm.errors class.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "backend/comm_error.h"
#include "common/status.h"

namespace resilient_comm {

class ResilientWork : public c10d::Work {
 public:
  // `site` names the backend, group, rank and op; `abortComm` aborts the group (used when a
  // wait(timeout) expires, as ProcessGroupNCCL does).
  ResilientWork(CommErrorInfo site, c10d::OpType opType, std::vector<at::Tensor> outputs,
                std::function<void(const std::string&)> abortComm);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  // timeout 0 waits for the op's own deadline; a shorter expiry aborts the group and raises
  // CommTimeoutError.
  bool wait(std::chrono::milliseconds timeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;

  // The collective's sequence number, known once the worker starts the op.
  void setSeq(uint64_t seq);
  // The first call wins; later ones are ignored.
  void complete(const Status& status);

 private:
  CommErrorInfo site_;
  std::vector<at::Tensor> outputs_;
  std::function<void(const std::string&)> abortComm_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace resilient_comm
