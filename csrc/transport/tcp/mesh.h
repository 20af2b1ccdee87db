// The connections of a TCP communicator: made by its build for the peers it always talks to,
// and on first use for the rest.
//
// Every connection starts with a Hello from the higher rank (the dialler) naming its rank and
// a hash of the communicator being built (its epoch, and for shrink/split the member list);
// the lower rank's listener answers with one byte: accepted, "you are building a different
// communicator", or "that communicator has ended here". So ranks that disagree (different
// exclude lists, say) fail at once with a Mismatch error instead of waiting for the deadline.
//
// [Note: lazy connections]
// A group of at most RESILIENT_COMM_TCP_FULL_MESH ranks (default 64) connects every pair in its
// build. A larger one connects each rank to its two ring neighbours only (the ring algorithms'
// every hop, and a path that every failure's kError frames travel along), and any other peer
// when an op first posts a message to it: Transfer asks the communicator's Links, which dials a
// lower rank (blocking, bounded by the op's deadline) or takes a higher rank's connection from
// the listener once it arrived. At 16,384 ranks a rank then holds the connections its
// algorithms use (ring neighbours, recursive-doubling and binomial partners: ~2 log2 N) rather
// than 16,383, and a build costs two handshakes rather than N - 1 sequential ones. Both ends of
// a message post it in the same op, so both want the connection at about the same time; a
// dialler waits for the answer only while the acceptor is in an op or a build of the same
// lineage, and every such wait (Transfer's, a build's, a dial's) pumps the listener, so no
// chain of dials (which always go to a lower rank) can wait on itself.
//
// The listener is shared by a lineage of communicators and pumped by whichever of their
// threads is waiting: it accepts, reads the Hellos side by side (each bounded by 2 s: a
// connection that sends none, one that closes and one whose first bytes are not a Hello are
// dropped and logged with the peer's address), answers a member's Hello and keeps its
// connection for that communicator until it is taken. A Hello for a communicator this listener
// has not started is kept unanswered: a peer that is ahead (it already builds the next group)
// is answered when this rank starts that build; a build that finds one for a communicator it
// never started fails as a mismatch (without a job token a member building another
// communicator and a stranger cannot be told apart; issue #16).
//
// Pairs that arrive with a connection (a shrink after an error hands the survivors' streams
// to the child) are resynchronised first (resync.h: usually no wait at all, since the parent's
// failure already sent what the resync reads); only those whose stream cannot be
// resynchronised get a fresh connection. Fresh connections cost a Hello round trip each and a
// build's dialling is sequential, so reuse is what makes shrink cheap.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "transport/tcp/auth.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/transfer.h"
#include "transport/tcp/wire.h"

namespace resilient_comm::tcp {

// The listening socket of one lineage of communicators (an init or a join, and everything
// derived from it), shared by them all, and the connections it accepted for them. Any thread;
// the methods never block.
class Listener {
 public:
  explicit Listener(Socket sock);
  ~Listener();
  const Socket& socket() const {
    return sock_;
  }
  // Communicator `hash` (`size` ranks, this process being `rank`) is being built: its members'
  // Hellos are answered from now on, those that arrived early among them.
  void started(uint64_t hash, int size, int rank);
  // The communicator ended (failed, aborted, retired or destroyed): its members' Hellos are
  // answered as such from now on, and connections kept for it and never taken are closed.
  void ended(uint64_t hash);
  // Accepts what is waiting and reads what has arrived of the Hellos (see the note above).
  void pump();
  // The connection rank `rank` made for communicator `hash` (an invalid Socket if none yet),
  // or the Mismatch a peer's Hello for that communicator showed (other size, a rank claimed
  // twice, ...).
  Result<Socket> take(uint64_t hash, int rank);
  // A build's check (`rank`: the builder's, for the message): a Hello kept for a communicator
  // this listener never started is refused, and is a Mismatch.
  Status strangers(int rank);
  // An accepted connection's Hello is still arriving: a waiter polls the listener in short
  // slices until it has (its bytes do not make the listener readable).
  bool helloPending() const;

 private:
  struct Incoming;
  struct Comm {
    int size = 0;
    int rank = 0;
    bool ended = false;
    std::string refused;  // a Mismatch seen in a member's Hello
    std::map<int, Socket> kept;
    std::vector<bool> claimed;  // ranks that connected for it
  };
  void admit(const JobKey& key, std::unique_ptr<Incoming> in);
  void answer(const JobKey& key, Incoming& in, Comm& c);

  Socket sock_;
  mutable std::mutex mu_;
  std::map<uint64_t, Comm> comms_;
  std::vector<std::unique_ptr<Incoming>> incoming_;  // Hellos still arriving
  std::vector<std::unique_ptr<Incoming>> early_;     // Hellos for communicators not started
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
  // Groups of at most this many ranks connect every pair in the build (see the note above).
  int fullMesh = 64;
};

// The connections of one communicator, in its `peers` (size entries). Sockets are stored
// under `mu`, and shut down at once if `abort` has fired, so that an abort() racing with a
// connection being made always wakes the thread that uses it. build() runs once, on the
// build's thread; then link()/pump() from the communicator's op thread only.
class Links {
 public:
  Links(MeshSpec spec, std::shared_ptr<Listener> listener, std::vector<Peer>& peers, std::mutex& mu,
        const AbortToken& abort);

  // Makes the connections the build makes (every pair, or the ring neighbours); valid sockets
  // already in `peers` are reused after a resync. `reused` receives the number kept.
  Status build(const Deadline& dl, int* reused);
  // Some peers are connected on first use: an op's waits pump the listener.
  bool onDemand() const {
    return spec_.size > spec_.fullMesh;
  }
  // Connects `peer` for an op about to use it: a lower rank is dialled now; a higher rank's
  // connection is taken if it arrived (else Ok, and the caller waits and asks again).
  Status link(int peer, const Deadline& dl);
  // Whether a higher `peer` an op waits for is still there: a process that died refuses
  // connections (PeerFailure); a live one's listener drops the probe unlogged.
  Status probe(int peer, const Deadline& dl);
  const Socket& listenerSocket() const {
    return listener_->socket();
  }
  void pump() {
    listener_->pump();
  }
  bool helloPending() const {
    return listener_->helloPending();
  }

 private:
  bool eager(int peer) const;
  // A TCP connection to `peer`'s listener (no Hello yet).
  Result<Socket> connect(int peer, const Deadline& dl, bool retryRefused);
  Status dial(int peer, const Deadline& dl, bool retryRefused);
  // The higher peer's connection, if it arrived; stored in `peers`.
  Status take(int peer);
  void store(int peer, Socket s);

  MeshSpec spec_;
  std::shared_ptr<Listener> listener_;
  std::vector<Peer>& peers_;
  std::mutex& mu_;
  const AbortToken& abort_;
};

// RESILIENT_COMM_TCP_FULL_MESH.
int fullMeshFromEnv();

uint64_t fnv1a(const std::string& s, uint64_t seed = 1469598103934665603ULL);

}  // namespace resilient_comm::tcp
