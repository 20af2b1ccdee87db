// Deadline: a point on the steady clock that every blocking loop is bounded by.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace resilient_comm {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  // A deadline that never passes; used only where the caller bounds the wait another way.
  static Deadline never() {
    return Deadline(Clock::time_point::max());
  }
  static Deadline after(std::chrono::milliseconds d) {
    return Deadline(Clock::now() + d);
  }
  explicit Deadline(Clock::time_point at) : at_(at) {}

  bool passed() const {
    return Clock::now() >= at_;
  }
  bool isNever() const {
    return at_ == Clock::time_point::max();
  }
  // Milliseconds left, clamped to [0, cap]; suited to poll(2)'s timeout argument.
  int remainingMs(int cap = 1 << 30) const {
    if (isNever()) {
      return cap;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now()).count();
    // Round up so that a wait never returns just before the deadline and spins.
    return static_cast<int>(std::clamp<int64_t>(left + 1, 0, cap));
  }
  Clock::time_point at() const {
    return at_;
  }
  Deadline earliest(const Deadline& other) const {
    return other.at_ < at_ ? other : *this;
  }

 private:
  Clock::time_point at_;
};

}  // namespace resilient_comm
