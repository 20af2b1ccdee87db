// Element types and reduction ops as the transports see them. The backend maps
// at::ScalarType and c10d::ReduceOp onto these; transports never include ATen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace resilient_comm {

enum class DataType : uint8_t {
  kInt8 = 0,
  kUInt8,
  kInt16,
  kInt32,
  kInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
  kBool,
};

enum class RedOp : uint8_t { kSum = 0, kProd, kMin, kMax, kAvg };

size_t dataTypeSize(DataType t);
const char* dataTypeName(DataType t);
const char* redOpName(RedOp op);
bool isFloatingPoint(DataType t);

// The collective kinds, as named in error messages and carried in wire headers.
enum class OpKind : uint8_t {
  kAllReduce = 1,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kGather,
  kScatter,
  kBarrier,
  kSendRecv,
};
const char* opKindName(OpKind op);

}  // namespace resilient_comm
