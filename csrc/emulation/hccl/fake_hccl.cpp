#include "emulation/hccl/fake_hccl.h"

#include <cstring>

#include "emulation/device/scripted_streams.h"

namespace resilient_comm::hccl {

bool FakeHccl::hasSymbol(const char* name) const {
  static const char* optional[] = {"HcclCreateSubCommConfig", "HcclReduce",         "HcclAlltoAllV",
                                   "HcclScatter",             "HcclBatchSendRecv",  "HcclGetErrorString",
                                   "HcclCommSuspend",         "HcclCommResume"};
  for (const char* o : optional) {
    if (std::strcmp(o, name) == 0) {
      return !script_.missingOptionalSymbols;
    }
  }
  return true;
}

void FakeHccl::bump(std::atomic<int>& counter) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++counter;
  }
  cv_.notify_all();
}

void FakeHccl::blockUntilReleased() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return released_; });
}

void FakeHccl::release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
  }
  cv_.notify_all();
}

bool FakeHccl::waitFor(const std::function<bool()>& pred, std::chrono::milliseconds bound) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, bound, pred);
}

std::vector<uint32_t> FakeHccl::lastRankIds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lastRankIds_;
}

HcclComm FakeHccl::make(uint32_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  next_ += 16;
  comms_[next_] = size;
  return reinterpret_cast<HcclComm>(next_);
}

uint32_t FakeHccl::live(HcclComm comm) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = comms_.find(reinterpret_cast<uintptr_t>(comm));
    if (it != comms_.end()) {
      return it->second;
    }
  }
  bump(misuse);
  return 0;
}

std::function<Result<std::shared_ptr<device::StreamOps>>()> FakeHccl::streams() const {
  bool hang = script_.opsHang;
  return [hang]() -> Result<std::shared_ptr<device::StreamOps>> {
    return std::shared_ptr<device::StreamOps>(std::make_shared<device::ScriptedStreamOps>(hang));
  };
}

HcclResult FakeHccl::getRootInfo(HcclRootInfo* rootInfo) {
  std::lock_guard<std::mutex> lock(mu_);
  std::memset(rootInfo->internal, 0x5a, sizeof(rootInfo->internal));
  rootInfo->internal[0] = static_cast<char>(++rootInfos_);  // every root info differs
  return HCCL_SUCCESS;
}

HcclResult FakeHccl::commInitRootInfoConfig(uint32_t nRanks, const HcclRootInfo*, uint32_t rank,
                                            const HcclCommConfig* config, HcclComm* comm) {
  bump(inits);
  if (config == nullptr || config->size != sizeof(HcclCommConfig) || config->magicWord != kHcclCommConfigMagic ||
      config->version != 1 || config->hcclBufferSize == 0 || rank >= nRanks) {
    return HCCL_E_PARA;
  }
  if (script_.initBlocks) {
    blockUntilReleased();
  }
  *comm = make(nRanks);
  bump(initsReturned);
  return HCCL_SUCCESS;
}

HcclResult FakeHccl::createSubCommConfig(HcclComm* world, uint32_t rankNum, uint32_t* worldRankIds,
                                         uint64_t subCommId, uint32_t subCommRankId, HcclCommConfig*,
                                         HcclComm* subComm) {
  bump(subComms);
  const uint32_t worldSize = live(*world);
  if (worldSize == 0 || subCommRankId >= rankNum) {
    return HCCL_E_PARA;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    lastRankIds_.assign(worldRankIds, worldRankIds + rankNum);
    lastSubCommId = subCommId;
  }
  if (script_.subCommFails) {
    return HCCL_E_INTERNAL;
  }
  if (script_.initBlocks) {
    blockUntilReleased();
  }
  *subComm = make(rankNum);
  return HCCL_SUCCESS;
}

HcclResult FakeHccl::commDestroy(HcclComm comm) {
  bump(destroys);
  if (live(comm) == 0) {
    return HCCL_E_PARA;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    comms_.erase(reinterpret_cast<uintptr_t>(comm));
  }
  if (script_.destroyBlocks) {
    blockUntilReleased();
  }
  bump(destroysReturned);
  return HCCL_SUCCESS;
}

HcclResult FakeHccl::commSuspend(HcclComm comm) {
  bump(suspends);
  return live(comm) == 0 ? HCCL_E_PARA : HCCL_SUCCESS;
}

HcclResult FakeHccl::getCommAsyncError(HcclComm comm, HcclResult* asyncError) {
  if (live(comm) == 0) {
    return HCCL_E_PARA;
  }
  const bool broken = script_.asyncErrorAfterOps >= 0 && ops.load() > script_.asyncErrorAfterOps;
  *asyncError = broken ? HCCL_E_REMOTE : HCCL_SUCCESS;
  return HCCL_SUCCESS;
}

HcclResult FakeHccl::op(HcclComm comm, HcclDataType dt, int reduceOp) {
  if (live(comm) == 0) {
    return HCCL_E_PARA;
  }
  lastDataType = dt;
  lastReduceOp = reduceOp;
  bump(ops);
  return HCCL_SUCCESS;
}

HcclResult FakeHccl::allReduce(void*, void* recv, uint64_t count, HcclDataType dt, HcclReduceOp o, HcclComm comm,
                               aclrtStream) {
  const uint32_t size = live(comm);
  if (size != 0 && dt == HCCL_DATA_TYPE_FP32 && o == HCCL_REDUCE_SUM && recv != nullptr) {
    float* f = static_cast<float*>(recv);
    for (uint64_t i = 0; i < count; ++i) {
      f[i] *= static_cast<float>(size);
    }
  }
  return op(comm, dt, o);
}

HcclResult FakeHccl::broadcast(void*, uint64_t, HcclDataType dt, uint32_t, HcclComm comm, aclrtStream) {
  return op(comm, dt, -1);
}
HcclResult FakeHccl::reduce(void*, void*, uint64_t, HcclDataType dt, HcclReduceOp o, uint32_t, HcclComm comm,
                            aclrtStream) {
  return op(comm, dt, o);
}
HcclResult FakeHccl::allGather(void*, void*, uint64_t, HcclDataType dt, HcclComm comm, aclrtStream) {
  return op(comm, dt, -1);
}
HcclResult FakeHccl::reduceScatter(void*, void*, uint64_t, HcclDataType dt, HcclReduceOp o, HcclComm comm,
                                   aclrtStream) {
  return op(comm, dt, o);
}
HcclResult FakeHccl::scatter(void*, void*, uint64_t, HcclDataType dt, uint32_t, HcclComm comm, aclrtStream) {
  return op(comm, dt, -1);
}
HcclResult FakeHccl::allToAllV(const void*, const uint64_t*, const uint64_t*, HcclDataType dt, const void*,
                               const uint64_t*, const uint64_t*, HcclDataType, HcclComm comm, aclrtStream) {
  return op(comm, dt, -1);
}
HcclResult FakeHccl::send(void*, uint64_t, HcclDataType dt, uint32_t, HcclComm comm, aclrtStream) {
  return op(comm, dt, -1);
}
HcclResult FakeHccl::recv(void*, uint64_t, HcclDataType dt, uint32_t, HcclComm comm, aclrtStream) {
  return op(comm, dt, -1);
}
HcclResult FakeHccl::batchSendRecv(HcclSendRecvItem* items, uint32_t count, HcclComm comm, aclrtStream) {
  bump(batches);
  return op(comm, count > 0 ? items[0].dataType : HCCL_DATA_TYPE_UINT8, -1);
}
HcclResult FakeHccl::barrier(HcclComm comm, aclrtStream) {
  return op(comm, HCCL_DATA_TYPE_UINT8, -1);
}

const char* FakeHccl::getErrorString(HcclResult r) {
  return r == HCCL_E_REMOTE ? "an error completion from a remote rank (fake)" : hcclResultName(r);
}

}  // namespace resilient_comm::hccl
