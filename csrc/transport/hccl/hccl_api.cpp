#include "transport/hccl/hccl_api.h"

#include <dlfcn.h>
#include <link.h>

#include <mutex>
#include <unordered_map>
#include <utility>

#include "common/env.h"
#include "common/logging.h"

namespace resilient_comm::hccl {

namespace {

// X(symbol, required)
#define RC_HCCL_SYMBOLS(X)            \
  X(HcclGetRootInfo, true)            \
  X(HcclCommInitRootInfoConfig, true) \
  X(HcclCommDestroy, true)            \
  X(HcclGetCommAsyncError, true)      \
  X(HcclAllReduce, true)              \
  X(HcclBroadcast, true)              \
  X(HcclAllGather, true)              \
  X(HcclReduceScatter, true)          \
  X(HcclSend, true)                   \
  X(HcclRecv, true)                   \
  X(HcclBarrier, true)                \
  X(HcclCreateSubCommConfig, false)   \
  X(HcclReduce, false)                \
  X(HcclAlltoAllV, false)             \
  X(HcclScatter, false)               \
  X(HcclBatchSendRecv, false)         \
  X(HcclGetErrorString, false)        \
  X(HcclCommSuspend, false)           \
  X(HcclCommResume, false)

std::string loadedPath(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && *map->l_name) {
    return map->l_name;
  }
  return fallback;
}

class DlHcclApi : public HcclApi {
 public:
  DlHcclApi(void* handle, std::string path) : path_(std::move(path)) {
    for (const char* s : hcclSymbols()) {
      syms_[s] = dlsym(handle, s);
    }
  }

  std::string path() const override {
    return path_;
  }
  bool hasSymbol(const char* name) const override {
    auto it = syms_.find(name);
    return it != syms_.end() && it->second != nullptr;
  }

  template <typename Fn>
  Fn fn(const char* name) const {
    return reinterpret_cast<Fn>(syms_.at(name));
  }

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

 private:
  std::string path_;
  std::unordered_map<std::string, void*> syms_;
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
  static const std::vector<const char*> names = {
#define RC_HCCL_NAME(sym, required) #sym,
      RC_HCCL_SYMBOLS(RC_HCCL_NAME)
#undef RC_HCCL_NAME
  };
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
  std::vector<std::pair<std::string, std::string>> tries;  // (path, how it was chosen)
  const std::string forced = env::getString(env::Knob::kHcclLib);
  if (!forced.empty()) {
    tries.push_back({forced, "RESILIENT_COMM_HCCL_LIB="});
  }
  tries.push_back({"libhccl.so", ""});
  std::string why;
  for (const auto& [path, how] : tries) {
    std::string failure;
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* err = dlerror();
      failure = err ? err : "not loadable";
      if (failure.rfind(path + ": ", 0) == 0) {  // dlerror names the file; so do we
        failure = failure.substr(path.size() + 2);
      }
    } else {
      auto api = std::make_shared<DlHcclApi>(h, loadedPath(h, path));
      std::string missing;
#define RC_HCCL_REQUIRED(sym, required)                             \
  if ((required) && !api->hasSymbol(#sym)) {                        \
    missing += (missing.empty() ? "" : ", ") + std::string(#sym);   \
  }
      RC_HCCL_SYMBOLS(RC_HCCL_REQUIRED)
#undef RC_HCCL_REQUIRED
      if (missing.empty()) {
        if (!why.empty()) {
          RC_LOG(kWarning, "using " << api->path() << " after skipping" << why);
        }
        loaded = api;
        return loaded;
      }
      failure = "not a usable libhccl (missing " + missing + ")";
      dlclose(h);
    }
    why += (why.empty() ? " " : "; ") + how + path + ": " + failure;
  }
  return Status(StatusCode::kNotSupported,
                "no libhccl found:" + why + " (set RESILIENT_COMM_HCCL_LIB or install the CANN toolkit)");
}

}  // namespace resilient_comm::hccl
