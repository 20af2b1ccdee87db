// Our own declarations of the few NCCL types we use, so nothing here needs nccl.h or CUDA
// headers at build time. Values and layouts follow NCCL's public API (stable since 2.18);
// tests/cpp/test_nccl_abi.cpp compiles them against the real nccl.h of the nvidia-nccl wheel and
// checks every size, value, field offset and function signature.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

namespace resilient_comm::nccl {

struct ncclComm;
using ncclComm_t = ncclComm*;
struct CUstream_st;  // a distinct type, as CUDA's (the ABI test maps it onto the real one)
using cudaStream_t = CUstream_st*;

struct ncclUniqueId {
  char internal[128];
};

enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclTimeout = 8,  // 2.25+
};

enum ncclDataType_t : int {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,  // 2.24+
  ncclFloat8e5m2 = 11,
};

// Ops from ncclNumOps on are a communicator's own (ncclRedOpCreatePreMulSum, not used: PREMUL_SUM
// scales the input, then sums).
enum ncclRedOp_t : int { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 };


constexpr int kNcclSplitNoColor = -1;
constexpr int kNcclShrinkDefault = 0;
constexpr int kNcclShrinkAbort = 1;
constexpr int kNcclRevokeDefault = 0;
constexpr unsigned int kNcclApiMagic = 0xcafebeef;
constexpr int kNcclConfigUndefInt = INT_MIN;

// NCCL's version code: 2.x with x <= 8 used X*1000+Y*100+Z, later ones X*10000+Y*100+Z.
constexpr int ncclVersionCode(int x, int y, int z) {
  return (x <= 2 && y <= 8) ? x * 1000 + y * 100 + z : x * 10000 + y * 100 + z;
}

// The leading fields of ncclConfig_t as of NCCL 2.18. NCCL copies `size` bytes of a caller's
// config over its defaults and ignores fields newer than `version` (init.cc parseCommConfig), so
// passing this prefix is valid for every later release. `size` covers the fields only, not the
// struct's tail padding (which would overlap the next real field).
struct ncclConfig_v21800 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
};
using ncclConfig_t = ncclConfig_v21800;

// A config for a non-blocking communicator (everything else left to NCCL's defaults).
inline ncclConfig_t nonBlockingConfig() {
  ncclConfig_t c{};
  c.size = offsetof(ncclConfig_t, splitShare) + sizeof(c.splitShare);
  c.magic = kNcclApiMagic;
  c.version = static_cast<unsigned int>(ncclVersionCode(2, 18, 0));
  c.blocking = 0;
  c.cgaClusterSize = kNcclConfigUndefInt;
  c.minCTAs = kNcclConfigUndefInt;
  c.maxCTAs = kNcclConfigUndefInt;
  c.netName = nullptr;
  c.splitShare = kNcclConfigUndefInt;
  return c;
}

}  // namespace resilient_comm::nccl
