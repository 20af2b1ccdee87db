#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "check.h"

int main() {
  int passed = 0;
  int failed = 0;
  // RC_TEST_FILTER=substring runs only the tests whose name contains it (for debugging).
  const char* filter = std::getenv("RC_TEST_FILTER");
  for (const auto& c : rc_test::cases()) {
    if (filter != nullptr && std::strstr(c.name, filter) == nullptr) {
      continue;
    }
    try {
      c.fn();
      std::printf("[ OK ] %s\n", c.name);
      ++passed;
    } catch (const std::exception& e) {
      std::printf("[FAIL] %s: %s\n", c.name, e.what());
      ++failed;
    }
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
