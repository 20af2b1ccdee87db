#include "transport/nccl/nccl_api.h"

#include <dlfcn.h>
#include <link.h>

#include <mutex>
#include <unordered_map>

#include "common/env.h"

namespace resilient_comm::nccl {

namespace {

// X(symbol, required)
#define RC_NCCL_SYMBOLS(X)           \
  X(ncclGetVersion, true)            \
  X(ncclGetUniqueId, true)           \
  X(ncclCommInitRankConfig, true)    \
  X(ncclCommGetAsyncError, true)     \
  X(ncclCommAbort, true)             \
  X(ncclCommDestroy, true)           \
  X(ncclCommFinalize, true)          \
  X(ncclAllReduce, true)             \
  X(ncclBroadcast, true)             \
  X(ncclReduce, true)                \
  X(ncclAllGather, true)             \
  X(ncclReduceScatter, true)         \
  X(ncclSend, true)                  \
  X(ncclRecv, true)                  \
  X(ncclGroupStart, true)            \
  X(ncclGroupEnd, true)              \
  X(ncclGetErrorString, true)        \
  X(ncclGetLastError, true)          \
  X(ncclCommSplit, false)            \
  X(ncclCommShrink, false)           \
  X(ncclCommRevoke, false)           \
  X(ncclCommGetUniqueId, false)      \
  X(ncclCommGrow, false)

std::string loadedPath(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && *map->l_name) {
    return map->l_name;
  }
  return fallback;
}

class DlNcclApi : public NcclApi {
 public:
  DlNcclApi(void* handle, std::string path) : handle_(handle), path_(std::move(path)) {
    for (const char* s : ncclSymbols()) {
      syms_[s] = dlsym(handle_, s);
    }
    auto getVersion = reinterpret_cast<ncclResult_t (*)(int*)>(syms_["ncclGetVersion"]);
    if (getVersion == nullptr || getVersion(&version_) != ncclSuccess) {
      version_ = 0;
    }
  }

  int version() const override {
    return version_;
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

#define RC_CALL(name, sig, ...)                                   \
  auto f = fn<ncclResult_t(*) sig>(name);                         \
  return f == nullptr ? ncclInvalidUsage : f(__VA_ARGS__)

  ncclResult_t getUniqueId(ncclUniqueId* id) override {
    RC_CALL("ncclGetUniqueId", (ncclUniqueId*), id);
  }
  ncclResult_t commInitRankConfig(ncclComm_t* comm, int n, ncclUniqueId id, int rank, ncclConfig_t* c) override {
    RC_CALL("ncclCommInitRankConfig", (ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*), comm, n, id, rank, c);
  }
  ncclResult_t commGetAsyncError(ncclComm_t comm, ncclResult_t* err) override {
    RC_CALL("ncclCommGetAsyncError", (ncclComm_t, ncclResult_t*), comm, err);
  }
  ncclResult_t commAbort(ncclComm_t comm) override {
    RC_CALL("ncclCommAbort", (ncclComm_t), comm);
  }
  ncclResult_t commDestroy(ncclComm_t comm) override {
    RC_CALL("ncclCommDestroy", (ncclComm_t), comm);
  }
  ncclResult_t commFinalize(ncclComm_t comm) override {
    RC_CALL("ncclCommFinalize", (ncclComm_t), comm);
  }
  ncclResult_t commSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t* c) override {
    RC_CALL("ncclCommSplit", (ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*), comm, color, key, out, c);
  }
  ncclResult_t commShrink(ncclComm_t comm, int* ex, int n, ncclComm_t* out, ncclConfig_t* c, int flags) override {
    RC_CALL("ncclCommShrink", (ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int), comm, ex, n, out, c, flags);
  }
  ncclResult_t commRevoke(ncclComm_t comm, int flags) override {
    RC_CALL("ncclCommRevoke", (ncclComm_t, int), comm, flags);
  }
  ncclResult_t commGetUniqueId(ncclComm_t comm, ncclUniqueId* id) override {
    RC_CALL("ncclCommGetUniqueId", (ncclComm_t, ncclUniqueId*), comm, id);
  }
  ncclResult_t commGrow(ncclComm_t comm, int n, const ncclUniqueId* id, int rank, ncclComm_t* out,
                        ncclConfig_t* c) override {
    RC_CALL("ncclCommGrow", (ncclComm_t, int, const ncclUniqueId*, int, ncclComm_t*, ncclConfig_t*), comm, n, id,
            rank, out, c);
  }
  ncclResult_t allReduce(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                         cudaStream_t st) override {
    RC_CALL("ncclAllReduce", (const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t), s,
            r, n, dt, op, comm, st);
  }
  ncclResult_t broadcast(const void* s, void* r, size_t n, ncclDataType_t dt, int root, ncclComm_t comm,
                         cudaStream_t st) override {
    RC_CALL("ncclBroadcast", (const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t), s, r, n,
            dt, root, comm, st);
  }
  ncclResult_t reduce(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t comm,
                      cudaStream_t st) override {
    RC_CALL("ncclReduce", (const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t),
            s, r, n, dt, op, root, comm, st);
  }
  ncclResult_t allGather(const void* s, void* r, size_t n, ncclDataType_t dt, ncclComm_t comm,
                         cudaStream_t st) override {
    RC_CALL("ncclAllGather", (const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t), s, r, n, dt,
            comm, st);
  }
  ncclResult_t reduceScatter(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                             cudaStream_t st) override {
    RC_CALL("ncclReduceScatter", (const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t),
            s, r, n, dt, op, comm, st);
  }
  ncclResult_t send(const void* b, size_t n, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t st) override {
    RC_CALL("ncclSend", (const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t), b, n, dt, peer, comm,
            st);
  }
  ncclResult_t recv(void* b, size_t n, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t st) override {
    RC_CALL("ncclRecv", (void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t), b, n, dt, peer, comm, st);
  }
  ncclResult_t groupStart() override {
    RC_CALL("ncclGroupStart", ());
  }
  ncclResult_t groupEnd() override {
    RC_CALL("ncclGroupEnd", ());
  }
#undef RC_CALL

  const char* getErrorString(ncclResult_t r) override {
    auto f = fn<const char* (*)(ncclResult_t)>("ncclGetErrorString");
    return f ? f(r) : "unknown NCCL error";
  }
  const char* getLastError(ncclComm_t comm) override {
    auto f = fn<const char* (*)(ncclComm_t)>("ncclGetLastError");
    return f ? f(comm) : "";
  }

 private:
  void* handle_;
  std::string path_;
  int version_ = 0;
  std::unordered_map<std::string, void*> syms_;
};

}  // namespace

const std::vector<const char*>& ncclSymbols() {
  static const std::vector<const char*> names = {
#define RC_NCCL_NAME(sym, required) #sym,
      RC_NCCL_SYMBOLS(RC_NCCL_NAME)
#undef RC_NCCL_NAME
  };
  return names;
}

NcclFeatures NcclApi::features() const {
  const int v = version();
  NcclFeatures f;
  f.nonBlockingInit = v >= ncclVersionCode(2, 14, 0);
  f.split = v >= ncclVersionCode(2, 18, 0) && hasSymbol("ncclCommSplit");
  f.shrink = v >= ncclVersionCode(2, 27, 0) && hasSymbol("ncclCommShrink");
  f.revoke = v >= ncclVersionCode(2, 28, 0) && hasSymbol("ncclCommRevoke");
  f.grow = v >= ncclVersionCode(2, 29, 0) && hasSymbol("ncclCommGrow") && hasSymbol("ncclCommGetUniqueId");
  f.multiRankPerDevice = v >= ncclVersionCode(2, 30, 0) && env::getString(env::Knob::kNcclMultiRankGpu) == "1";
  return f;
}

std::string NcclApi::versionString() const {
  int v = version();
  if (v < 10000) {  // NCCL < 2.9 encoded versions as X*1000 + Y*100 + Z
    return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 100) + "." + std::to_string(v % 100);
  }
  return std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." + std::to_string(v % 100);
}

namespace {
std::mutex& loaderMutex() {
  static std::mutex mu;
  return mu;
}
std::vector<std::string>& defaultCandidates() {
  static std::vector<std::string> paths;
  return paths;
}
}  // namespace

void setNcclCandidates(std::vector<std::string> paths) {
  std::lock_guard<std::mutex> lock(loaderMutex());
  defaultCandidates() = std::move(paths);
}

Result<std::shared_ptr<NcclApi>> loadNccl(const std::vector<std::string>& candidates) {
  static std::shared_ptr<NcclApi> loaded;
  std::lock_guard<std::mutex> lock(loaderMutex());
  if (loaded) {
    return loaded;
  }
  std::vector<std::pair<std::string, int>> tries;
  std::string forced = env::getString(env::Knob::kNcclLib);
  if (!forced.empty()) {
    tries.push_back({forced, RTLD_NOW | RTLD_LOCAL});
  }
  tries.push_back({"libnccl.so.2", RTLD_NOW | RTLD_NOLOAD});
  for (const std::string& c : defaultCandidates()) {
    tries.push_back({c, RTLD_NOW | RTLD_LOCAL});
  }
  for (const std::string& c : candidates) {
    tries.push_back({c, RTLD_NOW | RTLD_LOCAL});
  }
  std::string why;
  for (const auto& [path, flags] : tries) {
    void* h = dlopen(path.c_str(), flags);
    if (h == nullptr) {
      const char* err = dlerror();
      if ((flags & RTLD_NOLOAD) == 0) {
        why += "\n  " + path + ": " + (err ? err : "not loadable");
      }
      continue;
    }
    auto api = std::make_shared<DlNcclApi>(h, loadedPath(h, path));
    std::string missing;
#define RC_NCCL_REQUIRED(sym, required)                    \
  if ((required) && !api->hasSymbol(#sym)) {               \
    missing += (missing.empty() ? "" : ", ") + std::string(#sym); \
  }
    RC_NCCL_SYMBOLS(RC_NCCL_REQUIRED)
#undef RC_NCCL_REQUIRED
    if (!missing.empty() || api->version() == 0) {
      why += "\n  " + path + ": not a usable libnccl (missing " + (missing.empty() ? "a version" : missing) + ")";
      continue;
    }
    loaded = api;
    return loaded;
  }
  return Status(StatusCode::kNotSupported,
                "no libnccl found (set RESILIENT_COMM_NCCL_LIB or install nvidia-nccl-cu12)" + why);
}

}  // namespace resilient_comm::nccl
