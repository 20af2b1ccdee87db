// FakeNccl: a scripted NcclApi for CPU tests of the NCCL communicator's state machine, and
// FakeStreamOps, its stream. Not a simulator of collectives: ops complete (or hang, or fail)
// as the script says, and data is left as it was, except all_reduce SUM, which multiplies by
// the communicator size as if every rank held the same data.
//
// Threads: the script is set before use; counters may be read from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "transport/nccl/nccl_api.h"
#include "transport/nccl/stream_ops.h"

namespace resilient_comm::nccl {

struct FakeScript {
  int version = ncclVersionCode(2, 29, 0);
  int initPolls = 0;                      // ncclInProgress answers before an init/child is ready
  bool initNeverCompletes = false;
  int remoteErrorAfterOps = -1;           // async ncclRemoteError once this many ops were enqueued
  bool opsHang = false;                   // stream events never complete
  bool abortHangs = false;                // ncclCommAbort blocks until release()
  bool shrinkFails = false;
  bool missingOptionalSymbols = false;    // as if the library lacked split/shrink/revoke/grow
};

class FakeNccl : public NcclApi {
 public:
  explicit FakeNccl(FakeScript script) : script_(script) {}

  int version() const override {
    return script_.version;
  }
  std::string path() const override {
    return "fake";
  }
  bool hasSymbol(const char* name) const override;

  ncclResult_t getUniqueId(ncclUniqueId* id) override;
  ncclResult_t commInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* c) override;
  ncclResult_t commGetAsyncError(ncclComm_t comm, ncclResult_t* err) override;
  ncclResult_t commAbort(ncclComm_t comm) override;
  ncclResult_t commDestroy(ncclComm_t comm) override;
  ncclResult_t commFinalize(ncclComm_t comm) override;
  ncclResult_t commSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t* c) override;
  ncclResult_t commShrink(ncclComm_t comm, int* ex, int n, ncclComm_t* out, ncclConfig_t* c, int flags) override;
  ncclResult_t commRevoke(ncclComm_t comm, int flags) override;
  ncclResult_t commGetUniqueId(ncclComm_t comm, ncclUniqueId* id) override;
  ncclResult_t commGrow(ncclComm_t comm, int n, const ncclUniqueId* id, int rank, ncclComm_t* out,
                        ncclConfig_t* c) override;
  ncclResult_t allReduce(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                         cudaStream_t st) override;
  ncclResult_t broadcast(const void* s, void* r, size_t n, ncclDataType_t dt, int root, ncclComm_t comm,
                         cudaStream_t st) override;
  ncclResult_t reduce(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t comm,
                      cudaStream_t st) override;
  ncclResult_t allGather(const void* s, void* r, size_t n, ncclDataType_t dt, ncclComm_t comm,
                         cudaStream_t st) override;
  ncclResult_t reduceScatter(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                             cudaStream_t st) override;
  ncclResult_t send(const void* b, size_t n, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t st) override;
  ncclResult_t recv(void* b, size_t n, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t st) override;
  ncclResult_t groupStart() override;
  ncclResult_t groupEnd() override;
  const char* getErrorString(ncclResult_t r) override;
  const char* getLastError(ncclComm_t comm) override;

  // Unblocks an abort held by abortHangs.
  void release();

  std::atomic<int> inits{0}, aborts{0}, destroys{0}, finalizes{0}, shrinks{0}, splits{0}, grows{0}, ops{0};
  std::atomic<int> lastShrinkFlags{-1};

 private:
  struct Comm {
    int size;
    int pollsLeft;
  };
  ncclComm_t make(int size);
  ncclResult_t enqueue();

  FakeScript script_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
};

class FakeStreamOps : public StreamOps {
 public:
  explicit FakeStreamOps(const FakeScript& script) : hang_(script.opsHang) {}
  void makeCurrent() override {}
  void* nativeStream() override {
    return nullptr;
  }
  void followCaller() override {}
  uint64_t record() override {
    return ++recorded_;
  }
  bool done(uint64_t) override {
    return !hang_;
  }
  void* scratch(size_t bytes) override;

 private:
  bool hang_;
  uint64_t recorded_ = 0;
  std::string scratch_;
};

}  // namespace resilient_comm::nccl
