// NcclApi: every libnccl call the NCCL transport makes, behind one interface.
//
// DlNcclApi resolves the functions with dlsym from the library found by loadNccl(); CPU tests and
// RESILIENT_COMM_NCCL_EMULATE=1 substitute the NCCL emulator (nccl_emulator.h), which models the
// real library's non-blocking semantics and moves real bytes between processes.
//
// The functions are declared once, in RC_NCCL_API below: the interface, the dlsym table and the
// ABI test (tests/cpp/test_nccl_abi.cpp, which checks each signature against the real nccl.h)
// are generated from it.
//
// Loading order: RESILIENT_COMM_NCCL_LIB; the libnccl torch already loaded (RTLD_NOLOAD); then
// the candidate paths the caller passes (the Python layer finds nvidia-nccl wheels).
//
// Features are gated on ncclGetVersion in one place, features(): non-blocking init and abort
// (2.14), split (2.18), shrink (2.27), revoke (2.28.7), grow (2.29), several ranks per GPU (2.30,
// with NCCL_MULTI_RANK_GPU_ENABLE=1). An optional symbol that is missing disables its feature
// even when the version says otherwise.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "transport/nccl/nccl_types.h"

namespace resilient_comm::nccl {

// X(symbol, method, required, (parameters), (arguments)); every one returns ncclResult_t.
// A library without a required symbol is not used; a missing optional one disables its feature.
#define RC_NCCL_API(X)                                                                                          \
  X(ncclGetUniqueId, getUniqueId, true, (ncclUniqueId * id), (id))                                               \
  X(ncclCommInitRankConfig, commInitRankConfig, true,                                                            \
    (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config), (comm, nranks, id, rank, config)) \
  X(ncclCommGetAsyncError, commGetAsyncError, true, (ncclComm_t comm, ncclResult_t * err), (comm, err))          \
  X(ncclCommAbort, commAbort, true, (ncclComm_t comm), (comm))                                                   \
  X(ncclCommDestroy, commDestroy, true, (ncclComm_t comm), (comm))                                               \
  X(ncclCommFinalize, commFinalize, true, (ncclComm_t comm), (comm))                                             \
  X(ncclAllReduce, allReduce, true,                                                                              \
    (const void* send, void* recv, size_t count, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,              \
     cudaStream_t stream),                                                                                       \
    (send, recv, count, dt, op, comm, stream))                                                                   \
  X(ncclBroadcast, broadcast, true,                                                                              \
    (const void* send, void* recv, size_t count, ncclDataType_t dt, int root, ncclComm_t comm, cudaStream_t stream), \
    (send, recv, count, dt, root, comm, stream))                                                                 \
  X(ncclReduce, reduce, true,                                                                                    \
    (const void* send, void* recv, size_t count, ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t comm,    \
     cudaStream_t stream),                                                                                       \
    (send, recv, count, dt, op, root, comm, stream))                                                             \
  X(ncclAllGather, allGather, true,                                                                              \
    (const void* send, void* recv, size_t sendCount, ncclDataType_t dt, ncclComm_t comm, cudaStream_t stream),    \
    (send, recv, sendCount, dt, comm, stream))                                                                   \
  X(ncclReduceScatter, reduceScatter, true,                                                                      \
    (const void* send, void* recv, size_t recvCount, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,          \
     cudaStream_t stream),                                                                                       \
    (send, recv, recvCount, dt, op, comm, stream))                                                               \
  X(ncclSend, send, true,                                                                                        \
    (const void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream),           \
    (buf, count, dt, peer, comm, stream))                                                                        \
  X(ncclRecv, recv, true, (void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream), \
    (buf, count, dt, peer, comm, stream))                                                                        \
  X(ncclGroupStart, groupStart, true, (), ())                                                                    \
  X(ncclGroupEnd, groupEnd, true, (), ())                                                                        \
  X(ncclCommSplit, commSplit, false, (ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t* config), \
    (comm, color, key, out, config))                                                                             \
  X(ncclCommShrink, commShrink, false,                                                                           \
    (ncclComm_t comm, int* exclude, int count, ncclComm_t* out, ncclConfig_t* config, int flags),                 \
    (comm, exclude, count, out, config, flags))                                                                  \
  X(ncclCommRevoke, commRevoke, false, (ncclComm_t comm, int flags), (comm, flags))                              \
  X(ncclCommGetUniqueId, commGetUniqueId, false, (ncclComm_t comm, ncclUniqueId * id), (comm, id))               \
  X(ncclCommGrow, commGrow, false,                                                                               \
    (ncclComm_t comm, int nranks, const ncclUniqueId* id, int rank, ncclComm_t* out, ncclConfig_t* config),       \
    (comm, nranks, id, rank, out, config))

// The function types, by symbol (sig::ncclAllReduce, ...), plus the three that do not return
// ncclResult_t.
namespace sig {
#define RC_NCCL_SIG(symbol, method, required, params, args) using symbol = ncclResult_t params;
RC_NCCL_API(RC_NCCL_SIG)
#undef RC_NCCL_SIG
using ncclGetVersion = ncclResult_t(int* version);
using ncclGetErrorString = const char*(ncclResult_t result);
using ncclGetLastError = const char*(ncclComm_t comm);
}  // namespace sig

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

#define RC_NCCL_METHOD(symbol, method, required, params, args) virtual ncclResult_t method params = 0;
  RC_NCCL_API(RC_NCCL_METHOD)
#undef RC_NCCL_METHOD

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
