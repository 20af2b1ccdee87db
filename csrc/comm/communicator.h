// The Communicator contract (docs/architecture.md): one object per (group, device type).
//
// Ownership and threads:
//   - The creator owns the communicator (std::shared_ptr, since a shrink may share state).
//   - Collectives, poll() and the lifecycle calls are made by ONE thread at a time (the
//     backend's per-communicator worker); they are not reentrant.
//   - abort() may be called from any thread at any time, any number of times. It is bounded:
//     it never waits for a peer, and wakes every blocking loop of the communicator.
//
// States: Initializing -> Ready -> {Error, Revoked, Aborted}. The last three are final; the
// first error (or abort reason) wins, is recorded once and is returned by every later call.
// Recovery always builds a new communicator (shrink, split, grow or a fresh init).
//
// Buffers are raw host (or device) pointers with an element count and a DataType. Every
// call takes a Deadline; a call that cannot finish by then fails with kTimeout and leaves
// the communicator in Error (peers learn of it within milliseconds).
//
// [Note: stream-ordered communicators]
// The device transports (NCCL) also run ops asynchronously, ordered on a device stream:
// launch() runs a body of collective calls as one op that follows the calling thread's
// current stream and returns it in flight (a PendingOp); inside launch() the collectives only
// enqueue, and onStream() places host work (copies into and out of flat buffers) before or
// after them on the same stream. Called outside launch(), every collective still returns when
// it is done, on every transport. The host transports run launch()'s body where they are and
// onStream() at once, so one body serves both.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "comm/pending_op.h"
#include "comm/types.h"

namespace c10d {
class Store;
}

namespace resilient_comm {

enum class CommState { kInitializing, kReady, kError, kRevoked, kAborted };
const char* commStateName(CommState s);

// What a transport (and the vendor library under it) can do. Reported, never assumed.
struct Caps {
  bool nonBlockingInit = false;
  bool abort = false;
  bool split = false;
  bool shrink = false;
  bool revoke = false;
  bool grow = false;
  bool multiRankPerDevice = false;
};

// One point-to-point operation of a group (send/recv with a tag).
struct P2POp {
  enum class Kind { kSend, kRecv } kind;
  int peer;
  void* buf;  // const for sends
  size_t bytes;
  uint64_t tag;
};

// More point-to-point ops for a running sendRecv (see there).
struct P2PFeed {
  int wakeFd = -1;  // an eventfd
  std::function<std::vector<P2POp>()> take;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual const std::string& name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Caps caps() const = 0;
  virtual CommState state() const = 0;
  // The first error that left the communicator Error/Aborted; Ok while it is healthy.
  virtual Status error() const = 0;
  // Sequence number of the next collective (every member counts the same ops).
  virtual uint64_t nextSeq() const = 0;

  // Advances a non-blocking init; kInProgress until Ready, then Ok, or the init error.
  virtual Status poll() = 0;
  // Polls until Ready, the deadline (the communicator is then aborted) or an abort. After a
  // shrink over reused TCP connections it also waits until every peer has joined the child
  // (read its fence; see transport/tcp/resync.h), which ops otherwise check as they go; a
  // deadline that passes in that wait leaves the communicator as it is.
  virtual Status waitReady(const Deadline& deadline) = 0;

  virtual void abort(const std::string& reason) = 0;

  // In place on `buf` (count elements).
  virtual Status allReduce(void* buf, size_t count, DataType dt, RedOp op, const Deadline& dl) = 0;
  virtual Status broadcast(void* buf, size_t count, DataType dt, int root, const Deadline& dl) = 0;
  // In place on the root; other ranks' buffers are left unchanged.
  virtual Status reduce(void* buf, size_t count, DataType dt, RedOp op, int root, const Deadline& dl) = 0;
  // recv holds size() * count elements, rank i's contribution at offset i * count.
  virtual Status allGather(const void* send, void* recv, size_t count, DataType dt, const Deadline& dl) = 0;
  // send holds size() * count elements; rank i receives the reduction of block i.
  virtual Status reduceScatter(const void* send, void* recv, size_t count, DataType dt, RedOp op,
                               const Deadline& dl) = 0;
  // Counts and displacements in elements, one per rank.
  virtual Status allToAll(const void* send, const std::vector<size_t>& sendCounts,
                          const std::vector<size_t>& sendDispls, void* recv, const std::vector<size_t>& recvCounts,
                          const std::vector<size_t>& recvDispls, DataType dt, const Deadline& dl) = 0;
  // recv (root only) holds size() * count elements.
  virtual Status gather(const void* send, void* recv, size_t count, DataType dt, int root, const Deadline& dl) = 0;
  // send (root only) holds size() * count elements.
  virtual Status scatter(const void* send, void* recv, size_t count, DataType dt, int root, const Deadline& dl) = 0;
  virtual Status barrier(const Deadline& dl) = 0;
  // Sends and receives progressed together (no ordering deadlock between them). Messages
  // between two ranks are matched in order; a tag that differs from the peer's is an error.
  // With a feed, ops the caller queues while this runs join it: when feed->wakeFd becomes
  // readable the communicator drains it and adds feed->take()'s ops (an isend issued before
  // its irecv must not wait for the peer to drain it first).
  virtual Status sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed* feed = nullptr) = 0;
  // A receive of `bytes` with `tag` from whichever rank sends it first (torch's recv with no
  // src); `*source` receives that rank. Transports without it return kNotSupported.
  virtual Status recvAny(void* buf, size_t bytes, uint64_t tag, const Deadline& dl, int* source) {
    (void)buf, (void)bytes, (void)tag, (void)dl, (void)source;
    return Status(StatusCode::kNotSupported, "receiving from any source is not supported by this transport; pass src");
  }

  // Fault-tolerance moves (docs/architecture.md). Transports that lack one return kNotSupported.
  // Each returns the new communicator at once, still Initializing (waitReady() it; abort() it
  // to stop the build); the parent is left as it was unless said otherwise.
  // shrink: called by survivors only; they are renumbered contiguously in their old order.
  // afterError aborts the parent first (its pending ops fail at once).
  virtual Result<std::shared_ptr<Communicator>> shrink(const std::vector<int>& exclude, bool afterError,
                                                       const Deadline& dl) = 0;
  // split: called by every member; color < 0 means "not in any new group" (returns null).
  virtual Result<std::shared_ptr<Communicator>> split(int color, int key, const Deadline& dl) = 0;
  // grow: called by every member; joiners (hot spares) meet them under `joinKey` of `store`
  // (a store every process of the job reaches) and take the ranks size()..newSize-1.
  // Existing members keep their ranks.
  virtual Result<std::shared_ptr<Communicator>> grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::string& joinKey, const Deadline& dl) = 0;

  // Stream-ordered transports only (see the note above): true if launch() runs ops in flight.
  virtual bool streamOrdered() const {
    return false;
  }
  // Runs `body` as one op named `what` and returns it in flight; `keep` (the op's tensors) is
  // held until its end event completes. kNotSupported on host transports.
  virtual Result<std::shared_ptr<PendingOp>> launch(const std::string& what, const Deadline& dl,
                                                    std::shared_ptr<void> keep, const std::function<Status()>& body);
  // Host work ordered with the op's collectives (see the note above); at once on host transports.
  virtual Status onStream(std::function<void()> fn);
};

// Shared by the transports: poll()'s answer for a state (kInProgress while Initializing), and a
// waitReady() that sleeps until `signal` reports a state change (the transport notifies it on
// every transition), the deadline (then it aborts), or an abort.
Status pollState(CommState state, const std::string& name, const std::function<Status()>& error);
Status waitUntilReady(Communicator& comm, const StateSignal& signal, const Deadline& deadline);

}  // namespace resilient_comm
