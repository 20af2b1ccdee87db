// Minimal leveled logging to stderr, gated by RESILIENT_COMM_LOG_LEVEL.
#pragma once

#include <sstream>
#include <string>

namespace resilient_comm {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

bool logEnabled(LogLevel level);
void logLine(LogLevel level, const std::string& line);

}  // namespace resilient_comm

#define RC_LOG(level, expr)                                                   \
  do {                                                                        \
    if (::resilient_comm::logEnabled(::resilient_comm::LogLevel::level)) {    \
      std::ostringstream rc_log_os_;                                          \
      rc_log_os_ << expr;                                                     \
      ::resilient_comm::logLine(::resilient_comm::LogLevel::level, rc_log_os_.str()); \
    }                                                                         \
  } while (0)
