#include "transport/nccl/fake_nccl.h"


#include <cstring>

namespace resilient_comm::nccl {

namespace {
struct FakeComm {
  int size;
  int pollsLeft;
  bool never;
};
FakeComm* of(ncclComm_t c) {
  return reinterpret_cast<FakeComm*>(c);
}
}  // namespace

bool FakeNccl::hasSymbol(const char* name) const {
  static const char* optional[] = {"ncclCommSplit", "ncclCommShrink", "ncclCommRevoke", "ncclCommGetUniqueId",
                                   "ncclCommGrow"};
  for (const char* o : optional) {
    if (std::strcmp(o, name) == 0) {
      return !script_.missingOptionalSymbols;
    }
  }
  return true;
}

ncclComm_t FakeNccl::make(int size) {
  // Leaked on purpose: a fake handle may be polled by a detached thread after the test ends.
  return reinterpret_cast<ncclComm_t>(new FakeComm{size, script_.initPolls, script_.initNeverCompletes});
}

ncclResult_t FakeNccl::getUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0x5a, sizeof(id->internal));
  return ncclSuccess;
}

ncclResult_t FakeNccl::commInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId, int, ncclConfig_t* c) {
  ++inits;
  *comm = make(nranks);
  return c != nullptr && c->blocking == 0 ? ncclInProgress : ncclSuccess;
}

ncclResult_t FakeNccl::commGetAsyncError(ncclComm_t comm, ncclResult_t* err) {
  FakeComm* f = of(comm);
  if (f->never) {
    *err = ncclInProgress;
  } else if (f->pollsLeft > 0) {
    --f->pollsLeft;
    *err = ncclInProgress;
  } else if (script_.remoteErrorAfterOps >= 0 && ops.load() > script_.remoteErrorAfterOps) {
    *err = ncclRemoteError;
  } else {
    *err = ncclSuccess;
  }
  return ncclSuccess;
}

ncclResult_t FakeNccl::commAbort(ncclComm_t) {
  ++aborts;
  if (script_.abortHangs) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return released_; });
  }
  return ncclSuccess;
}

void FakeNccl::release() {
  std::lock_guard<std::mutex> lock(mu_);
  released_ = true;
  cv_.notify_all();
}

ncclResult_t FakeNccl::commDestroy(ncclComm_t) {
  ++destroys;
  return ncclSuccess;
}

ncclResult_t FakeNccl::commFinalize(ncclComm_t) {
  ++finalizes;
  return ncclSuccess;
}

ncclResult_t FakeNccl::commSplit(ncclComm_t comm, int color, int, ncclComm_t* out, ncclConfig_t*) {
  ++splits;
  *out = color == kNcclSplitNoColor ? nullptr : make(of(comm)->size);
  return ncclSuccess;
}

ncclResult_t FakeNccl::commShrink(ncclComm_t comm, int*, int n, ncclComm_t* out, ncclConfig_t*, int flags) {
  ++shrinks;
  lastShrinkFlags = flags;
  if (script_.shrinkFails) {
    return ncclInternalError;
  }
  *out = make(of(comm)->size - n);
  return ncclSuccess;
}

ncclResult_t FakeNccl::commRevoke(ncclComm_t, int) {
  return ncclSuccess;
}

ncclResult_t FakeNccl::commGetUniqueId(ncclComm_t, ncclUniqueId* id) {
  return getUniqueId(id);
}

ncclResult_t FakeNccl::commGrow(ncclComm_t, int n, const ncclUniqueId*, int, ncclComm_t* out, ncclConfig_t*) {
  ++grows;
  *out = make(n);
  return ncclSuccess;
}

ncclResult_t FakeNccl::enqueue() {
  ++ops;
  return ncclSuccess;
}

ncclResult_t FakeNccl::allReduce(const void*, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                                 cudaStream_t) {
  if (dt == ncclFloat32 && op == ncclSum && r != nullptr) {
    float* f = static_cast<float*>(r);
    for (size_t i = 0; i < n; ++i) {
      f[i] *= static_cast<float>(of(comm)->size);
    }
  }
  return enqueue();
}

ncclResult_t FakeNccl::broadcast(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
  return enqueue();
}
ncclResult_t FakeNccl::reduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                              cudaStream_t) {
  return enqueue();
}
ncclResult_t FakeNccl::allGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) {
  return enqueue();
}
ncclResult_t FakeNccl::reduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                     cudaStream_t) {
  return enqueue();
}
ncclResult_t FakeNccl::send(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
  return ncclSuccess;
}
ncclResult_t FakeNccl::recv(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
  return ncclSuccess;
}
ncclResult_t FakeNccl::groupStart() {
  return ncclSuccess;
}
ncclResult_t FakeNccl::groupEnd() {
  return enqueue();
}

const char* FakeNccl::getErrorString(ncclResult_t r) {
  switch (r) {
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInternalError:
      return "internal error";
    default:
      return "fake error";
  }
}

const char* FakeNccl::getLastError(ncclComm_t) {
  return "";
}

void* FakeStreamOps::scratch(size_t bytes) {
  if (scratch_.size() < bytes) {
    scratch_.resize(bytes);
  }
  return scratch_.data();
}

}  // namespace resilient_comm::nccl
