#include "transport/tcp/mesh.h"

#include "common/check.h"
#include "transport/tcp/resync.h"
#include "transport/tcp/wire.h"

namespace resilient_comm::tcp {

namespace {

constexpr uint8_t kAccepted = 1;
constexpr uint8_t kOtherComm = 2;

void store(std::vector<Peer>& peers, int r, Socket s, std::mutex& mu, const AbortToken& abort) {
  std::lock_guard<std::mutex> lock(mu);
  peers[r].sock = std::move(s);
  if (abort.aborted()) {
    peers[r].sock.shutdownBoth();
  }
}

}  // namespace

uint64_t fnv1a(const std::string& s, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char ch : s) {
    h = (h ^ ch) * 1099511628211ULL;
  }
  return h;
}

Status buildMesh(const MeshSpec& spec, Listener& listener, std::vector<Peer>& peers, std::mutex& mu,
                 const Deadline& dl, const AbortToken& abort, int* reused) {
  const int rank = spec.rank;
  const int size = spec.size;
  listener.started(spec.hash);
  std::vector<int> gone;
  *reused = 0;
  if (spec.parent != 0) {
    RC_RETURN_IF_ERROR(resyncStreams(rank, spec.hash, spec.parent, peers, mu, dl, abort, &gone));
    for (const Peer& p : peers) {
      *reused += p.sock.valid() ? 1 : 0;
    }
    if (*reused < size - 1) {
      // Connecting afresh waits for the peers anyway: read their fences first, so that
      // members that shrank with other arguments fail now rather than at the deadline.
      RC_RETURN_IF_ERROR(awaitFences(peers, rank, dl, abort));
    }
  }
  auto dial = [&](int j) -> Result<Socket> {
    const std::string& addr = spec.addrs[j];
    auto colon = addr.rfind(':');
    if (colon == std::string::npos) {
      return Status(StatusCode::kInternal, "malformed address '" + addr + "' for rank " + std::to_string(j));
    }
    Result<Socket> s =
        connectTo(addr.substr(0, colon), std::stoi(addr.substr(colon + 1)), dl, abort, /*retryRefused=*/!spec.derived);
    if (!s.isOk()) {
      return s.status().withContext("connecting to rank " + std::to_string(j) + " at " + addr);
    }
    return s;
  };
  // A higher rank whose reused stream ended must dial us afresh, unless it died: a dead
  // process refuses connections, so one probe tells at once instead of at the deadline. A
  // live peer's accept loop drops the probe (no Hello).
  for (int j : gone) {
    if (j > rank) {
      RC_RETURN_IF_ERROR(dial(j).status());
    }
  }
  for (int j = 0; j < rank; ++j) {
    if (peers[j].sock.valid()) {
      continue;  // resynchronised
    }
    Result<Socket> s = dial(j);
    RC_RETURN_IF_ERROR(s.status());
    Hello hello{kWireMagic, rank, size, 0, spec.hash};
    RC_RETURN_IF_ERROR(writeAll(s.value(), &hello, sizeof(hello), dl, abort));
    uint8_t answer = 0;
    Status st = readAll(s.value(), &answer, 1, dl, abort);
    if (st.code() == StatusCode::kAborted || st.code() == StatusCode::kTimeout) {
      return st.withContext("waiting for rank " + std::to_string(j) + " to accept");
    }
    if (!st.isOk() || answer != kAccepted) {
      return Status(StatusCode::kMismatch,
                    "rank " + std::to_string(j) + " is building a different communicator (" +
                        (st.isOk() ? "its member list, color or epoch differs" : st.message()) +
                        "); every member must shrink/split/grow with the same arguments");
    }
    store(peers, j, s.take(), mu, abort);
  }
  auto missing = [&] {
    std::string m;
    std::lock_guard<std::mutex> lock(mu);
    for (int j = rank + 1; j < size; ++j) {
      if (!peers[j].sock.valid()) {
        m += (m.empty() ? "" : ", ") + std::to_string(j);
      }
    }
    return m;
  };
  for (std::string waiting = missing(); !waiting.empty(); waiting = missing()) {
    Result<Socket> s = acceptOne(listener.socket(), dl, abort);
    if (s.status().code() == StatusCode::kTimeout) {
      return Status(StatusCode::kTimeout, "rank(s) " + waiting + " never connected before the deadline");
    }
    RC_RETURN_IF_ERROR(s.status());
    Hello hello{};
    Status st = readAll(s.value(), &hello, sizeof(hello), dl, abort);
    if (st.code() == StatusCode::kAborted) {
      return st;
    }
    if (!st.isOk() || hello.magic != kWireMagic) {
      continue;  // not one of ours, or it gave up: keep accepting
    }
    if (hello.commHash != spec.hash && listener.wasStarted(hello.commHash)) {
      continue;  // left in the backlog by an earlier build on this listener, since abandoned
    }
    if (hello.commHash != spec.hash || hello.size != size || hello.rank <= rank || hello.rank >= size) {
      uint8_t no = kOtherComm;
      (void)writeAll(s.value(), &no, 1, dl, abort);
      return Status(StatusCode::kMismatch,
                    "a peer connected as rank " + std::to_string(hello.rank) + " of " + std::to_string(hello.size) +
                        " for a different communicator (its member list, color or epoch differs from rank " +
                        std::to_string(rank) + "'s); every member must shrink/split/grow with the same arguments");
    }
    bool dup = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      dup = peers[hello.rank].sock.valid();
    }
    if (dup) {
      return Status(StatusCode::kMismatch, "two peers claimed rank " + std::to_string(hello.rank));
    }
    uint8_t yes = kAccepted;
    RC_RETURN_IF_ERROR(writeAll(s.value(), &yes, 1, dl, abort));
    store(peers, hello.rank, s.take(), mu, abort);
  }
  return Status::ok();
}

}  // namespace resilient_comm::tcp
