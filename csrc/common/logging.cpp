#include "common/logging.h"

#include <unistd.h>

#include <cstdio>

#include "common/env.h"

namespace resilient_comm {

namespace {
LogLevel configuredLevel() {
  static const LogLevel level = [] {
    std::string v = env::getString(env::Knob::kLogLevel);
    if (v == "debug") {
      return LogLevel::kDebug;
    }
    if (v == "info") {
      return LogLevel::kInfo;
    }
    if (v == "error") {
      return LogLevel::kError;
    }
    return LogLevel::kWarning;
  }();
  return level;
}
}  // namespace

bool logEnabled(LogLevel level) {
  return static_cast<int>(level) >= static_cast<int>(configuredLevel());
}

void logLine(LogLevel level, const std::string& line) {
  static const char* names[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
  std::fprintf(stderr, "[resilient_comm %s pid=%d] %s\n", names[static_cast<int>(level)], getpid(), line.c_str());
}

}  // namespace resilient_comm
