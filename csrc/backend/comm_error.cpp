#include "backend/comm_error.h"

namespace resilient_comm {

std::string CommErrorInfo::message() const {
  std::string s = std::string(statusCodeName(code)) + ": " + backend + " " + op;
  if (seq.has_value()) {
    s += " #" + std::to_string(*seq);
  }
  return s + " on group '" + group + "' rank " + std::to_string(rank) + ": " + cause;
}

const char* CommErrorInfo::pythonClass() const {
  switch (code) {
    case StatusCode::kTimeout:
      return "CommTimeoutError";
    case StatusCode::kAborted:
      return "CommAbortedError";
    case StatusCode::kPeerFailure:
      return "PeerFailureError";
    case StatusCode::kMismatch:
      return "CommMismatchError";
    default:
      return "CommError";
  }
}

CommException::CommException(CommErrorInfo info)
    : c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                            info.message()),
      info_(std::move(info)) {}

}  // namespace resilient_comm
