// Resynchronising reused streams for a shrunk communicator.
//
// [Note: fence resync]
// A shrink after an error keeps the survivors' connections (see mesh.h). Each such stream was
// left at a message boundary in both directions by the failed parent (a stream cut in the
// middle of a message is marked dirty and shut down instead, transfer.h), but the peer may
// still have queued whole frames of the parent's last op, kError frames, or nothing at all.
// So both ends write a kFence frame carrying the new communicator's hash and their new rank,
// and read the other's stream frame by frame (header, then exactly `bytes` of payload, never
// past a frame), discarding everything until the peer's fence. Every pair runs together in one
// poll loop, so the whole resync costs about one round trip.
//
// Outcomes per pair: the fences match (the stream is reused); the fence names another
// communicator, or the peer reports that its build of this communicator failed (a kError
// tagged with the hash): the build fails with that cause; the stream ends or is garbled (the
// peer dropped it, or died): the pair is marked for a fresh connection, which both ends then
// agree on because a dropped stream always ends at both.
//
// When the build fails here, every stream still at a frame boundary gets a kError tagged with
// the hash, so peers still resynchronising learn the cause at once.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "transport/tcp/transfer.h"

namespace resilient_comm::tcp {

// Resynchronises every valid socket in `peers` (rank `rank` of the communicator `hash`). A
// stream that cannot be resynchronised is shut down and replaced, under `mu`, by an invalid
// socket, for the caller to connect afresh; `gone` receives those peers.
Status resyncStreams(int rank, uint64_t hash, std::vector<Peer>& peers, std::mutex& mu, const Deadline& dl,
                     const AbortToken& abort, std::vector<int>* gone);

}  // namespace resilient_comm::tcp
