#include "transport/tcp/cost_model.h"

#include <cmath>

#include "common/env.h"

namespace resilient_comm::tcp {

CostModel CostModel::fromEnv() {
  CostModel m;
  m.alphaUs = env::getDouble(env::Knob::kAlphaUs);
  double gbps = env::getDouble(env::Knob::kBandwidthGBps);
  m.usPerByte = gbps > 0 ? 1e-3 / gbps : 1e-3;
  int64_t chunk = env::getInt(env::Knob::kChunkBytes);
  m.chunkBytes = chunk > 0 ? static_cast<size_t>(chunk) : 262144;
  m.forced = env::getString(env::Knob::kAlgo);
  return m;
}

double CostModel::estimateUs(OpKind op, Algo algo, size_t bytes, int n) const {
  const double a = alphaUs;
  const double b = usPerByte;
  const double s = static_cast<double>(bytes);
  const double steps = std::ceil(std::log2(static_cast<double>(n)));
  const bool pow2 = (n & (n - 1)) == 0;
  switch (op) {
    case OpKind::kAllReduce:
    case OpKind::kReduceScatter: {
      double rings = op == OpKind::kAllReduce ? 2.0 : 1.0;
      if (algo == Algo::kRing) {
        return rings * (n - 1) * (a + s / n * b);
      }
      return (steps + (pow2 ? 0 : 2)) * (a + s * b);
    }
    case OpKind::kAllGather: {
      double per = s / n;
      if (algo == Algo::kRing) {
        return (n - 1) * (a + per * b);
      }
      return a + (n - 1) * (per * b + a / 4);
    }
    case OpKind::kBroadcast: {
      if (algo == Algo::kRing) {
        double k = std::max(1.0, std::ceil(s / static_cast<double>(chunkBytes)));
        double c = std::min(s, static_cast<double>(chunkBytes));
        return (n - 2 + k) * (a + c * b);
      }
      return steps * (a + s * b);
    }
    case OpKind::kReduce:
      if (algo == Algo::kRing) {
        return (n - 1) * (a + s / n * b) + a + s * b;
      }
      return steps * (a + s * b);
    default:
      return 0;
  }
}

Algo CostModel::choose(OpKind op, size_t bytes, int n) const {
  if (forced == "ring") {
    return Algo::kRing;
  }
  if (forced == "rd" || forced == "direct") {
    return Algo::kLogDepth;
  }
  return estimateUs(op, Algo::kRing, bytes, n) < estimateUs(op, Algo::kLogDepth, bytes, n) ? Algo::kRing
                                                                                              : Algo::kLogDepth;
}

}  // namespace resilient_comm::tcp
