// HcclApi: every libhccl call the HCCL transport makes, behind one interface.
//
// DlHcclApi resolves the functions with dlsym from the library loadHccl() finds; tests substitute
// FakeHccl (fake_hccl.h), a scripted implementation, so the communicator's state machine (an init
// that outlives its deadline, asynchronous errors, hung ops, a destroy that never returns,
// shrink from the world communicator) runs on CPU.
//
// Loading order: RESILIENT_COMM_HCCL_LIB, then libhccl.so from the default library search path
// (LD_LIBRARY_PATH, which the CANN toolkit's set_env.sh extends, and ld.so.cache).
//
// HCCL has no version call worth gating on; features follow the symbols the library exports, in
// one place, features(). A missing required symbol makes the library unusable; a missing
// optional one disables its feature (the op says so, or a fallback runs).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "transport/hccl/hccl_types.h"

namespace resilient_comm::hccl {

struct HcclFeatures {
  bool subComm = false;        // HcclCreateSubCommConfig: shrink/split from the world, no fresh init
  bool reduce = false;         // HcclReduce
  bool allToAllV = false;      // HcclAlltoAllV
  bool scatter = false;        // HcclScatter
  bool batchSendRecv = false;  // HcclBatchSendRecv: send/recv groups of more than one op
  bool suspend = false;        // HcclCommSuspend: run before destroying a failed communicator
  bool resume = false;         // HcclCommResume: reported, never used (a failed communicator stays failed)
};

class HcclApi {
 public:
  virtual ~HcclApi() = default;

  virtual std::string path() const = 0;
  virtual bool hasSymbol(const char* name) const = 0;
  // What this library can do (its symbols).
  HcclFeatures features() const;

  virtual HcclResult getRootInfo(HcclRootInfo* rootInfo) = 0;
  // Blocks until every rank joined (or HCCL's own connect timeout): run it off the caller's thread.
  virtual HcclResult commInitRootInfoConfig(uint32_t nRanks, const HcclRootInfo* rootInfo, uint32_t rank,
                                            const HcclCommConfig* config, HcclComm* comm) = 0;
  // Blocks like init; `world` is read, not written.
  virtual HcclResult createSubCommConfig(HcclComm* world, uint32_t rankNum, uint32_t* worldRankIds,
                                         uint64_t subCommId, uint32_t subCommRankId, HcclCommConfig* config,
                                         HcclComm* subComm) = 0;
  virtual HcclResult commDestroy(HcclComm comm) = 0;
  virtual HcclResult commSuspend(HcclComm comm) = 0;
  virtual HcclResult getCommAsyncError(HcclComm comm, HcclResult* asyncError) = 0;

  virtual HcclResult allReduce(void* send, void* recv, uint64_t count, HcclDataType dt, HcclReduceOp op,
                               HcclComm comm, aclrtStream stream) = 0;
  virtual HcclResult broadcast(void* buf, uint64_t count, HcclDataType dt, uint32_t root, HcclComm comm,
                               aclrtStream stream) = 0;
  virtual HcclResult reduce(void* send, void* recv, uint64_t count, HcclDataType dt, HcclReduceOp op,
                            uint32_t root, HcclComm comm, aclrtStream stream) = 0;
  virtual HcclResult allGather(void* send, void* recv, uint64_t sendCount, HcclDataType dt, HcclComm comm,
                               aclrtStream stream) = 0;
  virtual HcclResult reduceScatter(void* send, void* recv, uint64_t recvCount, HcclDataType dt, HcclReduceOp op,
                                   HcclComm comm, aclrtStream stream) = 0;
  virtual HcclResult scatter(void* send, void* recv, uint64_t recvCount, HcclDataType dt, uint32_t root,
                             HcclComm comm, aclrtStream stream) = 0;
  // Counts and displacements: one uint64_t per rank, in elements of the given type.
  virtual HcclResult allToAllV(const void* send, const uint64_t* sendCounts, const uint64_t* sendDispls,
                               HcclDataType sendType, const void* recv, const uint64_t* recvCounts,
                               const uint64_t* recvDispls, HcclDataType recvType, HcclComm comm,
                               aclrtStream stream) = 0;
  virtual HcclResult send(void* buf, uint64_t count, HcclDataType dt, uint32_t dest, HcclComm comm,
                          aclrtStream stream) = 0;
  virtual HcclResult recv(void* buf, uint64_t count, HcclDataType dt, uint32_t src, HcclComm comm,
                          aclrtStream stream) = 0;
  virtual HcclResult batchSendRecv(HcclSendRecvItem* items, uint32_t count, HcclComm comm, aclrtStream stream) = 0;
  virtual HcclResult barrier(HcclComm comm, aclrtStream stream) = 0;

  // HcclGetErrorString where the library has it, else the enumerator's name.
  virtual const char* getErrorString(HcclResult r) = 0;
};

// The enumerator's name ("HCCL_E_REMOTE"), for libraries without HcclGetErrorString.
const char* hcclResultName(HcclResult r);

// Loads libhccl (see the loading order above) and resolves its symbols. A success is kept for the
// life of the process; a failure is not (a later call tries again), and says what was tried:
// "no libhccl found: <path>: <why>; ... (set RESILIENT_COMM_HCCL_LIB or install the CANN toolkit)".
Result<std::shared_ptr<HcclApi>> loadHccl();

// Every symbol the HCCL transport resolves, required ones first.
const std::vector<const char*>& hcclSymbols();

}  // namespace resilient_comm::hccl
