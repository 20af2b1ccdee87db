// The job token's MACs on the TCP transport's handshake (issue #16).
//
// With RESILIENT_COMM_TOKEN set (resilient-run makes one per single-node job and hands it to
// its workers through the environment, never the store), every Hello carries a 64-bit
// SipHash-2-4 MAC, keyed by the token, over its fields and a random nonce, and the acceptor's
// answer carries one over the answer, the nonce and the communicator's hash. So a process
// without the token can neither join a communicator (its Hello is dropped, whatever hash it
// guessed) nor pose as a member's listener (a forged address in the store: the dialler refuses
// the answer). Without a token the MACs are 0 and not checked (the trust model of the
// unauthenticated store, docs/security.md). Not covered: an on-path attacker who can read
// the token's holders' traffic (replay of a captured Hello); keep job traffic on a private
// network.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace resilient_comm::tcp {

// SipHash-2-4 of `len` bytes with the 128-bit key (k0, k1).
uint64_t sipHash24(uint64_t k0, uint64_t k1, const void* data, size_t len);

class JobKey {
 public:
  // The key of RESILIENT_COMM_TOKEN (read now); none if it is unset.
  static JobKey fromEnv();
  explicit JobKey(const std::string& token);
  JobKey() = default;

  bool set() const {
    return set_;
  }
  // 0 without a key.
  uint64_t mac(const void* data, size_t len) const;

 private:
  bool set_ = false;
  uint64_t k0_ = 0;
  uint64_t k1_ = 0;
};

// A random 64-bit nonce.
uint64_t randomNonce();

}  // namespace resilient_comm::tcp
