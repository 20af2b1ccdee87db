// A minimal test runner: TEST(name) { CHECK(cond) << ...; }. main() runs every test, prints
// one line each and a closing "N passed, M failed" line, and exits non-zero on failure.
#pragma once

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace rc_test {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) {
    cases().push_back({name, std::move(fn)});
  }
};

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Collects the streamed message and throws when the check failed.
class Check {
 public:
  Check(bool ok, const char* expr, const char* file, int line) : ok_(ok) {
    if (!ok_) {
      os_ << file << ":" << line << ": CHECK(" << expr << ") failed ";
    }
  }
  template <typename T>
  Check& operator<<(const T& v) {
    if (!ok_) {
      os_ << v;
    }
    return *this;
  }
  ~Check() noexcept(false) {
    if (!ok_) {
      throw Failure(os_.str());
    }
  }

 private:
  bool ok_;
  std::ostringstream os_;
};

}  // namespace rc_test

#define RC_TEST_CAT2(a, b) a##b
#define RC_TEST_CAT(a, b) RC_TEST_CAT2(a, b)
#define TEST(name)                                                           \
  static void name();                                                        \
  static ::rc_test::Registrar RC_TEST_CAT(rc_reg_, name)(#name, name);       \
  static void name()
#undef CHECK  // c10's logging defines one too; the tests use this one
#define CHECK(cond) ::rc_test::Check((cond), #cond, __FILE__, __LINE__)
