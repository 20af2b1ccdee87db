// Loading libnccl at run time, with no NCCL or CUDA headers at build time.
//
// Loading order: RESILIENT_COMM_NCCL_LIB; the libnccl torch already loaded (RTLD_NOLOAD);
// then the candidate paths the caller passes (the Python layer finds the nvidia-nccl wheels).
// Only the probe lives here so far; the function table and the NcclCommunicator build on it.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace resilient_comm::nccl {

struct NcclProbe {
  std::string path;     // the file loaded, or how it was found
  int version = 0;      // ncclGetVersion's code, e.g. 22703 for 2.27.3
  std::string versionString() const;
};

Result<NcclProbe> probeNccl(const std::vector<std::string>& candidates);

}  // namespace resilient_comm::nccl
