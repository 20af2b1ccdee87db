// TcpCommunicator: the Communicator contract over TCP sockets (docs/architecture.md).
//
// Lifecycle: create() returns at once in Initializing; the build publishes this rank's
// listening address under an epoch-scoped store key, reads every rank's address (the address
// book), connects every pair or, in a large group, the ring neighbours (the rest connect on
// first use: mesh.h, [Note: lazy connections]) and moves to Ready. The build runs on the first
// thread that needs it: the first collective, or a waitReady() that will wait for all of it;
// a build nobody claims within 2 ms gets a thread of its own from the backstop (see
// [Note: a build runs on the first thread that needs it] in common/backstop.h), and so does
// the build of a waitReady() with an earlier deadline than the build's. The caller's thread
// spares starting a thread and handing over to it, which on a loaded host can cost a whole
// scheduler tick (4 ms), longer than a shrink. The thread running a build holds a shared_ptr
// to the communicator, so dropping the last user reference during init is safe; abort()
// stops the build within ~10 ms.
//
// shrink/split/grow build a child the same way, from the inherited address book and
// listener: no store round trip for shrink and split (grow uses the store to meet the
// joiners). The listener lives as long as any communicator derived from it; one
// shrink/split/grow at a time may be in flight per process and lineage.
//
// [Note: shrink reuses connections]
// A shrink after an error (afterError, or a parent already failed) hands the parent's clean
// connections to the survivors' child, which resynchronises them (resync.h) instead of
// building a mesh; the parent, which can never be used again, keeps none. So that
// connections survive a failure, a failed op does not shut every socket down: it tells every
// peer with a kError frame, the parent's last frame on that stream, and shuts down only the
// streams it left in the middle of a message (transfer.h, "failure propagation"); and
// abort() shuts sockets down only when it is what moves the communicator out of
// Initializing/Ready (then a thread may be blocked on them; a communicator already in Error
// has no op in flight). The child is Ready once every peer's parent has ended, usually at
// once; the peers' fences (which say they built the same child) are read by the first op that
// hears from each peer, or by waitReady(), which returns once every peer has joined. A shrink
// without afterError leaves the parent usable, so its child connects afresh.
//
// Threads: one thread at a time calls collectives/waitReady/shrink/split/grow (the backend's
// worker; waitReady after a shrink reads from the sockets like an op); poll() and abort()
// from any thread. abort() sets the token and shutdown()s every socket, which wakes the
// worker's poll at once; fds are closed only in the destructor.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "common/abort_token.h"
#include "comm/comm_lifecycle.h"
#include "comm/communicator.h"
#include "transport/tcp/algorithms/algorithms.h"
#include "transport/tcp/cost_model.h"
#include "transport/tcp/mesh.h"

namespace c10d {
class Store;
}

namespace resilient_comm::tcp {

struct TcpOptions {
  std::string name;  // group name, for messages
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;  // store key prefix; the communicator adds its epoch
  int rank = 0;
  int size = 1;
};

class TcpCommunicator : public CommLifecycle, public std::enable_shared_from_this<TcpCommunicator> {
 public:
  // Starts a non-blocking init that must finish by `initDeadline`.
  static std::shared_ptr<TcpCommunicator> create(TcpOptions opts, const Deadline& initDeadline);
  // A joiner of a grow (a hot spare): opts.rank in [existingSize, opts.size); opts.store and
  // opts.prefix are the store and join key the existing members pass to grow().
  static std::shared_ptr<TcpCommunicator> join(TcpOptions opts, int existingSize, const Deadline& dl);
  // A communicator over an address book already known (the NCCL emulator's bootstrap): every
  // rank's listening address by rank, this rank's `listener` among them, and `epoch`, the name
  // every member gives it (its identity on the wire). No store is used; opts.store may be null.
  static std::shared_ptr<TcpCommunicator> fromAddressBook(TcpOptions opts, std::shared_ptr<Listener> listener,
                                                          std::vector<std::string> addrs, std::string epoch,
                                                          const Deadline& initDeadline);
  ~TcpCommunicator() override;

  Caps caps() const override {
    return transportCaps();
  }
  // What every TCP communicator can do (for doctor, before any exists).
  static Caps transportCaps();
  uint64_t nextSeq() const override {
    return seq_;
  }

  // Runs the build on the caller's thread if the build thread has not claimed it yet.
  Status waitReady(const Deadline& deadline) override;
  void abort(const std::string& reason) override;

  Status allReduce(void* buf, size_t count, DataType dt, RedOp op, const Deadline& dl) override;
  Status broadcast(void* buf, size_t count, DataType dt, int root, const Deadline& dl) override;
  Status reduce(void* buf, size_t count, DataType dt, RedOp op, int root, const Deadline& dl) override;
  Status allGather(const void* send, void* recv, size_t count, DataType dt, const Deadline& dl) override;
  Status reduceScatter(const void* send, void* recv, size_t count, DataType dt, RedOp op,
                       const Deadline& dl) override;
  Status allToAll(const void* send, const std::vector<size_t>& sendCounts, const std::vector<size_t>& sendDispls,
                  void* recv, const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                  DataType dt, const Deadline& dl) override;
  Status gather(const void* send, void* recv, size_t count, DataType dt, int root, const Deadline& dl) override;
  Status scatter(const void* send, void* recv, size_t count, DataType dt, int root, const Deadline& dl) override;
  Status barrier(const Deadline& dl) override;
  Status sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed* feed = nullptr) override;
  Status recvAny(void* buf, size_t bytes, uint64_t tag, const Deadline& dl, int* source) override;

  Result<std::shared_ptr<Communicator>> shrink(const std::vector<int>& exclude, bool afterError,
                                               const Deadline& dl) override;
  Result<std::shared_ptr<Communicator>> split(int color, int key, const Deadline& dl) override;
  Result<std::shared_ptr<Communicator>> grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                             const std::string& joinKey, const Deadline& dl) override;

  // Connections this communicator's build took over from its parent and resynchronised
  // rather than connecting afresh (for tests and benchmarks; 0 until Ready).
  int reusedConnections() const {
    return reused_.load();
  }

  // Peers this rank holds a connection to (for tests and benchmarks): all of them in a small
  // group, in a large one those its ops have used (mesh.h, [Note: lazy connections]).
  int connections() const;
  // Peers whose large payloads go through shared memory (shm.h), by rank in this group.
  std::vector<int> shmPeers() const;
  // The large frames this rank received through its socket, by rate bucket ([Note: link
  // rates] in transfer.h): (rank of this group, the count in each bucket), for the ranks that
  // sent any.
  std::vector<std::pair<int, std::vector<uint32_t>>> receiveRates() const;

  // What torch's reconfigure API (backend_reconfigure.cpp) needs of a communicator that may be
  // shrunk or whose listener a new communicator reuses. Valid once built() succeeded
  // (`everBuilt()`): the build's results are read-only from then on.
  // Every member's identity is the same for one communicator (its epoch's hash, as on the wire).
  uint64_t identity() const {
    return meshHash();
  }
  // The build finished once (it may have failed since): the address book and listener are set.
  bool everBuilt() const;
  const std::vector<std::string>& addressBook() const {
    return addrs_;
  }
  const std::shared_ptr<Listener>& listener() const {
    return listener_;
  }

  // The algorithm the cost model picks (for tests and benchmarks).
  Algo chooseAlgo(OpKind op, size_t bytes) const {
    return model_.choose(op, bytes, opts_.size);
  }

 private:
  explicit TcpCommunicator(TcpOptions opts);

  // Starts the build `plan` (which ends by building the mesh), which runBuild() runs once.
  void start(std::function<Status(TcpCommunicator&, const Deadline&)> plan, const Deadline& dl);
  // Runs the build unless another thread claimed it, then moves to Ready, or to Error with the
  // plan's failure.
  void runBuild(const Deadline& dl);
  Status initFromStore(const Deadline& dl);
  Status joinFromStore(int existingSize, const Deadline& dl);
  // Creates this rank's listener and publishes its address under `key`.
  Status publishListener(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key);
  // `derived`: every peer listens already (shrink/split), see MeshSpec.
  Status buildMesh(const Deadline& dl, bool derived);
  uint64_t meshHash() const;  // the communicator's identity on the wire (Hello, fences)
  // A child communicator over `members` (parent ranks, in their new order), built from the
  // address book; `tag` names the move and its arguments in the child's hash. With `adopt`
  // the child takes this communicator's clean connections to the members (see the note above).
  std::shared_ptr<TcpCommunicator> derive(const std::vector<int>& members, const std::string& tag,
                                          const Deadline& dl, bool adopt);
  // Ends a Ready communicator from its owner's thread without shutting its clean connections
  // down (every peer gets a kError frame instead), so that a shrink can reuse them.
  void retire(const std::string& reason);
  // Every collective: checks the state, assigns a sequence number, and on failure records the
  // first error and tears the connections down (see Transfer's failure-propagation note).
  template <typename Fn>
  // `root`: a rooted collective's root, which its headers carry (wire.h), so that ranks that
  // disagree on it fail instead of relaying the wrong rank's data.
  Status collective(OpKind op, DataType dt, RedOp redop, const Deadline& dl, Fn&& body, int root = -1);
  Status checkRoot(int root, const char* what) const;
  Status fail(const Status& st, const std::string& where);
  Status ready(const Deadline& dl);
  // Waits until the build ends (running it on this thread, or starting a thread for it; see
  // [Note: a build runs on the first thread that needs it]).
  Status awaitBuild(const Deadline& deadline);
  // After a shrink: reads every peer's pending fence (resync.h); a mismatch or a peer's failure
  // fails the communicator, a timeout is the waiter's own.
  Status awaitFences(const Deadline& deadline);
  Status built(const Deadline& dl);
  void shutdownSockets();
  // This communicator takes no more connections: the listener refuses its Hellos from now on.
  void endLinks();
  // Shuts down the connections marked dirty (owner thread; see transfer.h).
  void shutdownDirty();

  TcpOptions opts_;
  CostModel model_;
  AbortToken abort_;
  // Guards peers_ (while init adds sockets). Taken before the lifecycle's own lock where both
  // are held (runBuild), never after.
  mutable std::mutex mu_;
  std::vector<Peer> peers_;
  std::atomic<bool> socketsShut_{false};  // shutdownSockets() ran: nothing is left to reuse
  Scratch scratch_;
  uint64_t seq_ = 0;
  std::vector<uint64_t> sendSeq_;
  std::vector<uint64_t> recvSeq_;

  std::function<Status(TcpCommunicator&, const Deadline&)> plan_;  // set by start()
  Deadline buildDl_ = Deadline::never();
  std::atomic<bool> buildClaimed_{false};
  std::atomic<int> reused_{0};
  std::atomic<bool> builtOk_{false};  // the build succeeded: addrs_ and listener_ are final
  uint64_t parent_ = 0;  // a shrink after an error: the hash of the parent whose streams it took

  // Set by the build before Ready; read-only afterwards.
  std::shared_ptr<Listener> listener_;
  std::unique_ptr<Links> links_;    // made by buildMesh; then the op thread's
  std::vector<std::string> addrs_;  // every rank's listening address
  std::string epoch_;               // unique name of this communicator; children derive theirs
  int derived_ = 0;                 // children made so far (every member counts alike)
};

}  // namespace resilient_comm::tcp
