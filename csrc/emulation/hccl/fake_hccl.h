// FakeHccl: a scripted HcclApi for CPU tests of the HCCL communicator's state machine. Not a
// simulator of collectives: ops complete (or hang, or fail) as the script says and data is left
// as it was, except all_reduce SUM on float32, which multiplies by the communicator size as if
// every rank held the same data. Handles are tracked: a call on a communicator that was never
// made or was already destroyed counts as `misuse`.
//
// Threads: the script is set before use; counters may be read from any thread; waitFor() wakes
// whenever one moves.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/hccl/hccl_api.h"
#include "device/stream_ops.h"

namespace resilient_comm::hccl {

struct FakeHcclScript {
  bool initBlocks = false;          // init and sub-communicator creation block until release()
  bool destroyBlocks = false;       // HcclCommDestroy blocks until release()
  int asyncErrorAfterOps = -1;      // HcclGetCommAsyncError answers HCCL_E_REMOTE once this many ops ran
  bool opsHang = false;             // the streams' events never complete
  bool subCommFails = false;        // HcclCreateSubCommConfig answers HCCL_E_INTERNAL
  bool missingOptionalSymbols = false;  // as if the library had only the required symbols
};

class FakeHccl : public HcclApi {
 public:
  explicit FakeHccl(FakeHcclScript script) : script_(script) {}

  std::string path() const override {
    return "fake";
  }
  bool hasSymbol(const char* name) const override;

  HcclResult getRootInfo(HcclRootInfo* rootInfo) override;
  HcclResult commInitRootInfoConfig(uint32_t nRanks, const HcclRootInfo* rootInfo, uint32_t rank,
                                    const HcclCommConfig* config, HcclComm* comm) override;
  HcclResult createSubCommConfig(HcclComm* world, uint32_t rankNum, uint32_t* worldRankIds, uint64_t subCommId,
                                 uint32_t subCommRankId, HcclCommConfig* config, HcclComm* subComm) override;
  HcclResult commDestroy(HcclComm comm) override;
  HcclResult commSuspend(HcclComm comm) override;
  HcclResult getCommAsyncError(HcclComm comm, HcclResult* asyncError) override;
  HcclResult allReduce(void* send, void* recv, uint64_t count, HcclDataType dt, HcclReduceOp op, HcclComm comm,
                       aclrtStream stream) override;
  HcclResult broadcast(void* buf, uint64_t count, HcclDataType dt, uint32_t root, HcclComm comm,
                       aclrtStream stream) override;
  HcclResult reduce(void* send, void* recv, uint64_t count, HcclDataType dt, HcclReduceOp op, uint32_t root,
                    HcclComm comm, aclrtStream stream) override;
  HcclResult allGather(void* send, void* recv, uint64_t sendCount, HcclDataType dt, HcclComm comm,
                       aclrtStream stream) override;
  HcclResult reduceScatter(void* send, void* recv, uint64_t recvCount, HcclDataType dt, HcclReduceOp op,
                           HcclComm comm, aclrtStream stream) override;
  HcclResult scatter(void* send, void* recv, uint64_t recvCount, HcclDataType dt, uint32_t root, HcclComm comm,
                     aclrtStream stream) override;
  HcclResult allToAllV(const void* send, const uint64_t* sendCounts, const uint64_t* sendDispls,
                       HcclDataType sendType, const void* recv, const uint64_t* recvCounts,
                       const uint64_t* recvDispls, HcclDataType recvType, HcclComm comm,
                       aclrtStream stream) override;
  HcclResult send(void* buf, uint64_t count, HcclDataType dt, uint32_t dest, HcclComm comm,
                  aclrtStream stream) override;
  HcclResult recv(void* buf, uint64_t count, HcclDataType dt, uint32_t src, HcclComm comm,
                  aclrtStream stream) override;
  HcclResult batchSendRecv(HcclSendRecvItem* items, uint32_t count, HcclComm comm, aclrtStream stream) override;
  HcclResult barrier(HcclComm comm, aclrtStream stream) override;
  const char* getErrorString(HcclResult r) override;

  // For HcclOptions::makeStreams: device::ScriptedStreamOps whose ops hang when the script says so.
  std::function<Result<std::shared_ptr<device::StreamOps>>()> streams() const;
  // Unblocks every init, sub-communicator creation and destroy held by the script.
  void release();
  // Waits up to `bound` for pred() to hold; re-checked whenever a counter moves.
  bool waitFor(const std::function<bool()>& pred, std::chrono::milliseconds bound);
  std::vector<uint32_t> lastRankIds() const;

  std::atomic<int> inits{0}, initsReturned{0}, subComms{0}, destroys{0}, destroysReturned{0}, suspends{0}, ops{0},
      batches{0}, misuse{0};
  std::atomic<uint64_t> lastSubCommId{0};
  std::atomic<int> lastDataType{-1}, lastReduceOp{-1};

 private:
  HcclComm make(uint32_t size);
  // The size of a live communicator; 0 (and a misuse) for anything else.
  uint32_t live(HcclComm comm);
  HcclResult op(HcclComm comm, HcclDataType dt, int reduceOp);
  void bump(std::atomic<int>& counter);
  void blockUntilReleased();

  FakeHcclScript script_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
  std::unordered_map<uintptr_t, uint32_t> comms_;  // live handle -> size
  uintptr_t next_ = 0x1000;
  uint8_t rootInfos_ = 0;
  std::vector<uint32_t> lastRankIds_;
};

}  // namespace resilient_comm::hccl
