// loadVendorLibrary: the one loop that finds a vendor library (libnccl, libhccl) at run time.
//
// Both vendor transports resolve their functions with dlsym so that one build serves every
// library version and runs on machines without the library at all. What they share lives here:
// try each candidate path in order, dlopen it, resolve the transport's symbol table, reject a
// library that lacks a required symbol (or fails the transport's own check), and remember why
// each candidate was skipped, so that the transport's error message can name every path it tried.
// The transport chooses the candidates and phrases the final message.
//
// Not thread-safe: each transport calls it under its own loader mutex.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace resilient_comm {

struct VendorSymbol {
  const char* name;
  bool required;  // a library without it is not usable; an optional one only disables a feature
};

// The names of `symbols`, in order.
std::vector<const char*> symbolNames(const std::vector<VendorSymbol>& symbols);

struct VendorCandidate {
  std::string path;
  // How the path was chosen ("RESILIENT_COMM_HCCL_LIB="), for the transport's message.
  std::string origin;
  // RTLD_NOLOAD: take the library only if the process has it loaded already (torch's libnccl);
  // its absence is normal, so it is not reported as a rejection.
  bool onlyIfLoaded = false;
};

struct VendorRejection {
  std::string path;
  std::string origin;
  std::string reason;  // dlerror() without the leading "<path>: ", or "not a usable <lib> (missing ...)"
};

// A loaded library and its resolved symbols (nullptr for the absent ones). The library stays
// loaded for the life of the process: its functions are called until exit.
class VendorLibrary {
 public:
  VendorLibrary(void* handle, std::string path, const std::vector<VendorSymbol>& symbols);

  // The file the dynamic loader actually opened (a soname resolved to its full path).
  const std::string& path() const {
    return path_;
  }
  bool hasSymbol(const char* name) const;
  // nullptr when the library lacks it (or it is not in the symbol table).
  void* symbol(const char* name) const;

 private:
  std::string path_;
  std::unordered_map<std::string, void*> syms_;
};

// The vendor-independent half of a transport's dlsym-backed API table (DlNcclApi, DlHcclApi):
// `Api` declares path() and hasSymbol(); the transport adds one method per vendor call.
template <typename Api>
class DlVendorApi : public Api {
 public:
  explicit DlVendorApi(VendorLibrary lib) : lib_(std::move(lib)) {}

  std::string path() const override {
    return lib_.path();
  }
  bool hasSymbol(const char* name) const override {
    return lib_.hasSymbol(name);
  }

 protected:
  // The function `name` as `Fn`, nullptr when the library lacks it.
  template <typename Fn>
  Fn fn(const char* name) const {
    return reinterpret_cast<Fn>(lib_.symbol(name));
  }
  const VendorLibrary& library() const {
    return lib_;
  }

 private:
  VendorLibrary lib_;
};

struct VendorLoad {
  std::optional<VendorLibrary> library;  // empty when no candidate was usable
  std::vector<VendorRejection> rejected;  // every candidate skipped, in the order tried
};

// Tries `candidates` in order and answers the first usable one. `libName` ("libnccl") phrases
// "not a usable libnccl (missing ...)". `check`, if given, vets a library whose required symbols
// are all there: it answers what is missing ("a version"), or "" when the library is usable.
VendorLoad loadVendorLibrary(const std::string& libName, const std::vector<VendorSymbol>& symbols,
                             const std::vector<VendorCandidate>& candidates,
                             const std::function<std::string(const VendorLibrary&)>& check = {});

}  // namespace resilient_comm
