#include "transport/tcp/auth.h"

#include <random>

#include "common/env.h"

namespace resilient_comm::tcp {

namespace {

inline uint64_t rotl(uint64_t x, int b) {
  return (x << b) | (x >> (64 - b));
}

struct SipState {
  uint64_t v0, v1, v2, v3;
  void round() {
    v0 += v1;
    v1 = rotl(v1, 13);
    v1 ^= v0;
    v0 = rotl(v0, 32);
    v2 += v3;
    v3 = rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = rotl(v1, 17);
    v1 ^= v2;
    v2 = rotl(v2, 32);
  }
  void absorb(uint64_t m) {
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  }
};

uint64_t loadLe(const unsigned char* p, size_t n) {
  uint64_t out = 0;
  for (size_t i = 0; i < n; ++i) {
    out |= static_cast<uint64_t>(p[i]) << (8 * i);
  }
  return out;
}

}  // namespace

uint64_t sipHash24(uint64_t k0, uint64_t k1, const void* data, size_t len) {
  SipState s{k0 ^ 0x736f6d6570736575ULL, k1 ^ 0x646f72616e646f6dULL, k0 ^ 0x6c7967656e657261ULL,
             k1 ^ 0x7465646279746573ULL};
  const auto* p = static_cast<const unsigned char*>(data);
  size_t whole = len - len % 8;
  for (size_t i = 0; i < whole; i += 8) {
    s.absorb(loadLe(p + i, 8));
  }
  s.absorb((static_cast<uint64_t>(len & 0xff) << 56) | loadLe(p + whole, len % 8));
  s.v2 ^= 0xff;
  for (int i = 0; i < 4; ++i) {
    s.round();
  }
  return s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
}

JobKey JobKey::fromEnv() {
  std::string token = env::getString(env::Knob::kToken);
  return token.empty() ? JobKey() : JobKey(token);
}

JobKey::JobKey(const std::string& token) : set_(true) {
  // The token (any length) condensed into two 64-bit words under fixed, distinct keys.
  k0_ = sipHash24(0x7263746f6b656e30ULL, 0, token.data(), token.size());
  k1_ = sipHash24(0x7263746f6b656e31ULL, 0, token.data(), token.size());
}

uint64_t JobKey::mac(const void* data, size_t len) const {
  return set_ ? sipHash24(k0_, k1_, data, len) : 0;
}

uint64_t randomNonce() {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  return gen();
}

}  // namespace resilient_comm::tcp
