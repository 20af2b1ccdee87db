// Building the full mesh of a TCP communicator from an address book.
//
// Pairs without a connection get a fresh one: rank r dials every lower rank's listening
// address and accepts every higher rank on its own listener. Each connection starts with a
// Hello naming the dialler's new rank and a hash of the communicator being built (its epoch,
// and for shrink/split the member list), and the acceptor answers with one byte: accepted, or
// "you are building a different communicator". So ranks that disagree (different exclude
// lists, say) fail at once with a Mismatch error instead of waiting for the deadline. A Hello
// for a build this listener already started (left in its backlog by a build that was
// abandoned) is stale, and dropped; see Listener.
//
// The acceptor reads the Hellos of every connection it accepted side by side, each bounded by
// 2 s: a connection that sends none (a port scanner, a health check, a half-open socket), one
// that closes, and one whose first bytes are not a Hello (wrong magic) are dropped and logged
// with the peer's address, and none of them delays the members' Hellos. (A well-formed Hello
// with another communicator's hash still fails the build as a mismatch: without a job token
// a member building another communicator and a stranger cannot be told apart; issue #16.)
//
// Pairs that arrive with a connection (a shrink after an error hands the survivors' streams
// to the child) are resynchronised first (resync.h: usually no wait at all, since the parent's
// failure already sent what the resync reads); only those whose stream cannot be
// resynchronised get a fresh connection.
// Fresh connections cost a Hello round trip each and the dialling is sequential (a rank
// accepts only after it has dialled every lower rank), so reuse is what makes shrink cheap.
#pragma once

#include <algorithm>
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

// The listening socket of one lineage of communicators (an init or a join, and everything
// derived from it), shared by them all, and the hashes of the builds started on it. Any thread.
class Listener {
 public:
  explicit Listener(Socket sock) : sock_(std::move(sock)) {}
  const Socket& socket() const {
    return sock_;
  }
  void started(uint64_t hash) {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(started_.begin(), started_.end(), hash) == started_.end()) {
      started_.push_back(hash);
    }
  }
  bool wasStarted(uint64_t hash) const {
    std::lock_guard<std::mutex> lock(mu_);
    return std::find(started_.begin(), started_.end(), hash) != started_.end();
  }

 private:
  Socket sock_;
  mutable std::mutex mu_;
  std::vector<uint64_t> started_;
};

struct MeshSpec {
  int rank = 0;
  int size = 1;
  std::vector<std::string> addrs;  // "host:port" of every rank's listener, by rank
  uint64_t hash = 0;               // identifies the communicator being built
  // Every peer's listener exists already (a derived build), so a refused connection means the
  // peer is gone rather than not yet listening.
  bool derived = false;
  // The hash of the communicator whose connections `peers` holds (a shrink after an error):
  // they are resynchronised (resync.h). 0: `peers` holds none.
  uint64_t parent = 0;
};

// Fills `peers` (size entries); valid sockets already there are reused after a resync.
// Sockets are stored under `mu`, and shut down at once if `abort` has fired, so that an
// abort() racing with the build always wakes it.
// `reused` receives the number of connections kept.
Status buildMesh(const MeshSpec& spec, Listener& listener, std::vector<Peer>& peers, std::mutex& mu,
                 const Deadline& dl, const AbortToken& abort, int* reused);

uint64_t fnv1a(const std::string& s, uint64_t seed = 1469598103934665603ULL);

}  // namespace resilient_comm::tcp
