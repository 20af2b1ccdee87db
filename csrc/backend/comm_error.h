// CommException: the C++ exception a failed op becomes at the backend boundary.
//
// It is a c10::DistBackendError (so code that catches torch's type keeps working) carrying
// the structured facts of the failure. bindings.cpp translates it into the matching Python
// class of resilient_comm.errors (CommTimeoutError, CommAbortedError, PeerFailureError,
// CommMismatchError, all subclasses of torch.distributed.DistBackendError).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

namespace resilient_comm {

struct CommErrorInfo {
  StatusCode code = StatusCode::kInternal;
  std::string backend;
  std::string group;
  int rank = -1;
  std::string op;
  std::optional<uint64_t> seq;  // the collective's sequence number; none for send/recv
  std::string cause;            // the transport's message

  // "PeerFailure: resilient_tcp all_reduce #12 on group '0' rank 1: <cause>"
  std::string message() const;
  // The resilient_comm.errors class name for `code`.
  const char* pythonClass() const;
};

class CommException : public c10::DistBackendError {
 public:
  explicit CommException(CommErrorInfo info);
  const CommErrorInfo& info() const {
    return info_;
  }

 private:
  CommErrorInfo info_;
};

}  // namespace resilient_comm
