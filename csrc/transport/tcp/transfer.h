// Transfer: the progress engine under every TCP collective.
//
// An algorithm posts sends and receives to peers (in order per peer and direction), with an
// optional callback when a receive completes; callbacks may post more. run() progresses all
// of them together with one poll(2) loop until everything is done, the deadline passes, the
// abort token fires, or a peer fails. Sends and receives are progressed concurrently, so two
// ranks that send each other large messages never deadlock.
//
// [Note: failure propagation]
// While it waits, run() also watches every other peer's connection for hang-up and for a
// kError frame (peeked at when the op is not receiving from that peer). A hang-up of a peer
// this op needs is a PeerFailure; a hang-up of an uninvolved peer is only remembered (it may
// have finished and exited normally); a kError from anyone fails the op with the peer's cause.
// When run() fails, unless the failure is a local abort, it writes a whole kError frame with the
// reason to every peer whose outgoing stream sits at a frame boundary (also where it stopped
// reading in the middle of the peer's frame: a mismatched header, say); then every stream left
// in the middle of a message (either direction), or that could not take the whole frame at
// once, is marked dirty. The communicator shuts the dirty connections down (the peer sees the hang-up) and keeps
// the clean ones, which sit at a message boundary in both directions and can be resynchronised
// and reused by a shrink (mesh.h). So a failure seen by one rank reaches every rank within
// milliseconds, with its cause, whether or not they were talking to the rank that died.
//
// [Note: confirmed sends]
// A rank only learns of a mismatch from a header it reads. Where an op sends to a peer and
// reads nothing from it, the peer's verdict would come only as a kError at this rank's next
// op, after this one returned success; so those edges use sendConfirmed(), whose kAck adds
// one round trip to the sender only (the receiver answers as soon as it checked the header).
//
// Threads: one Transfer at a time per communicator, on the communicator's calling thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "comm/types.h"
#include "transport/tcp/shm.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/wire.h"

namespace resilient_comm::tcp {

class Links;

// [Note: link rates]
// A rank that waits in a collective waits either for a slow peer (late to send: its compute)
// or for a slow link (the bytes come slowly once sent). Only the second shows in how fast a
// frame arrives from its first byte to its last, so every socket receive of at least
// kRateMinBytes of payload counts its rate into its peer's histogram: kRateBuckets buckets,
// four per doubling from 1 MiB/s (the first also takes anything slower, the last anything
// faster). A frame's rate is noisy on a busy host both ways: a sender descheduled in the
// middle of it makes it slow, a receiver that was busy elsewhere finds it already buffered
// and fast; a slow link makes them all slow. So the elastic controller takes each peer's
// median frame (elastic/worker/pace_watch.py) and compares nodes (elastic/model/pace.py).
// Shared-memory rings are not timed: same host.
constexpr size_t kRateMinBytes = 64 * 1024;
constexpr int kRateBuckets = 48;
int rateBucket(double bytesPerSecond);

// Frames received from one peer, counted by rate bucket: its owner's thread counts, any
// thread reads (relaxed: a statistic).
class RateHistogram {
 public:
  RateHistogram() : counts_(new std::atomic<uint32_t>[kRateBuckets]) {
    for (int b = 0; b < kRateBuckets; ++b) {
      counts_[b].store(0, std::memory_order_relaxed);
    }
  }
  void add(int bucket) {
    counts_[bucket].store(counts_[bucket].load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  uint32_t count(int bucket) const {
    return counts_[bucket].load(std::memory_order_relaxed);
  }

 private:
  std::unique_ptr<std::atomic<uint32_t>[]> counts_;
};

// A connection to one peer, owned by the communicator.
struct Peer {
  Socket sock;
  bool hangupSeen = false;  // the peer closed its side; only an error if we need it
  // The stream stopped in the middle of a message (or is shut down): it can never carry
  // another frame, so a shrink must not reuse it. Written by the thread that owns the stream.
  bool dirty = false;
  // The peer's kError frame for the communicator that owns the stream was read: nothing of
  // that communicator follows on it (a shrink's resync need not wait for it).
  bool ended = false;
  // Reused by a shrink whose fence from this peer is still unread: the hash it must carry
  // (0: none pending). The first op reads it before anything else (resync.h).
  uint64_t fence = 0;
  WireHeader fenceIn{};  // the fence's header, as far as read
  size_t fenceGot = 0;
  // A same-host peer's shared-memory rings (shm.h), set up with the connection; large
  // payloads go through them. Null: everything goes through the socket.
  std::shared_ptr<ShmLink> shm;
  // A same-host peer's liveness lock, watched ([Note: the liveness lock]): an op that needs the
  // peer fails as soon as the kernel released it. Null: the socket's hang-up is the sign.
  std::shared_ptr<liveness::Watch> live;
  // [Note: link rates]: the large frames received through the socket, by rate.
  RateHistogram rxRates;
};

// Whether the payload of the frame `h` on `peer`'s stream goes through its ring (shm.h).
inline bool viaRing(const Peer& peer, const WireHeader& h) {
  return peer.shm != nullptr && h.bytes >= kShmMinBytes &&
         (h.kind == static_cast<uint8_t>(MsgKind::kData) || h.kind == static_cast<uint8_t>(MsgKind::kDataAck));
}

// Writes a whole kError frame carrying `failure` (tagged with the hash `comm` of the
// communicator that ended, see wire.h) to every peer whose stream is clean, without blocking;
// a peer that cannot take the whole frame at once is marked dirty, for its owner to shut down.
void sendErrorFrames(std::vector<Peer>& peers, int self, const Status& failure, uint64_t seq, uint64_t comm);

// The status a peer's kError frame reports, once its header `h` is read and `have` bytes of its
// text (`text`) with it: reads the rest of the text (briefly bounded). `*clean`: exactly the
// frame was consumed, so the stream sits at the peer's next frame.
Status peerErrorStatus(Peer& peer, int index, const WireHeader& h, std::string text, bool* clean);

// What every message of one op carries in its header.
struct MsgMeta {
  OpKind op;
  DataType dtype = DataType::kUInt8;
  RedOp redop = RedOp::kSum;
  uint64_t seq = 0;
  uint64_t tag = 0;
  uint64_t comm = 0;  // the communicator's hash, which tags its kError frames
};

class Transfer {
 public:
  using Callback = std::function<Status()>;

  // `links`: connects the peers that have no connection yet when a message is posted to them
  // (mesh.h, [Note: lazy connections]); without it every peer an op uses must be connected.
  Transfer(std::vector<Peer>& peers, int self, const MsgMeta& meta, const Deadline& dl, const AbortToken& abort,
           Links* links = nullptr);

  void send(int peer, const void* buf, size_t bytes);
  // A send that the peer confirms once it found the header to match its own op (wire.h,
  // kDataAck): run() ends only with the confirmation, so a mismatch fails this rank too. For a
  // peer this op receives nothing else from; one per peer and op is enough.
  void sendConfirmed(int peer, const void* buf, size_t bytes);
  void recv(int peer, void* buf, size_t bytes, Callback onDone = nullptr);
  // Receives `bytes` and reduces them into `target` (dst = op(dst, received), over `dt`)
  // before `onDone`: straight out of the ring on a pair that has one, else read into
  // `scratch` first.
  void recvReduce(int peer, void* scratch, void* target, size_t bytes, DataType dt, RedOp op, Callback onDone);
  // Point-to-point messages carry their own per-pair sequence number and tag.
  void sendP2P(int peer, const void* buf, size_t bytes, uint64_t seq, uint64_t tag);
  void recvP2P(int peer, void* buf, size_t bytes, uint64_t seq, uint64_t tag);
  // A receive from whichever peer's next frame is a point-to-point message with `tag` and that
  // peer's expected sequence number `seqs[peer]` (which is then advanced); `*source` receives
  // the peer. Every other peer is watched: a peer whose next frame is something else (another
  // tag, a later collective) is left alone, a kError fails the op, and the op fails once every
  // peer has hung up. At most one per Transfer, with nothing else posted before it resolves.
  void recvAny(void* buf, size_t bytes, uint64_t tag, std::vector<uint64_t>& seqs, int* source);

  // While run() waits, a readable `fd` (an eventfd, drained here) calls `fn`, which may post
  // more sends and receives.
  void onWake(int fd, Callback fn) {
    wakeFd_ = fd;
    onWake_ = std::move(fn);
  }

  Status run();

 private:
  struct SendItem {
    WireHeader hdr;
    const char* buf;
    size_t done;  // header and payload bytes written
  };
  struct RecvItem {
    WireHeader expect;
    WireHeader got;
    char* buf;
    size_t done;  // header and payload bytes read
    bool checked;
    Callback cb;
    char* target = nullptr;  // recvReduce's: buf is its scratch
    std::chrono::steady_clock::time_point first{};  // its first byte ([Note: link rates])
    DataType dt = DataType::kUInt8;
    RedOp op = RedOp::kSum;
  };
  struct Queues {
    std::deque<SendItem> sends;
    std::deque<RecvItem> recvs;
  };
  // recvAny()'s receive, until a peer's frame resolves it into a recvP2P from that peer.
  struct AnyRecv {
    bool open = false;
    char* buf = nullptr;
    size_t bytes = 0;
    uint64_t tag = 0;
    std::vector<uint64_t>* seqs = nullptr;
    int* source = nullptr;
  };

  WireHeader header(size_t bytes, uint64_t seq, uint64_t tag) const;
  Status progressSend(int peer, bool* progressed);
  // Whether the front send (receive) to `peer` is past its header and moving its payload
  // through the ring: then the bell, not the socket, says when it can go on.
  bool sendInRing(int peer) const;
  bool recvInRing(int peer) const;
  Status progressRecv(int peer);
  Status checkHeader(int peer, RecvItem& item);
  // The kError frame whose header `item` holds: reads its text, and leaves the stream at the
  // next frame (item reset) or marks it dirty.
  Status peerError(int peer, RecvItem& item);
  // A peer this op is not receiving from became readable: a kError frame fails the op; anything
  // else is a later op's message, left alone (the peer is not watched for input again).
  Status peekUnexpected(int peer);
  // An open recvAny() and every peer gone: the failure, else Ok.
  Status anyPeersLeft() const;
  // A PeerFailure once the liveness lock of same-host `peer` (Peer::live) said it died
  // kDeathGrace ago; meanwhile `*soonest` is lowered to the grace's end.
  Status peerAlive(int peer, Deadline* soonest);
  // In run()'s poll set, the tag of `peer`'s liveness lock.
  int deathOf(int peer) const;
  Status progressFence(int peer);
  Status readMore(int peer, RecvItem& item, bool* blocked);
  // Marks dirty every peer whose stream this op left in the middle of a frame: the ones we
  // were sending to (`sending`) or reading from.
  void markDirty(bool sending);
  std::string describePending() const;
  bool pending() const;
  // Connects (or takes the connection of) every peer with a message posted and no connection;
  // `*waiting`: some higher rank has not dialled yet.
  Status link(bool* waiting);
  void notifyPeers(const Status& failure);

  std::vector<Peer>& peers_;
  int self_;
  MsgMeta meta_;
  Deadline dl_;
  const AbortToken& abort_;
  std::vector<Queues> q_;
  AnyRecv any_;
  std::vector<bool> ignoreInput_;  // a later op's message is waiting: stop peeking
  Links* links_;
  // When to next probe the higher ranks this op waits to hear a Hello from (Links::probe).
  Deadline probeAt_;
  int wakeFd_ = -1;
  Callback onWake_;
};

}  // namespace resilient_comm::tcp
