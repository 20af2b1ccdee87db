// Argument checks and conversions between torch's types and the transports' types.
// Every check throws c10::ValueError (Python ValueError) with a message that names the op,
// the rank and what is wrong; nothing is queued when a check fails.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "comm/types.h"

namespace resilient_comm {

struct OpSite {
  std::string backend;
  std::string group;
  int rank;
  const char* op;
  std::string prefix() const;
};

DataType toDataType(const OpSite& site, at::ScalarType t);
RedOp toRedOp(const OpSite& site, const c10d::ReduceOp& op, at::ScalarType t);

// Non-empty list; every tensor dense, contiguous, on one device, of one dtype.
void checkTensors(const OpSite& site, const std::vector<at::Tensor>& ts, const char* what);
// As checkTensors, and every tensor has the same shape.
void checkSameShape(const OpSite& site, const std::vector<at::Tensor>& ts, const char* what);
// Exactly one tensor (the c10d API passes single tensors as lists).
void checkSingle(const OpSite& site, const std::vector<at::Tensor>& ts, const char* what);
void checkRank(const OpSite& site, int64_t r, int size, const char* what);
void checkSameDtype(const OpSite& site, const at::Tensor& a, const at::Tensor& b, const char* aName,
                    const char* bName);

}  // namespace resilient_comm
