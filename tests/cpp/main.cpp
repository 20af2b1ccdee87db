#include <cstdio>
#include <exception>

#include "check.h"

int main() {
  int passed = 0;
  int failed = 0;
  for (const auto& c : rc_test::cases()) {
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
