#include "common/status.h"

namespace resilient_comm {

const char* statusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "Ok";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kMismatch:
      return "Mismatch";
    case StatusCode::kTimeout:
      return "Timeout";
    case StatusCode::kAborted:
      return "Aborted";
    case StatusCode::kPeerFailure:
      return "PeerFailure";
    case StatusCode::kInProgress:
      return "InProgress";
    case StatusCode::kNotSupported:
      return "NotSupported";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::string Status::toString() const {
  if (isOk()) {
    return "Ok";
  }
  return std::string(statusCodeName(code_)) + ": " + message_;
}

Status Status::withContext(const std::string& context) const {
  if (isOk()) {
    return *this;
  }
  return Status(code_, context + ": " + message_);
}

}  // namespace resilient_comm
