// Resynchronising reused streams for a shrunk communicator.
//
// [Note: fence resync]
// A shrink after an error keeps the survivors' connections (see mesh.h). Each such stream was
// left at a message boundary in both directions by the failed parent (a stream cut in the
// middle of a message is marked dirty and shut down instead, transfer.h), and each side has
// sent, or will send when its parent fails or retires, exactly one kError frame tagged with
// the parent's hash: the parent's last frame there (wire.h). Before it, the peer may have
// queued whole frames of the parent's last op.
//
// The build of the child (resyncStreams) writes a kFence frame, carrying the child's hash and
// the sender's new rank, on every reused stream, and reads each peer's stream frame by frame
// (header, then exactly `bytes` of payload, never past a frame), discarding everything up to
// the peer's parent kError, unless the parent already read it. The parent's failure sent those
// frames before anyone called shrink, so this usually costs no wait at all: the build does
// not wait for the peers to call shrink. Their fences are read later, as the first frame from
// each peer: by the first op that receives from that peer, in the same read as its first
// message (a peer the op does not receive from is watched for its fence once the op has
// waited 1 ms: transfer.cpp, kWatchFencedAfter), or all at once by waitReady()
// (awaitFences). A fence for another communicator fails that op, or waitReady, with a
// Mismatch (the members shrank with different arguments); a kError in its place reports that
// the peer's build failed. A build that must also connect afresh reads the fences first, so
// that a mismatch fails it at once rather than at the deadline.
//
// Outcomes per pair in the build: the peer's parent kError arrived and the stream has not
// ended behind it (reused, its fence pending); the stream ends or is garbled (the peer
// dropped it, or died): the pair is marked for a fresh connection, which both ends then agree
// on because a stream one end drops never carries that end's kError whole. A fence for a
// communicator other than the parent before the parent's kError is a Mismatch.
//
// When the build fails here, every stream still at a frame boundary gets a kError tagged with
// the child's hash, so peers learn the cause at once.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "transport/tcp/transfer.h"

namespace resilient_comm::tcp {

// Resynchronises every valid socket in `peers` (rank `rank` of the communicator `hash`, shrunk
// from the communicator `parent`). A stream that cannot be resynchronised is shut down and
// replaced, under `mu`, by an invalid socket, for the caller to connect afresh; `gone`
// receives those peers. The streams kept have their fence pending (Peer::fence).
Status resyncStreams(int rank, uint64_t hash, uint64_t parent, std::vector<Peer>& peers, std::mutex& mu,
                     const Deadline& dl, const AbortToken& abort, std::vector<int>* gone);

// Reads as much of peer `index`'s pending fence as has arrived, without blocking; clears
// `peer.fence` once it is read and matches. A mismatch, a kError in its place, or the stream
// ending is the error returned.
Status takeFence(Peer& peer, int index);

// Once peer.fenceIn is whole: whether it is the fence expected from peer `index`.
bool fenceMatches(const Peer& peer, int index);
// Once peer.fenceIn is whole: clears the pending fence; Ok if it matches, else the error (a
// Mismatch, or the peer's failure if a kError stands in its place). `after` holds what the
// caller read past it when it does not match (the start of a kError's text).
Status fenceVerdict(Peer& peer, int index, std::string after);
// The error for a stream that ended (`err`: errno, or 0 for an orderly end) where the fence
// was due.
Status fenceEnded(Peer& peer, int index, int err);

// Reads every pending fence, waiting up to `dl`.
Status awaitFences(std::vector<Peer>& peers, int rank, const Deadline& dl, const AbortToken& abort);

}  // namespace resilient_comm::tcp
