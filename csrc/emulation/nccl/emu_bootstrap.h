// The NCCL emulator's bootstrap, modelled on NCCL's (bootstrap.cc): ncclGetUniqueId starts a
// root in the calling process, a thread listening on an ephemeral port, and the unique id names
// it (host, port, a random nonce). Every rank of the new communicator dials the root and sends
// its own listening address; once all nranks have, the root sends each the whole address book
// and exits. Like NCCL's root, it lives in the process that made the id: if that process dies
// before every rank arrived, the others wait until their init is aborted.
//
// A connection that does not start with this id's nonce within a second is dropped (a stray or
// stale dialler never stalls the root); a rank that arrives twice replaces its first hello.
//
// Threads: any; joinRoot blocks up to the deadline and wakes at once when `abort` fires.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "transport/nccl/nccl_types.h"

namespace resilient_comm::nccl::emu {

// Starts a root and fills `id` with its address; the root gives up after `lifetime`.
Status startRoot(ncclUniqueId* id, std::chrono::milliseconds lifetime);
// Sends this rank's address to the root named by `id`; returns every rank's address, by rank.
Result<std::vector<std::string>> joinRoot(const ncclUniqueId& id, int rank, int nranks, const std::string& myAddr,
                                          const Deadline& dl, const AbortToken& abort);
// The nonce of an id (it also names the communicator on the wire); 0 if `id` is not an
// emulator's id.
uint64_t idNonce(const ncclUniqueId& id);

}  // namespace resilient_comm::nccl::emu
