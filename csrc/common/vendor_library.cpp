#include "common/vendor_library.h"

#include <dlfcn.h>
#include <link.h>

#include <utility>

namespace resilient_comm {

namespace {

std::string loadedPath(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && *map->l_name) {
    return map->l_name;
  }
  return fallback;
}

}  // namespace

std::vector<const char*> symbolNames(const std::vector<VendorSymbol>& symbols) {
  std::vector<const char*> names;
  names.reserve(symbols.size());
  for (const VendorSymbol& s : symbols) {
    names.push_back(s.name);
  }
  return names;
}

VendorLibrary::VendorLibrary(void* handle, std::string path, const std::vector<VendorSymbol>& symbols)
    : path_(std::move(path)) {
  for (const VendorSymbol& s : symbols) {
    syms_[s.name] = dlsym(handle, s.name);
  }
}

bool VendorLibrary::hasSymbol(const char* name) const {
  return symbol(name) != nullptr;
}

void* VendorLibrary::symbol(const char* name) const {
  auto it = syms_.find(name);
  return it == syms_.end() ? nullptr : it->second;
}

VendorLoad loadVendorLibrary(const std::string& libName, const std::vector<VendorSymbol>& symbols,
                             const std::vector<VendorCandidate>& candidates,
                             const std::function<std::string(const VendorLibrary&)>& check) {
  VendorLoad out;
  for (const VendorCandidate& c : candidates) {
    void* h = dlopen(c.path.c_str(), RTLD_NOW | (c.onlyIfLoaded ? RTLD_NOLOAD : RTLD_LOCAL));
    if (h == nullptr) {
      const char* err = dlerror();
      if (!c.onlyIfLoaded) {
        std::string failure = err ? err : "not loadable";
        if (failure.rfind(c.path + ": ", 0) == 0) {  // dlerror names the file; so does the message
          failure = failure.substr(c.path.size() + 2);
        }
        out.rejected.push_back({c.path, c.origin, std::move(failure)});
      }
      continue;
    }
    VendorLibrary lib(h, loadedPath(h, c.path), symbols);
    std::string missing;
    for (const VendorSymbol& s : symbols) {
      if (s.required && !lib.hasSymbol(s.name)) {
        missing += (missing.empty() ? "" : ", ") + std::string(s.name);
      }
    }
    if (missing.empty() && check) {
      missing = check(lib);
    }
    if (missing.empty()) {
      out.library = std::move(lib);
      return out;
    }
    out.rejected.push_back({c.path, c.origin, "not a usable " + libName + " (missing " + missing + ")"});
    dlclose(h);
  }
  return out;
}

}  // namespace resilient_comm
