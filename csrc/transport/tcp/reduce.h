// Elementwise reduction kernels of the TCP transport: dst[i] = op(dst[i], src[i]).
// float16/bfloat16 are computed in float and rounded once per step, as NCCL does. For bool,
// sum and max are logical or, prod and min logical and. Avg reduces as sum; the caller
// divides once at the end (scale()).
#pragma once

#include <cstddef>

#include "comm/types.h"

namespace resilient_comm::tcp {

void reduceInto(void* dst, const void* src, size_t count, DataType dt, RedOp op);
// dst[i] /= divisor, for floating-point types (avg).
void scale(void* dst, size_t count, DataType dt, double divisor);

}  // namespace resilient_comm::tcp
