#include "transport/tcp/resync.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <string>

#include "common/check.h"
#include "transport/tcp/wire.h"

namespace resilient_comm::tcp {

namespace {

constexpr size_t kHdr = sizeof(WireHeader);
constexpr uint64_t kMaxErrorText = 4096;

struct Pair {
  int peer;
  WireHeader out{};  // our fence
  size_t sent = 0;
  WireHeader in{};  // the peer's frame being read
  size_t got = 0;
  uint64_t skip = 0;      // payload bytes of the current frame still to discard
  bool capture = false;   // the payload is the text of a build failure of this communicator
  std::string text;
  bool fenced = false;    // the peer's fence arrived
  bool gone = false;      // the stream ended or is garbled: connect afresh

  bool done() const {
    return gone || (fenced && sent == kHdr);
  }
};

bool wouldBlock(int err) {
  return err == EAGAIN || err == EWOULDBLOCK || err == EINTR;
}

// Reads from the peer until its fence, the end of what is available, or a verdict.
Status readUntilFence(Pair& p, int fd, uint64_t hash) {
  char sink[64 * 1024];
  while (!p.fenced && !p.gone) {
    ssize_t r;
    if (p.skip > 0) {
      r = ::recv(fd, sink, std::min<uint64_t>(p.skip, sizeof(sink)), MSG_DONTWAIT);
      if (r > 0) {
        p.skip -= static_cast<uint64_t>(r);
        if (p.capture) {
          p.text.append(sink, static_cast<size_t>(r));
          if (p.skip == 0) {
            return Status(static_cast<StatusCode>(p.in.dtype) == StatusCode::kMismatch ? StatusCode::kMismatch
                                                                                        : StatusCode::kPeerFailure,
                          "rank " + std::to_string(p.peer) + " could not build this communicator: " + p.text);
          }
        }
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
        } else if (h.kind == static_cast<uint8_t>(MsgKind::kFence)) {
          if (h.tag != hash || h.seq != static_cast<uint64_t>(p.peer)) {
            return Status(StatusCode::kMismatch,
                          "rank " + std::to_string(p.peer) + " is building a different communicator (its member " +
                              "list, color or epoch differs); every member must shrink with the same arguments");
          }
          p.fenced = true;
        } else if (h.kind == static_cast<uint8_t>(MsgKind::kError) && h.tag == hash) {
          if (h.bytes == 0 || h.bytes > kMaxErrorText) {
            return Status(StatusCode::kPeerFailure,
                          "rank " + std::to_string(p.peer) + " could not build this communicator");
          }
          p.capture = true;
          p.skip = h.bytes;
        } else {
          p.skip = h.bytes;  // the parent's data or error frames: discarded
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

Status runPairs(std::vector<Pair>& pairs, std::vector<Peer>& peers, uint64_t hash, const Deadline& dl,
                const AbortToken& abort) {
  std::vector<pollfd> fds;
  std::vector<Pair*> who;
  for (Pair& p : pairs) {
    writeFence(p, peers[p.peer].sock.fd());
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
      ev |= p.fenced ? 0 : POLLIN;
      fds.push_back(pollfd{peers[p.peer].sock.fd(), ev, 0});
      who.push_back(&p);
    }
    if (fds.empty()) {
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
      return Status(StatusCode::kTimeout, "rank(s) " + missing + " never resynchronised their connection before the " +
                                              "deadline (did they shrink with the same arguments?)");
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
      RC_RETURN_IF_ERROR(readUntilFence(p, fds[i].fd, hash));
      if (!p.fenced && (fds[i].revents & (POLLHUP | POLLERR))) {
        p.gone = true;
      }
    }
  }
}

}  // namespace

Status resyncStreams(int rank, uint64_t hash, std::vector<Peer>& peers, std::mutex& mu, const Deadline& dl,
                     const AbortToken& abort, std::vector<int>* gone) {
  std::vector<Pair> pairs;
  for (int j = 0; j < static_cast<int>(peers.size()); ++j) {
    if (j == rank || !peers[j].sock.valid()) {
      continue;
    }
    Pair p;
    p.peer = j;
    p.out.magic = kWireMagic;
    p.out.kind = static_cast<uint8_t>(MsgKind::kFence);
    p.out.seq = static_cast<uint64_t>(rank);
    p.out.tag = hash;
    pairs.push_back(p);
  }
  Status st = runPairs(pairs, peers, hash, dl, abort);
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
    if (p.gone) {
      peers[p.peer].sock.shutdownBoth();
      peers[p.peer].sock = Socket();
      gone->push_back(p.peer);
    }
  }
  return Status::ok();
}

}  // namespace resilient_comm::tcp
