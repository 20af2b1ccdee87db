// Status and Result<T>: how every layer below the Python boundary reports errors.
//
// Nothing inside csrc/ throws across a layer: functions return a Status (or a Result<T>)
// and callers propagate it with the macros in check.h. The backend converts a failed
// Status into a Python exception at the pybind boundary.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace resilient_comm {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // caller error, detected locally; the communicator stays usable
  kMismatch,          // ranks disagree on an op (size, dtype, kind, sequence); fatal
  kTimeout,           // a deadline passed
  kAborted,           // abort() was called on this communicator
  kPeerFailure,       // a peer died, closed its connection or reported an error
  kInProgress,        // non-blocking init has not finished
  kNotSupported,      // the transport or library lacks the capability
  kInternal,          // a system call failed or an invariant broke
};

const char* statusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() {
    return Status();
  }

  bool isOk() const {
    return code_ == StatusCode::kOk;
  }
  StatusCode code() const {
    return code_;
  }
  const std::string& message() const {
    return message_;
  }
  // "PeerFailure: rank 3 closed its connection" (or "Ok").
  std::string toString() const;

  // Prepends context, e.g. status.withContext("all_reduce #12").
  Status withContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool isOk() const {
    return status_.isOk();
  }
  const Status& status() const {
    return status_;
  }
  T& value() {
    return *value_;
  }
  T&& take() {
    return std::move(*value_);
  }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace resilient_comm
