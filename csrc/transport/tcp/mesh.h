// Building the full mesh of a TCP communicator from an address book.
//
// Every communicator (from init, shrink, split or grow) is a fresh set of connections:
// rank r dials every lower rank's listening address and accepts every higher rank on its own
// listener. Each connection starts with a Hello naming the dialler's new rank and a hash of
// the communicator being built (its epoch, and for shrink/split the member list), and the
// acceptor answers with one byte: accepted, or "you are building a different communicator".
// So ranks that disagree (different exclude lists, say) fail at once with a Mismatch error
// instead of waiting for the deadline.
//
// Fresh connections cost about a millisecond on a host and need no store round trip (the
// address book is inherited from the parent), which is what makes shrink fast; reusing the
// parent's streams would need resynchronising them after an abort cut a message in half.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/transfer.h"

namespace resilient_comm::tcp {

struct MeshSpec {
  int rank = 0;
  int size = 1;
  std::vector<std::string> addrs;  // "host:port" of every rank's listener, by rank
  uint64_t hash = 0;               // identifies the communicator being built
};

// Fills `peers` (size entries). Sockets are stored under `mu`, and shut down at once if
// `abort` has fired, so that an abort() racing with the build always wakes it.
Status buildMesh(const MeshSpec& spec, const Socket& listener, std::vector<Peer>& peers, std::mutex& mu,
                 const Deadline& dl, const AbortToken& abort);

uint64_t fnv1a(const std::string& s, uint64_t seed = 1469598103934665603ULL);

}  // namespace resilient_comm::tcp
