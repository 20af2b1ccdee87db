#include "transport/hccl/hccl_api.h"

#include <mutex>
#include <utility>

#include "common/env.h"
#include "common/logging.h"
#include "common/vendor_library.h"

namespace resilient_comm::hccl {

namespace {

// Every symbol the transport resolves, required ones first; a library without a required one
// is not used, a missing optional one disables its feature (features()).
const std::vector<VendorSymbol>& symbolTable() {
  static const std::vector<VendorSymbol> table = {
      {"HcclGetRootInfo", true},
      {"HcclCommInitRootInfoConfig", true},
      {"HcclCommDestroy", true},
      {"HcclGetCommAsyncError", true},
      {"HcclAllReduce", true},
      {"HcclBroadcast", true},
      {"HcclAllGather", true},
      {"HcclReduceScatter", true},
      {"HcclSend", true},
      {"HcclRecv", true},
      {"HcclBarrier", true},
      {"HcclCreateSubCommConfig", false},
      {"HcclReduce", false},
      {"HcclAlltoAllV", false},
      {"HcclScatter", false},
      {"HcclBatchSendRecv", false},
      {"HcclGetErrorString", false},
      {"HcclCommSuspend", false},
      {"HcclCommResume", false},
  };
  return table;
}

class DlHcclApi : public DlVendorApi<HcclApi> {
 public:
  using DlVendorApi::DlVendorApi;

// A missing optional symbol answers HCCL_E_NOT_SUPPORT; callers check features() first.
#define RC_CALL(name, sig, ...)                 \
  auto f = fn<HcclResult(*) sig>(name);         \
  return f == nullptr ? HCCL_E_NOT_SUPPORT : f(__VA_ARGS__)

  HcclResult getRootInfo(HcclRootInfo* info) override {
    RC_CALL("HcclGetRootInfo", (HcclRootInfo*), info);
  }
  HcclResult commInitRootInfoConfig(uint32_t n, const HcclRootInfo* root, uint32_t rank, const HcclCommConfig* c,
                                    HcclComm* comm) override {
    RC_CALL("HcclCommInitRootInfoConfig", (uint32_t, const HcclRootInfo*, uint32_t, const HcclCommConfig*, HcclComm*),
            n, root, rank, c, comm);
  }
  HcclResult createSubCommConfig(HcclComm* world, uint32_t n, uint32_t* ids, uint64_t id, uint32_t rank,
                                 HcclCommConfig* c, HcclComm* sub) override {
    RC_CALL("HcclCreateSubCommConfig", (HcclComm*, uint32_t, uint32_t*, uint64_t, uint32_t, HcclCommConfig*, HcclComm*),
            world, n, ids, id, rank, c, sub);
  }
  HcclResult commDestroy(HcclComm comm) override {
    RC_CALL("HcclCommDestroy", (HcclComm), comm);
  }
  HcclResult commSuspend(HcclComm comm) override {
    RC_CALL("HcclCommSuspend", (HcclComm), comm);
  }
  HcclResult getCommAsyncError(HcclComm comm, HcclResult* err) override {
    RC_CALL("HcclGetCommAsyncError", (HcclComm, HcclResult*), comm, err);
  }
  HcclResult allReduce(void* s, void* r, uint64_t n, HcclDataType dt, HcclReduceOp op, HcclComm comm,
                       aclrtStream st) override {
    RC_CALL("HcclAllReduce", (void*, void*, uint64_t, HcclDataType, HcclReduceOp, HcclComm, aclrtStream), s, r, n, dt,
            op, comm, st);
  }
  HcclResult broadcast(void* b, uint64_t n, HcclDataType dt, uint32_t root, HcclComm comm, aclrtStream st) override {
    RC_CALL("HcclBroadcast", (void*, uint64_t, HcclDataType, uint32_t, HcclComm, aclrtStream), b, n, dt, root, comm,
            st);
  }
  HcclResult reduce(void* s, void* r, uint64_t n, HcclDataType dt, HcclReduceOp op, uint32_t root, HcclComm comm,
                    aclrtStream st) override {
    RC_CALL("HcclReduce", (void*, void*, uint64_t, HcclDataType, HcclReduceOp, uint32_t, HcclComm, aclrtStream), s, r,
            n, dt, op, root, comm, st);
  }
  HcclResult allGather(void* s, void* r, uint64_t n, HcclDataType dt, HcclComm comm, aclrtStream st) override {
    RC_CALL("HcclAllGather", (void*, void*, uint64_t, HcclDataType, HcclComm, aclrtStream), s, r, n, dt, comm, st);
  }
  HcclResult reduceScatter(void* s, void* r, uint64_t n, HcclDataType dt, HcclReduceOp op, HcclComm comm,
                           aclrtStream st) override {
    RC_CALL("HcclReduceScatter", (void*, void*, uint64_t, HcclDataType, HcclReduceOp, HcclComm, aclrtStream), s, r, n,
            dt, op, comm, st);
  }
  HcclResult scatter(void* s, void* r, uint64_t n, HcclDataType dt, uint32_t root, HcclComm comm,
                     aclrtStream st) override {
    RC_CALL("HcclScatter", (void*, void*, uint64_t, HcclDataType, uint32_t, HcclComm, aclrtStream), s, r, n, dt, root,
            comm, st);
  }
  HcclResult allToAllV(const void* s, const uint64_t* sc, const uint64_t* sd, HcclDataType st, const void* r,
                       const uint64_t* rc, const uint64_t* rd, HcclDataType rt, HcclComm comm,
                       aclrtStream stream) override {
    RC_CALL("HcclAlltoAllV",
            (const void*, const void*, const void*, HcclDataType, const void*, const void*, const void*, HcclDataType,
             HcclComm, aclrtStream),
            s, sc, sd, st, r, rc, rd, rt, comm, stream);
  }
  HcclResult send(void* b, uint64_t n, HcclDataType dt, uint32_t peer, HcclComm comm, aclrtStream st) override {
    RC_CALL("HcclSend", (void*, uint64_t, HcclDataType, uint32_t, HcclComm, aclrtStream), b, n, dt, peer, comm, st);
  }
  HcclResult recv(void* b, uint64_t n, HcclDataType dt, uint32_t peer, HcclComm comm, aclrtStream st) override {
    RC_CALL("HcclRecv", (void*, uint64_t, HcclDataType, uint32_t, HcclComm, aclrtStream), b, n, dt, peer, comm, st);
  }
  HcclResult batchSendRecv(HcclSendRecvItem* items, uint32_t n, HcclComm comm, aclrtStream st) override {
    RC_CALL("HcclBatchSendRecv", (HcclSendRecvItem*, uint32_t, HcclComm, aclrtStream), items, n, comm, st);
  }
  HcclResult barrier(HcclComm comm, aclrtStream st) override {
    RC_CALL("HcclBarrier", (HcclComm, aclrtStream), comm, st);
  }
#undef RC_CALL

  const char* getErrorString(HcclResult r) override {
    auto f = fn<const char* (*)(HcclResult)>("HcclGetErrorString");
    const char* s = f ? f(r) : nullptr;
    return s != nullptr ? s : hcclResultName(r);
  }
};

std::mutex& loaderMutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

const char* hcclResultName(HcclResult r) {
  static const char* names[] = {"HCCL_SUCCESS",        "HCCL_E_PARA",          "HCCL_E_PTR",
                                "HCCL_E_MEMORY",       "HCCL_E_INTERNAL",      "HCCL_E_NOT_SUPPORT",
                                "HCCL_E_NOT_FOUND",    "HCCL_E_UNAVAIL",       "HCCL_E_SYSCALL",
                                "HCCL_E_TIMEOUT",      "HCCL_E_OPEN_FILE_FAILURE", "HCCL_E_TCP_CONNECT",
                                "HCCL_E_ROCE_CONNECT", "HCCL_E_TCP_TRANSFER",  "HCCL_E_ROCE_TRANSFER",
                                "HCCL_E_RUNTIME",      "HCCL_E_DRV",           "HCCL_E_PROFILING",
                                "HCCL_E_CCE",          "HCCL_E_NETWORK",       "HCCL_E_AGAIN",
                                "HCCL_E_REMOTE",       "HCCL_E_SUSPENDING",    "HCCL_E_OPRETRY_FAIL",
                                "HCCL_E_OOM"};
  const int i = static_cast<int>(r);
  return i >= 0 && i < static_cast<int>(sizeof(names) / sizeof(names[0])) ? names[i] : "unknown HCCL error";
}

const std::vector<const char*>& hcclSymbols() {
  static const std::vector<const char*> names = symbolNames(symbolTable());
  return names;
}

HcclFeatures HcclApi::features() const {
  HcclFeatures f;
  f.subComm = hasSymbol("HcclCreateSubCommConfig");
  f.reduce = hasSymbol("HcclReduce");
  f.allToAllV = hasSymbol("HcclAlltoAllV");
  f.scatter = hasSymbol("HcclScatter");
  f.batchSendRecv = hasSymbol("HcclBatchSendRecv");
  f.suspend = hasSymbol("HcclCommSuspend");
  f.resume = hasSymbol("HcclCommResume");
  return f;
}

Result<std::shared_ptr<HcclApi>> loadHccl() {
  static std::shared_ptr<HcclApi> loaded;
  std::lock_guard<std::mutex> lock(loaderMutex());
  if (loaded) {
    return loaded;
  }
  std::vector<VendorCandidate> tries;
  const std::string forced = env::getString(env::Knob::kHcclLib);
  if (!forced.empty()) {
    tries.push_back({forced, "RESILIENT_COMM_HCCL_LIB="});
  }
  tries.push_back({"libhccl.so", ""});
  VendorLoad found = loadVendorLibrary("libhccl", symbolTable(), tries);
  std::string why;
  for (const VendorRejection& r : found.rejected) {
    why += (why.empty() ? " " : "; ") + r.origin + r.path + ": " + r.reason;
  }
  if (found.library) {
    loaded = std::make_shared<DlHcclApi>(std::move(*found.library));
    if (!why.empty()) {
      RC_LOG(kWarning, "using " << loaded->path() << " after skipping" << why);
    }
    return loaded;
  }
  return Status(StatusCode::kNotSupported,
                "no libhccl found:" + why + " (set RESILIENT_COMM_HCCL_LIB or install the CANN toolkit)");
}

}  // namespace resilient_comm::hccl
