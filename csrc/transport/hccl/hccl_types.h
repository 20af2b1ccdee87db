// Our own declarations of the few HCCL types the HCCL transport uses, so nothing here needs
// hccl.h, hccl_types.h or any other CANN header at build time. Values and layouts follow HCCL's
// public C API as CANN 7/8 document it; the sizes the library relies on are checked below.
// Nothing in this file has been checked against a real libhccl (docs/hccl.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace resilient_comm::hccl {

using HcclComm = void*;
using aclrtStream = void*;

constexpr size_t kHcclRootInfoBytes = 4108;

// What HcclGetRootInfo makes on the root and every member passes to HcclCommInitRootInfoConfig.
struct HcclRootInfo {
  char internal[kHcclRootInfoBytes];
};
static_assert(sizeof(HcclRootInfo) == 4108, "HcclRootInfo is 4108 bytes");

enum HcclResult : int {
  HCCL_SUCCESS = 0,
  HCCL_E_PARA = 1,
  HCCL_E_PTR = 2,
  HCCL_E_MEMORY = 3,
  HCCL_E_INTERNAL = 4,
  HCCL_E_NOT_SUPPORT = 5,
  HCCL_E_NOT_FOUND = 6,
  HCCL_E_UNAVAIL = 7,
  HCCL_E_SYSCALL = 8,
  HCCL_E_TIMEOUT = 9,
  HCCL_E_OPEN_FILE_FAILURE = 10,
  HCCL_E_TCP_CONNECT = 11,
  HCCL_E_ROCE_CONNECT = 12,
  HCCL_E_TCP_TRANSFER = 13,
  HCCL_E_ROCE_TRANSFER = 14,
  HCCL_E_RUNTIME = 15,
  HCCL_E_DRV = 16,
  HCCL_E_PROFILING = 17,
  HCCL_E_CCE = 18,
  HCCL_E_NETWORK = 19,
  HCCL_E_AGAIN = 20,
  HCCL_E_REMOTE = 21,  // an error completion from a peer
  HCCL_E_SUSPENDING = 22,
  HCCL_E_OPRETRY_FAIL = 23,
  HCCL_E_OOM = 24,
};

enum HcclDataType : int {
  HCCL_DATA_TYPE_INT8 = 0,
  HCCL_DATA_TYPE_INT16 = 1,
  HCCL_DATA_TYPE_INT32 = 2,
  HCCL_DATA_TYPE_FP16 = 3,
  HCCL_DATA_TYPE_FP32 = 4,
  HCCL_DATA_TYPE_INT64 = 5,
  HCCL_DATA_TYPE_UINT64 = 6,
  HCCL_DATA_TYPE_UINT8 = 7,
  HCCL_DATA_TYPE_UINT16 = 8,
  HCCL_DATA_TYPE_UINT32 = 9,
  HCCL_DATA_TYPE_FP64 = 10,
  HCCL_DATA_TYPE_BFP16 = 11,
};

// HCCL has no average.
enum HcclReduceOp : int { HCCL_REDUCE_SUM = 0, HCCL_REDUCE_PROD = 1, HCCL_REDUCE_MAX = 2, HCCL_REDUCE_MIN = 3 };

enum HcclSendRecvType : int { HCCL_SEND = 0, HCCL_RECV = 1 };

// One entry of HcclBatchSendRecv.
struct HcclSendRecvItem {
  HcclSendRecvType sendRecvType;
  void* buf;
  uint64_t count;
  HcclDataType dataType;
  uint32_t remoteRank;
};
static_assert(sizeof(HcclSendRecvItem) == 32, "HcclSendRecvItem is 32 bytes on LP64");

constexpr uint32_t kHcclCommConfigMagic = 0xf0f0f0f0;
constexpr uint32_t kHcclDefaultBufferMb = 200;  // HCCL's documented default CCL buffer

// The leading fields of HcclCommConfig, version 1: a 24-byte header (size, magic word, version,
// reserved) then the CCL buffer size in MB and the deterministic switch. HCCL copies `size`
// bytes and reads only the fields its `version` promises, so this prefix is valid for every
// later library. (Later versions add a name, op expansion mode, QoS, ...; the name stays unset
// on purpose: HCCL then makes a unique one, and a group rebuilt under the same name while its
// predecessor is still being torn down would collide.)
struct HcclCommConfigV1 {
  size_t size;
  uint32_t magicWord;
  uint32_t version;
  uint64_t reserved;
  uint32_t hcclBufferSize;
  uint32_t hcclDeterministic;
};
static_assert(sizeof(HcclCommConfigV1) == 32, "the 24-byte header and two 32-bit fields");
using HcclCommConfig = HcclCommConfigV1;

// Every communicator's config. Version 1 has no "not set" value, so the buffer size is HCCL's
// documented default and determinism is off, whatever HCCL_BUFFSIZE / HCCL_DETERMINISTIC say.
inline HcclCommConfig commConfig() {
  HcclCommConfig c{};
  c.size = sizeof(HcclCommConfig);
  c.magicWord = kHcclCommConfigMagic;
  c.version = 1;
  c.reserved = 0;
  c.hcclBufferSize = kHcclDefaultBufferMb;
  c.hcclDeterministic = 0;
  return c;
}

}  // namespace resilient_comm::hccl
