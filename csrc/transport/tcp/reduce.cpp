#include "transport/tcp/reduce.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

namespace resilient_comm::tcp {

namespace {

template <typename T, typename F>
void apply(void* dst, const void* src, size_t n, F f) {
  T* __restrict d = static_cast<T*>(dst);
  const T* __restrict s = static_cast<const T*>(src);
  for (size_t i = 0; i < n; ++i) {
    d[i] = f(d[i], s[i]);
  }
}

// 16-bit floats: widen blocks to float so the inner loops vectorize.
template <typename H, typename F>
void applyHalf(void* dst, const void* src, size_t n, F f) {
  H* d = static_cast<H*>(dst);
  const H* s = static_cast<const H*>(src);
  constexpr size_t kBlock = 256;
  float a[kBlock];
  float b[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    size_t m = std::min(kBlock, n - base);
    for (size_t i = 0; i < m; ++i) {
      a[i] = static_cast<float>(d[base + i]);
      b[i] = static_cast<float>(s[base + i]);
    }
    for (size_t i = 0; i < m; ++i) {
      a[i] = f(a[i], b[i]);
    }
    for (size_t i = 0; i < m; ++i) {
      d[base + i] = static_cast<H>(a[i]);
    }
  }
}

template <typename T>
void reduceTyped(void* dst, const void* src, size_t n, RedOp op) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg:
      apply<T>(dst, src, n, [](T a, T b) { return static_cast<T>(a + b); });
      return;
    case RedOp::kProd:
      apply<T>(dst, src, n, [](T a, T b) { return static_cast<T>(a * b); });
      return;
    case RedOp::kMin:
      apply<T>(dst, src, n, [](T a, T b) { return b < a ? b : a; });
      return;
    case RedOp::kMax:
      apply<T>(dst, src, n, [](T a, T b) { return a < b ? b : a; });
      return;
  }
}

template <typename H>
void reduceHalf(void* dst, const void* src, size_t n, RedOp op) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg:
      applyHalf<H>(dst, src, n, [](float a, float b) { return a + b; });
      return;
    case RedOp::kProd:
      applyHalf<H>(dst, src, n, [](float a, float b) { return a * b; });
      return;
    case RedOp::kMin:
      applyHalf<H>(dst, src, n, [](float a, float b) { return b < a ? b : a; });
      return;
    case RedOp::kMax:
      applyHalf<H>(dst, src, n, [](float a, float b) { return a < b ? b : a; });
      return;
  }
}

void reduceBool(void* dst, const void* src, size_t n, RedOp op) {
  bool any = op == RedOp::kSum || op == RedOp::kAvg || op == RedOp::kMax;
  if (any) {
    apply<uint8_t>(dst, src, n, [](uint8_t a, uint8_t b) { return static_cast<uint8_t>((a | b) != 0); });
  } else {
    apply<uint8_t>(dst, src, n, [](uint8_t a, uint8_t b) { return static_cast<uint8_t>((a != 0) & (b != 0)); });
  }
}

template <typename T>
void scaleTyped(void* dst, size_t n, double divisor) {
  T* d = static_cast<T*>(dst);
  for (size_t i = 0; i < n; ++i) {
    d[i] = static_cast<T>(d[i] / static_cast<T>(divisor));
  }
}

template <typename H>
void scaleHalf(void* dst, size_t n, double divisor) {
  H* d = static_cast<H*>(dst);
  float f = static_cast<float>(divisor);
  for (size_t i = 0; i < n; ++i) {
    d[i] = static_cast<H>(static_cast<float>(d[i]) / f);
  }
}

}  // namespace

void reduceInto(void* dst, const void* src, size_t n, DataType dt, RedOp op) {
  switch (dt) {
    case DataType::kInt8:
      return reduceTyped<int8_t>(dst, src, n, op);
    case DataType::kUInt8:
      return reduceTyped<uint8_t>(dst, src, n, op);
    case DataType::kInt16:
      return reduceTyped<int16_t>(dst, src, n, op);
    case DataType::kInt32:
      return reduceTyped<int32_t>(dst, src, n, op);
    case DataType::kInt64:
      return reduceTyped<int64_t>(dst, src, n, op);
    case DataType::kFloat16:
      return reduceHalf<c10::Half>(dst, src, n, op);
    case DataType::kBFloat16:
      return reduceHalf<c10::BFloat16>(dst, src, n, op);
    case DataType::kFloat32:
      return reduceTyped<float>(dst, src, n, op);
    case DataType::kFloat64:
      return reduceTyped<double>(dst, src, n, op);
    case DataType::kBool:
      return reduceBool(dst, src, n, op);
  }
}

void scale(void* dst, size_t n, DataType dt, double divisor) {
  switch (dt) {
    case DataType::kFloat16:
      return scaleHalf<c10::Half>(dst, n, divisor);
    case DataType::kBFloat16:
      return scaleHalf<c10::BFloat16>(dst, n, divisor);
    case DataType::kFloat32:
      return scaleTyped<float>(dst, n, divisor);
    case DataType::kFloat64:
      return scaleTyped<double>(dst, n, divisor);
    default:
      return;  // avg on integers is rejected before any data moves
  }
}

}  // namespace resilient_comm::tcp
