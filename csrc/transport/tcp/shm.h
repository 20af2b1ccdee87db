// The same-host data path of the TCP transport: bulk payloads through shared memory.
//
// [Note: shared-memory rings]
// Two ranks on the same host (the same boot id, and each can open the other's files through
// /proc) move the payload of every large message (kData/kDataAck of at least kShmMinBytes)
// through a ring in shared memory instead of the socket. The TCP connection stays the control
// and liveness channel: the message's header still goes through it first (so mismatches, kError
// frames, hang-ups and the fence resync work as before), and only the payload bytes go to the
// ring. Each direction of a pair is a byte stream in its own ring: the sender's memfd segment,
// which the receiver maps. Because every message on a stream is posted in order on both ends,
// the ring is just the payload half of the stream, in the same order.
//
// - The sender copies into the ring in chunks and publishes each (its `head`, a release store);
//   the receiver copies out into its own buffer and frees what it consumed (`tail`). So only
//   the receiver ever writes its buffers: a peer that fails or aborts mid-transfer cannot touch
//   a survivor's memory, and what was published before a peer died is whole.
// - Waits are the transfer's poll loop, never a spin: each side of a pair has a doorbell (a
//   pipe whose read end it polls and whose write end the peer opened), rung after every chunk
//   published or freed. It is level-triggered and drained before the ring is looked at, so no
//   wake-up is lost; the same poll watches the socket (hang-up = death), the abort token and
//   the deadline.
// - The segment is sealed against shrinking (a peer cannot make our mapping fault), its
//   counters are checked on every read (a corrupt or hostile ring is an error, never an
//   overrun), and the offer names the files' inodes and a random cookie so that a recycled fd
//   number or another pid namespace's process is never mistaken for the peer.
// - A stream left in the middle of a message is dirty as before (the socket is shut down and a
//   shrink connects afresh, with new rings); a clean one is reused by a shrink with its rings,
//   whose stale whole messages the resync skips (resync.cpp).
//
// The pair's rings are set up once per fresh connection made by a communicator's build
// (negotiateShm), right after its Hello: both ends send an offer; if both are willing (no
// RESILIENT_COMM_SHM=0) and on the same host, each attaches to the other's files and says
// whether it could; the rings are used only if both could. The offer also names the sender's
// liveness lock ([Note: the liveness lock]): a same-host peer watches it, and an op that waits
// on a peer whose lock the kernel released fails at once (Peer::live, transfer.cpp), before
// the dead process's sockets close. Connections made on first use by
// an op (groups above RESILIENT_COMM_TCP_FULL_MESH, mesh.h) stay TCP-only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/liveness.h"
#include "common/status.h"

namespace resilient_comm::tcp {

struct Peer;

// Messages of at least this many payload bytes use the ring on a pair that has one.
constexpr size_t kShmMinBytes = 16 * 1024;

// The ring size for a member of a group with `peers` other members: 8 MiB, halved as the group
// grows so that one process's rings stay within ~64 MiB (1 MiB at least).
uint64_t ringCapacity(int peers);

// Whether this process offers shared memory to its same-host peers (RESILIENT_COMM_SHM).
bool shmEnabled();
// This host's boot id ("" if unknown: then no pair uses shared memory) and this process's
// network namespace: two processes share memory only in the same one (the namespace "nodes"
// of the tests must carry their traffic over their links: tests/system/test_nodes.py).
using liveness::bootId;
using liveness::netNamespace;

class ShmLink {
 public:
  // The payload of a kShmOffer frame.
  struct Offer {
    uint32_t magic;
    uint8_t willing;
    uint8_t pad[3];
    char bootId[40];
    int32_t pid;
    int32_t memfd;  // the sender's ring
    int32_t bell;   // the read end of the sender's doorbell
    uint32_t netns;  // netNamespace()
    uint64_t memfdIno;
    uint64_t bellIno;
    uint64_t capacity;
    uint64_t cookie;
    // The sender's liveness lock (common/liveness.h): /proc/<livePid>/fd/<liveFd>, inode
    // liveIno; liveFd -1 when it holds none. Offered whether or not it is willing to share rings.
    int32_t livePid;
    int32_t liveFd;
    uint64_t liveIno;
  };

  ~ShmLink();
  ShmLink(const ShmLink&) = delete;
  ShmLink& operator=(const ShmLink&) = delete;

  // This side's outgoing ring of `capacity` bytes (a power of two, at least 1 MiB) and its
  // doorbell, not yet attached to the peer's.
  static Result<std::unique_ptr<ShmLink>> create(uint64_t capacity);
  // What the peer needs to attach (willing = 0 when this process offers none).
  static Offer refusal();
  Offer offer() const;
  // Maps the peer's ring and opens its doorbell; an error says why not (the pair then stays
  // TCP-only).
  Status attach(const Offer& peer);

  // Copies up to `n` bytes, the rest of the message being sent, into the outgoing ring (as much
  // as fits), publishing piece by piece and ringing the peer's bell; the number copied (0: the
  // ring is full). An error: the ring's counters are corrupt.
  Result<size_t> write(const char* src, size_t n);
  // Where a message's bytes are handed over in place: `len` bytes at `p`, which are the
  // message's bytes [off, off + len) counted from this call's first. Every piece but the
  // message's last starts and ends 64-byte aligned (the ring pads each message), so a piece
  // never splits an element.
  using Sink = std::function<void(size_t off, const char* p, size_t len)>;
  // Takes up to `n` published bytes, the rest of the message being received, from the
  // incoming ring, handing each piece to `sink` (null: discards them), and frees them piece by
  // piece, ringing the peer's bell; the number taken.
  Result<size_t> consume(size_t n, const Sink& sink);
  // consume() into `dst` (nullptr: discards).
  Result<size_t> read(char* dst, size_t n);
  // The doorbell's read end (readable once the peer published or freed something), and its drain.
  int bellFd() const {
    return bellRead_;
  }
  void drainBell() const;

 private:
  struct Ring;
  ShmLink() = default;
  void ring() const;

  int memfd_ = -1;
  int bellRead_ = -1;
  int bellWrite_ = -1;  // kept open: the pipe never reports a hang-up to our poll
  uint64_t cookie_ = 0;
  Ring* out_ = nullptr;  // ours; the peer reads it
  Ring* in_ = nullptr;   // the peer's
  // The rings' sizes, kept here: the peer can write every word of either mapping.
  uint64_t outCap_ = 0;
  uint64_t inCap_ = 0;
  int peerBell_ = -1;
  uint64_t head_ = 0;  // what we published of `out_` (ours alone; the shared copy is not trusted)
  uint64_t tail_ = 0;  // what we consumed of `in_`
};

// "" if this process can set up rings (two links in this process attached to each other carry a
// message), else why not: for `resilient-comm doctor`.
std::string shmSelfTest();

// Sets up the rings of the pairs in `fresh` (connected by this build; see the note above):
// offers, attaches and verdicts over their sockets, bounded by `dl` and `abort`. A pair that
// cannot share memory stays TCP-only; an error is a peer that failed or closed meanwhile.
Status negotiateShm(std::vector<Peer>& peers, const std::vector<int>& fresh, std::mutex& mu, const Deadline& dl,
                    const AbortToken& abort);

}  // namespace resilient_comm::tcp
