// ResilientWork: the c10d::Work of one queued operation.
//
// The backend's worker thread runs the op and calls complete() exactly once; any thread may
// wait(), poll isCompleted(), read exception() or chain on getFuture() (DDP comm hooks).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>
#include <vector>

#include "common/status.h"

namespace resilient_comm {

class ResilientWork : public c10d::Work {
 public:
  ResilientWork(int rank, c10d::OpType opType, uint64_t seq, std::vector<at::Tensor> outputs);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override {
    return seq_;
  }

  // Called once by the worker. A failed Status becomes a c10::DistBackendError, which Python
  // sees as torch.distributed.DistBackendError.
  void complete(const Status& status);

 private:
  const uint64_t seq_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace resilient_comm
