#include "transport/nccl/nccl_api.h"

#include <mutex>
#include <utility>

#include "common/env.h"
#include "common/vendor_library.h"

namespace resilient_comm::nccl {

namespace {

// Every symbol the transport resolves, required ones first; a library without a required one
// is not used, a missing optional one disables its feature (features()).
const std::vector<VendorSymbol>& symbolTable() {
  static const std::vector<VendorSymbol> table = {
      {"ncclGetVersion", true},
      {"ncclGetUniqueId", true},
      {"ncclCommInitRankConfig", true},
      {"ncclCommGetAsyncError", true},
      {"ncclCommAbort", true},
      {"ncclCommDestroy", true},
      {"ncclCommFinalize", true},
      {"ncclAllReduce", true},
      {"ncclBroadcast", true},
      {"ncclReduce", true},
      {"ncclAllGather", true},
      {"ncclReduceScatter", true},
      {"ncclSend", true},
      {"ncclRecv", true},
      {"ncclGroupStart", true},
      {"ncclGroupEnd", true},
      {"ncclGetErrorString", true},
      {"ncclGetLastError", true},
      {"ncclCommSplit", false},
      {"ncclCommShrink", false},
      {"ncclCommRevoke", false},
      {"ncclCommGetUniqueId", false},
      {"ncclCommGrow", false},
  };
  return table;
}

// 0 when the library has no ncclGetVersion or it fails: such a library is not used.
int libraryVersion(const VendorLibrary& lib) {
  auto getVersion = reinterpret_cast<ncclResult_t (*)(int*)>(lib.symbol("ncclGetVersion"));
  int version = 0;
  if (getVersion == nullptr || getVersion(&version) != ncclSuccess) {
    return 0;
  }
  return version;
}

class DlNcclApi : public DlVendorApi<NcclApi> {
 public:
  explicit DlNcclApi(VendorLibrary lib) : DlVendorApi(std::move(lib)), version_(libraryVersion(library())) {}

  int version() const override {
    return version_;
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
  int version_ = 0;
};

}  // namespace

const std::vector<const char*>& ncclSymbols() {
  static const std::vector<const char*> names = symbolNames(symbolTable());
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
  std::vector<VendorCandidate> tries;
  std::string forced = env::getString(env::Knob::kNcclLib);
  if (!forced.empty()) {
    tries.push_back({forced, ""});
  }
  tries.push_back({"libnccl.so.2", "", /*onlyIfLoaded=*/true});
  for (const std::string& c : defaultCandidates()) {
    tries.push_back({c, ""});
  }
  for (const std::string& c : candidates) {
    tries.push_back({c, ""});
  }
  VendorLoad found = loadVendorLibrary("libnccl", symbolTable(), tries, [](const VendorLibrary& lib) {
    return libraryVersion(lib) == 0 ? std::string("a version") : std::string();
  });
  if (found.library) {
    loaded = std::make_shared<DlNcclApi>(std::move(*found.library));
    return loaded;
  }
  std::string why;
  for (const VendorRejection& r : found.rejected) {
    why += "\n  " + r.path + ": " + r.reason;
  }
  return Status(StatusCode::kNotSupported,
                "no libnccl found (set RESILIENT_COMM_NCCL_LIB or install nvidia-nccl-cu12)" + why);
}

}  // namespace resilient_comm::nccl
