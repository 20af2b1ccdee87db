// The alpha-beta cost model that picks a TCP algorithm per call.
//
// T(message of s bytes) = alpha + s * beta, with alpha = RESILIENT_COMM_ALPHA_US and
// beta = 1 / RESILIENT_COMM_BANDWIDTH_GBPS. For N ranks and S bytes:
//   all_reduce      ring 2(N-1)(alpha + S/N beta)    rd  ceil(log2 N)(alpha + S beta) (+2 steps if N is not a power of 2)
//   reduce_scatter  ring (N-1)(alpha + S/N beta)     rd  as all_reduce of S
//   all_gather      ring (N-1)(alpha + s beta)       direct (N-1) s beta + alpha + (N-1) alpha/4   (s = bytes per rank)
//   broadcast       chain (N-1+k-1)(alpha + c beta)  binomial ceil(log2 N)(alpha + S beta)         (c = chunk, k = S/c)
//   reduce          ring (N-1)(alpha + S/N beta) + alpha + S beta     binomial as broadcast
// RESILIENT_COMM_ALGO=ring|rd|direct forces a family where the op has one (ring: ring/chain;
// rd: rd/binomial/direct); auto takes the cheaper estimate.
#pragma once

#include <cstddef>
#include <string>

#include "comm/types.h"

namespace resilient_comm::tcp {

enum class Algo { kRing, kLogDepth };

struct CostModel {
  double alphaUs;
  double usPerByte;
  size_t chunkBytes;
  std::string forced;  // "auto", "ring", "rd" or "direct"

  static CostModel fromEnv();
  // Estimated microseconds of `algo` for `op` on `bytes` (whole buffer) over `n` ranks.
  double estimateUs(OpKind op, Algo algo, size_t bytes, int n) const;
  Algo choose(OpKind op, size_t bytes, int n) const;
};

}  // namespace resilient_comm::tcp
