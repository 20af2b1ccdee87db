#include "transport/nccl/nccl_api.h"

#include <algorithm>
#include <mutex>
#include <utility>

#include "common/env.h"
#include "common/vendor_library.h"

namespace resilient_comm::nccl {

namespace {

// Every symbol the transport resolves, required ones first; a library without a required one
// is not used, a missing optional one disables its feature (features()).
const std::vector<VendorSymbol>& symbolTable() {
  static const std::vector<VendorSymbol> table = [] {
    std::vector<VendorSymbol> t = {{"ncclGetVersion", true}, {"ncclGetErrorString", true}, {"ncclGetLastError", true}};
#define RC_NCCL_SYMBOL(symbol, method, required, params, args) t.push_back({#symbol, required});
    RC_NCCL_API(RC_NCCL_SYMBOL)
#undef RC_NCCL_SYMBOL
    std::stable_partition(t.begin(), t.end(), [](const VendorSymbol& v) { return v.required; });
    return t;
  }();
  return table;
}

// 0 when the library has no ncclGetVersion or it fails: such a library is not used.
int libraryVersion(const VendorLibrary& lib) {
  auto getVersion = reinterpret_cast<sig::ncclGetVersion*>(lib.symbol("ncclGetVersion"));
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
#define RC_NCCL_DLSYM(symbol, method, required, params, args) \
  ncclResult_t method params override {                        \
    auto f = fn<sig::symbol*>(#symbol);                         \
    return f == nullptr ? ncclInvalidUsage : f args;            \
  }
  RC_NCCL_API(RC_NCCL_DLSYM)
#undef RC_NCCL_DLSYM

  const char* getErrorString(ncclResult_t r) override {
    auto f = fn<sig::ncclGetErrorString*>("ncclGetErrorString");
    return f ? f(r) : "unknown NCCL error";
  }
  const char* getLastError(ncclComm_t comm) override {
    auto f = fn<sig::ncclGetLastError*>("ncclGetLastError");
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
  f.revoke = v >= ncclVersionCode(2, 28, 7) && hasSymbol("ncclCommRevoke");
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
