#include "transport/tcp/resync.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/check.h"
#include "transport/tcp/wire.h"

namespace resilient_comm::tcp {

namespace {

constexpr size_t kHdr = sizeof(WireHeader);

struct Pair {
  int peer;
  WireHeader out{};  // our fence
  size_t sent = 0;
  WireHeader in{};  // the peer's frame being read
  size_t got = 0;
  uint64_t skip = 0;     // payload bytes of the current frame still to discard
  uint64_t ringSkip = 0;  // the same, where the payload is in the pair's ring (shm.h)
  bool last = false;     // the frame being discarded is the parent's kError
  bool ended = false;    // the peer's parent kError was read
  bool gone = false;     // the stream ended or is garbled: connect afresh

  bool done() const {
    return gone || (ended && sent == kHdr);
  }
};

bool wouldBlock(int err) {
  return err == EAGAIN || err == EWOULDBLOCK || err == EINTR;
}

Status otherCommunicator(int peer) {
  return Status(StatusCode::kMismatch,
                "rank " + std::to_string(peer) + " is building a different communicator (its member list, color or " +
                    "epoch differs); every member must shrink with the same arguments");
}

// Once every peer's parent kError is read: a stream that already ended right behind it (the
// peer died, or dropped the stream) is gone. One poll for all of them.
void checkEnds(std::vector<Pair>& pairs, std::vector<Peer>& peers) {
  std::vector<pollfd> fds;
  std::vector<Pair*> who;
  for (Pair& p : pairs) {
    if (!p.gone) {
      fds.push_back(pollfd{peers[p.peer].sock.fd(), POLLRDHUP, 0});
      who.push_back(&p);
    }
  }
  if (fds.empty() || ::poll(fds.data(), fds.size(), 0) <= 0) {
    return;
  }
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
      // Gone unless frames wait in front of the end: then the first op reads them (the
      // peer's fence for another group, say, is a clearer verdict than a fresh connection).
      char c;
      who[i]->gone = ::recv(fds[i].fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) <= 0;
    }
  }
}

// Reads from the peer until its parent kError, the end of what is available, or a verdict.
Status readUntilEnd(Pair& p, Peer& peer, uint64_t parent) {
  char sink[64 * 1024];
  const int fd = peer.sock.fd();
  while (!p.ended && !p.gone) {
    ssize_t r;
    if (p.ringSkip > 0) {
      // A whole message the peer sent (its stream was clean) has all of its payload published
      // before anything that follows it on the socket: what is missing comes before the next
      // frame, unless the stream ends (the peer stopped mid-message).
      Result<size_t> n = peer.shm->read(nullptr, p.ringSkip);
      if (!n.isOk()) {
        p.gone = true;
        break;
      }
      p.ringSkip -= n.value();
      if (p.ringSkip > 0) {
        char c;
        r = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (r < 0 && wouldBlock(errno)) {
          return Status::ok();
        }
        p.gone = true;  // ended, or a frame in front of the payload's end: garbled
        break;
      }
      continue;
    }
    if (p.skip > 0) {
      r = ::recv(fd, sink, std::min<uint64_t>(p.skip, sizeof(sink)), MSG_DONTWAIT);
      if (r > 0) {
        p.skip -= static_cast<uint64_t>(r);
        p.ended = p.skip == 0 && p.last;
        continue;
      }
    } else {
      r = ::recv(fd, reinterpret_cast<char*>(&p.in) + p.got, kHdr - p.got, MSG_DONTWAIT);
      if (r > 0) {
        p.got += static_cast<size_t>(r);
        if (p.got < kHdr) {
          continue;
        }
        p.got = 0;
        const WireHeader& h = p.in;
        if (h.magic != kWireMagic) {
          p.gone = true;
        } else if (h.kind == static_cast<uint8_t>(MsgKind::kFence) && h.tag != parent) {
          return otherCommunicator(p.peer);  // a fence after the parent's end: not ours
        } else {
          // The parent's data or fence, an ancestor's kError, or the parent's own kError.
          p.last = h.kind == static_cast<uint8_t>(MsgKind::kError) && h.tag == parent;
          (viaRing(peer, h) ? p.ringSkip : p.skip) = h.bytes;
          p.ended = h.bytes == 0 && p.last;
        }
        continue;
      }
    }
    if (r < 0 && wouldBlock(errno)) {
      return Status::ok();
    }
    p.gone = true;  // ended or reset
  }
  return Status::ok();
}

void writeFence(Pair& p, int fd) {
  while (p.sent < kHdr) {
    ssize_t w = ::send(fd, reinterpret_cast<const char*>(&p.out) + p.sent, kHdr - p.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p.sent += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && wouldBlock(errno)) {
      return;
    }
    p.gone = true;
    return;
  }
}

Status runPairs(std::vector<Pair>& pairs, std::vector<Peer>& peers, uint64_t parent, const Deadline& dl,
                const AbortToken& abort) {
  std::vector<pollfd> fds;
  std::vector<Pair*> who;
  for (Pair& p : pairs) {
    writeFence(p, peers[p.peer].sock.fd());
    RC_RETURN_IF_ERROR(readUntilEnd(p, peers[p.peer], parent));  // usually all there: no wait at all
  }
  for (;;) {
    fds.clear();
    who.clear();
    for (Pair& p : pairs) {
      if (p.done()) {
        continue;
      }
      short ev = POLLRDHUP;
      ev |= p.sent < kHdr ? POLLOUT : 0;
      ev |= p.ended ? 0 : POLLIN;
      fds.push_back(pollfd{peers[p.peer].sock.fd(), ev, 0});
      who.push_back(&p);
    }
    if (fds.empty()) {
      checkEnds(pairs, peers);
      return Status::ok();
    }
    if (abort.aborted()) {
      return Status(StatusCode::kAborted, "resynchronising connections interrupted: " + abort.reason());
    }
    if (dl.passed()) {
      std::string missing;
      for (const Pair* p : who) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(p->peer);
      }
      return Status(StatusCode::kTimeout, "the failed communicator of rank(s) " + missing + " never ended before the " +
                                              "deadline (are they still running an op on it, or did they not shrink?)");
    }
    // abort() shuts these sockets down, which wakes the poll; the slice is a second line.
    int rc = ::poll(fds.data(), fds.size(), dl.remainingMs(10));
    if (rc < 0 && errno != EINTR) {
      return RC_SYS_ERROR("poll");
    }
    for (size_t i = 0; i < fds.size() && rc > 0; ++i) {
      if (fds[i].revents == 0) {
        continue;
      }
      Pair& p = *who[i];
      if (p.sent < kHdr) {
        writeFence(p, fds[i].fd);
      }
      RC_RETURN_IF_ERROR(readUntilEnd(p, peers[p.peer], parent));
      if (!p.ended && (fds[i].revents & (POLLHUP | POLLERR))) {
        p.gone = true;
      }
    }
  }
}

}  // namespace

Status resyncStreams(int rank, uint64_t hash, uint64_t parent, std::vector<Peer>& peers, std::mutex& mu,
                     const Deadline& dl, const AbortToken& abort, std::vector<int>* gone) {
  std::vector<Pair> pairs;
  for (int j = 0; j < static_cast<int>(peers.size()); ++j) {
    if (j == rank || !peers[j].sock.valid()) {
      continue;
    }
    Pair p;
    p.peer = j;
    p.ended = peers[j].ended;
    p.out.magic = kWireMagic;
    p.out.kind = static_cast<uint8_t>(MsgKind::kFence);
    p.out.seq = static_cast<uint64_t>(rank);
    p.out.tag = hash;
    pairs.push_back(p);
  }
  Status st = runPairs(pairs, peers, parent, dl, abort);
  if (!st.isOk()) {
    if (st.code() != StatusCode::kAborted) {
      for (const Pair& p : pairs) {
        peers[p.peer].dirty = peers[p.peer].dirty || p.gone || (p.sent != 0 && p.sent != kHdr);
      }
      sendErrorFrames(peers, rank, st, 0, hash);
    }
    return st;
  }
  std::lock_guard<std::mutex> lock(mu);
  for (const Pair& p : pairs) {
    Peer& peer = peers[p.peer];
    if (p.gone) {
      peer.sock.shutdownBoth();
      peer.sock = Socket();
      peer.shm.reset();
      gone->push_back(p.peer);
      continue;
    }
    peer.ended = false;
    peer.fence = hash;
    peer.fenceGot = 0;
  }
  return Status::ok();
}

Status fenceEnded(Peer& peer, int index, int err) {
  peer.hangupSeen = true;
  return Status(StatusCode::kPeerFailure,
                "rank " + std::to_string(index) + " closed its connection before it joined the shrunk communicator" +
                    (err != 0 ? std::string(" (") + std::strerror(err) + ")" : std::string()) +
                    ": it died, gave up the shrink, or is building a different communicator without this rank " +
                    "(every member must shrink with the same arguments)");
}

bool fenceMatches(const Peer& peer, int index) {
  const WireHeader& h = peer.fenceIn;
  return h.magic == kWireMagic && h.kind == static_cast<uint8_t>(MsgKind::kFence) && h.tag == peer.fence &&
         h.seq == static_cast<uint64_t>(index);
}

Status fenceVerdict(Peer& peer, int index, std::string after) {
  const bool match = fenceMatches(peer, index);
  const WireHeader h = peer.fenceIn;
  peer.fenceGot = 0;
  peer.fence = 0;
  if (match) {
    return Status::ok();
  }
  if (h.magic != kWireMagic) {
    peer.dirty = true;
    return Status(StatusCode::kInternal, "corrupt stream from rank " + std::to_string(index) + " (bad magic)");
  }
  if (h.kind == static_cast<uint8_t>(MsgKind::kError)) {
    bool clean = false;
    Status st = peerErrorStatus(peer, index, h, std::move(after), &clean);
    peer.ended = clean;
    peer.dirty = peer.dirty || !clean;
    return st;
  }
  if (h.kind != static_cast<uint8_t>(MsgKind::kFence) || !after.empty()) {
    peer.dirty = true;  // a frame left half read
  }
  return otherCommunicator(index);
}

Status takeFence(Peer& peer, int index) {
  const int fd = peer.sock.fd();
  while (peer.fenceGot < kHdr) {
    ssize_t r = ::recv(fd, reinterpret_cast<char*>(&peer.fenceIn) + peer.fenceGot, kHdr - peer.fenceGot, MSG_DONTWAIT);
    if (r > 0) {
      peer.fenceGot += static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && wouldBlock(errno)) {
      return Status::ok();
    }
    return fenceEnded(peer, index, r < 0 ? errno : 0);
  }
  return fenceVerdict(peer, index, std::string());
}

Status awaitFences(std::vector<Peer>& peers, int rank, const Deadline& dl, const AbortToken& abort) {
  std::vector<pollfd> fds;
  std::vector<int> who;
  for (;;) {
    fds.clear();
    who.clear();
    for (int j = 0; j < static_cast<int>(peers.size()); ++j) {
      if (j == rank || peers[j].fence == 0 || !peers[j].sock.valid()) {
        continue;
      }
      RC_RETURN_IF_ERROR(takeFence(peers[j], j));
      if (peers[j].fence != 0) {
        fds.push_back(pollfd{peers[j].sock.fd(), POLLIN | POLLRDHUP, 0});
        who.push_back(j);
      }
    }
    if (fds.empty()) {
      return Status::ok();
    }
    if (abort.aborted()) {
      return Status(StatusCode::kAborted, "waiting for the shrunk communicator's peers interrupted: " + abort.reason());
    }
    if (dl.passed()) {
      std::string missing;
      for (int j : who) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(j);
      }
      return Status(StatusCode::kTimeout, "rank(s) " + missing + " did not join the shrunk communicator before the " +
                                              "deadline (did they shrink with the same arguments?)");
    }
    int rc = ::poll(fds.data(), fds.size(), dl.remainingMs(10));
    if (rc < 0 && errno != EINTR) {
      return RC_SYS_ERROR("poll");
    }
  }
}

}  // namespace resilient_comm::tcp
