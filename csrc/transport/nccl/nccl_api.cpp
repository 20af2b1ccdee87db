#include "transport/nccl/nccl_api.h"

#include <dlfcn.h>
#include <link.h>

#include "common/env.h"

namespace resilient_comm::nccl {

namespace {

using GetVersionFn = int (*)(int*);

std::string loadedPath(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && *map->l_name) {
    return map->l_name;
  }
  return fallback;
}

}  // namespace

std::string NcclProbe::versionString() const {
  int major = version / 10000;
  int minor = (version % 10000) / 100;
  int patch = version % 100;
  if (version < 10000) {  // NCCL < 2.9 encoded versions as major*1000 + minor*100 + patch
    major = version / 1000;
    minor = (version % 1000) / 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

Result<NcclProbe> probeNccl(const std::vector<std::string>& candidates) {
  std::vector<std::pair<std::string, int>> tries;
  std::string forced = env::getString(env::Knob::kNcclLib);
  if (!forced.empty()) {
    tries.push_back({forced, RTLD_NOW | RTLD_LOCAL});
  }
  tries.push_back({"libnccl.so.2", RTLD_NOW | RTLD_NOLOAD});
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
    auto getVersion = reinterpret_cast<GetVersionFn>(dlsym(h, "ncclGetVersion"));
    if (getVersion == nullptr) {
      why += "\n  " + path + ": no ncclGetVersion symbol";
      continue;
    }
    NcclProbe probe;
    probe.path = loadedPath(h, path);
    if (getVersion(&probe.version) != 0) {
      why += "\n  " + path + ": ncclGetVersion failed";
      continue;
    }
    return probe;  // the handle stays open: the library is meant to be used
  }
  return Status(StatusCode::kNotSupported,
                "no libnccl found (set RESILIENT_COMM_NCCL_LIB or install nvidia-nccl-cu12)" + why);
}

}  // namespace resilient_comm::nccl
