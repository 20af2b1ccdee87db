// Our own declarations of the few NCCL types we use, so nothing here needs nccl.h or CUDA
// headers at build time. Values and layouts follow NCCL's public API (stable since 2.18).
#pragma once

#include <climits>
#include <cstddef>

namespace resilient_comm::nccl {

using ncclComm_t = struct ncclComm*;
using cudaStream_t = void*;

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
};

enum ncclRedOp_t : int { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };

constexpr int kNcclSplitNoColor = -1;
constexpr int kNcclShrinkDefault = 0;
constexpr int kNcclShrinkAbort = 1;
constexpr unsigned int kNcclApiMagic = 0xcafebeef;
constexpr int kNcclConfigUndefInt = INT_MIN;

// NCCL's version code: 2.x with x <= 8 used X*1000+Y*100+Z, later ones X*10000+Y*100+Z.
constexpr int ncclVersionCode(int x, int y, int z) {
  return (x <= 2 && y <= 8) ? x * 1000 + y * 100 + z : x * 10000 + y * 100 + z;
}

// The leading fields of ncclConfig_t as of NCCL 2.18. NCCL reads `size` and `version` to
// know which fields a caller's struct has, so passing this prefix is valid for every later
// release.
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
  c.size = sizeof(ncclConfig_t);
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
