// Propagation macros, in the spirit of NCCL's NCCLCHECK: return the first failed Status.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>

#include "common/status.h"

#define RC_RETURN_IF_ERROR(expr)                   \
  do {                                             \
    ::resilient_comm::Status rc_status_ = (expr);  \
    if (!rc_status_.isOk()) {                      \
      return rc_status_;                           \
    }                                              \
  } while (0)

// Assigns the value of a Result<T> expression to `lhs`, or returns its Status.
#define RC_ASSIGN_OR_RETURN(lhs, expr)             \
  auto RC_CONCAT(rc_result_, __LINE__) = (expr);   \
  if (!RC_CONCAT(rc_result_, __LINE__).isOk()) {   \
    return RC_CONCAT(rc_result_, __LINE__).status(); \
  }                                                \
  lhs = RC_CONCAT(rc_result_, __LINE__).take()

#define RC_CONCAT_INNER(a, b) a##b
#define RC_CONCAT(a, b) RC_CONCAT_INNER(a, b)

// An invalid-argument Status unless `cond` holds.
#define RC_CHECK_ARG(cond, msg)                                                  \
  do {                                                                           \
    if (!(cond)) {                                                               \
      return ::resilient_comm::Status(::resilient_comm::StatusCode::kInvalidArgument, (msg)); \
    }                                                                            \
  } while (0)

namespace resilient_comm {

// An internal Status naming the failed system call and errno, with a file:line breadcrumb.
inline Status sysError(const char* call, int err, const char* file, int line) {
  return Status(
      StatusCode::kInternal,
      std::string(call) + " failed: " + std::strerror(err) + " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace resilient_comm

#define RC_SYS_ERROR(call) ::resilient_comm::sysError((call), errno, __FILE__, __LINE__)
