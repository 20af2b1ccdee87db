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
// PREMUL_SUM (floating-point tensors only) is a SUM after scaling by preMulFactor().
RedOp toRedOp(const OpSite& site, const c10d::ReduceOp& op, at::ScalarType t);
// For PREMUL_SUM: the factor to scale the input by before summing, as a tensor that broadcasts
// against `t` (on its device); undefined for every other op.
at::Tensor preMulFactor(const c10d::ReduceOp& op, const at::Tensor& t);

// How a data-movement op (broadcast, gathers, scatter, all-to-all, send/recv) carries a tensor:
// as its element type where the transports know it, else as bytes (uint16/32/64, fp8, complex,
// ...): data moves the same either way. `count` is in `dt` units.
struct Payload {
  DataType dt;
  size_t count;
  size_t perElement;  // payload units per tensor element: 1, or the element size when carried as bytes
};
Payload payload(const at::Tensor& t);

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
