// NcclApi: every libnccl call the NCCL transport makes, behind one interface.
//
// DlNcclApi resolves the functions with dlsym from the library found by loadNccl(); tests
// substitute FakeNccl (fake_nccl.h), a scripted implementation, so the communicator's state
// machine (init in progress, remote errors, hung ops, stuck aborts, shrink) runs on CPU.
//
// Loading order: RESILIENT_COMM_NCCL_LIB; the libnccl torch already loaded (RTLD_NOLOAD);
// then the candidate paths the caller passes (the Python layer finds nvidia-nccl wheels).
//
// Features are gated on ncclGetVersion in one place, features(): non-blocking init and abort
// (2.14), split (2.18), shrink (2.27), revoke (2.28), grow (2.29), several ranks per GPU
// (2.30, with NCCL_MULTI_RANK_GPU_ENABLE=1). An optional symbol that is missing disables its
// feature even when the version says otherwise.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "transport/nccl/nccl_types.h"

namespace resilient_comm::nccl {

struct NcclFeatures {
  bool nonBlockingInit = false;  // and ncclCommAbort / ncclCommGetAsyncError
  bool split = false;
  bool shrink = false;
  bool revoke = false;
  bool grow = false;
  bool multiRankPerDevice = false;
};

class NcclApi {
 public:
  virtual ~NcclApi() = default;

  virtual int version() const = 0;  // ncclGetVersion's code
  virtual std::string path() const = 0;
  virtual bool hasSymbol(const char* name) const = 0;
  // What this library can do (version and symbols).
  NcclFeatures features() const;
  std::string versionString() const;

  virtual ncclResult_t getUniqueId(ncclUniqueId* id) = 0;
  virtual ncclResult_t commInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                          ncclConfig_t* config) = 0;
  virtual ncclResult_t commGetAsyncError(ncclComm_t comm, ncclResult_t* err) = 0;
  virtual ncclResult_t commAbort(ncclComm_t comm) = 0;
  virtual ncclResult_t commDestroy(ncclComm_t comm) = 0;
  virtual ncclResult_t commFinalize(ncclComm_t comm) = 0;
  virtual ncclResult_t commSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t* config) = 0;
  virtual ncclResult_t commShrink(ncclComm_t comm, int* exclude, int count, ncclComm_t* out, ncclConfig_t* config,
                                  int flags) = 0;
  virtual ncclResult_t commRevoke(ncclComm_t comm, int flags) = 0;
  virtual ncclResult_t commGetUniqueId(ncclComm_t comm, ncclUniqueId* id) = 0;
  virtual ncclResult_t commGrow(ncclComm_t comm, int nranks, const ncclUniqueId* id, int rank, ncclComm_t* out,
                                ncclConfig_t* config) = 0;

  virtual ncclResult_t allReduce(const void* send, void* recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                                 ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t broadcast(const void* send, void* recv, size_t count, ncclDataType_t dt, int root,
                                 ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t reduce(const void* send, void* recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                              int root, ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t allGather(const void* send, void* recv, size_t sendCount, ncclDataType_t dt, ncclComm_t comm,
                                 cudaStream_t stream) = 0;
  virtual ncclResult_t reduceScatter(const void* send, void* recv, size_t recvCount, ncclDataType_t dt,
                                     ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t send(const void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                            cudaStream_t stream) = 0;
  virtual ncclResult_t recv(void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                            cudaStream_t stream) = 0;
  virtual ncclResult_t groupStart() = 0;
  virtual ncclResult_t groupEnd() = 0;

  virtual const char* getErrorString(ncclResult_t r) = 0;
  virtual const char* getLastError(ncclComm_t comm) = 0;
};

// Loads libnccl (see the loading order above) and resolves its symbols; `candidates` come
// after those set by setNcclCandidates(). The library stays loaded for the life of the process.
Result<std::shared_ptr<NcclApi>> loadNccl(const std::vector<std::string>& candidates);
// Library paths to try after RESILIENT_COMM_NCCL_LIB and torch's (the Python package sets the
// nvidia-nccl wheels' paths at import).
void setNcclCandidates(std::vector<std::string> paths);

// Every symbol the NCCL transport resolves, required ones first.
const std::vector<const char*>& ncclSymbols();

}  // namespace resilient_comm::nccl
