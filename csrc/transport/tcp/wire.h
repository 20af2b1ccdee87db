// The TCP transport's framing: every message starts with a 32-byte header that names the
// collective, its sequence number, dtype, reduction and size, so that ranks which disagree
// fail with a clear error instead of misreading each other's bytes.
#pragma once

#include <cstdint>

namespace resilient_comm::tcp {

constexpr uint32_t kWireMagic = 0x52434d31;  // "RCM1"

enum class MsgKind : uint8_t {
  kData = 1,
  // The sender's communicator ended with a failure; `bytes` of UTF-8 text follow, `dtype`
  // holds the StatusCode, `tag` the hash of that communicator. Sent only at a message boundary,
  // only whole, and at most once per communicator and stream (see transfer.h): it is the last
  // frame that communicator sends there, which is what lets a shrink reuse the stream
  // (resync.h). A communicator whose build over reused streams fails sends one too.
  kError = 2,
  // The first frame of a shrunk communicator on a reused stream (resync.h): `tag` holds the
  // new communicator's hash and `seq` the sender's rank in it; no payload.
  kFence = 3,
  // A kData frame whose receiver confirms it: once its header matched what the receiver's op
  // expects, the receiver answers with a kAck. A rank that only sends to a peer within an op
  // (a broadcast's or scatter's root, a reduce's or gather's leaves) would otherwise finish
  // with success while that peer runs another collective (transfer.h).
  kDataAck = 4,
  // The answer to a kDataAck: its header with this kind and `bytes` 0; no payload.
  kAck = 5,
  // Right after the Hello of a connection made by a build: the sender's shared-memory offer
  // (`bytes` = sizeof(ShmLink::Offer) of payload, shm.h); then, where both offered and share
  // a host, a kShmVerdict whose `tag` is 1 if the sender could attach to the peer's ring.
  kShmOffer = 6,
  kShmVerdict = 7,
};

struct WireHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t op;     // OpKind
  uint8_t dtype;  // DataType (kData) or StatusCode (kError)
  uint8_t redop;  // RedOp, 0 where meaningless
  uint64_t seq;
  uint64_t bytes;
  uint64_t tag;  // send/recv tag; a collective's root + 1 (rootTag), 0 for one without a root
};
static_assert(sizeof(WireHeader) == 32, "the header is part of the wire format");

inline uint64_t rootTag(int root) {
  return root >= 0 ? static_cast<uint64_t>(root) + 1 : 0;
}

// Handshake sent by the connecting side once per connection.
struct Hello {
  uint32_t magic;
  int32_t rank;
  int32_t size;
  uint32_t pad;
  uint64_t commHash;  // hash of the communicator's store prefix and epoch
  uint64_t nonce;     // the dialler's, random: the answer's MAC covers it
  uint64_t mac;       // over the fields above, keyed by the job token (auth.h); 0 without one
};
static_assert(sizeof(Hello) == 40, "the Hello is part of the wire format");

// The acceptor's answer to a Hello.
struct HelloAnswer {
  uint8_t answer;  // accepted, or building another communicator
  uint8_t pad[7];
  uint64_t mac;  // over answer, the Hello's nonce and hash, keyed by the job token; 0 without one
};
static_assert(sizeof(HelloAnswer) == 16, "the answer is part of the wire format");

}  // namespace resilient_comm::tcp
