#include "transport/tcp/transfer.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <string>

#include "common/check.h"
#include "transport/tcp/mesh.h"
#include "transport/tcp/reduce.h"
#include "transport/tcp/resync.h"

namespace resilient_comm::tcp {

namespace {

constexpr size_t kHdr = sizeof(WireHeader);
constexpr size_t kMaxErrorText = 4096;
// After a shrink each peer's first frame is its fence (resync.h), read with the first message
// this communicator receives from that peer. A peer an op does not receive from is watched
// for it (and for a kError behind it) only once the op has waited this long: reading every
// fence as it lands would wake the first op of a shrunk group once per peer, while a peer
// that built another group, or failed to build, is still found about this soon.
constexpr std::chrono::milliseconds kWatchFencedAfter{1};
// A higher rank that has not dialled within this long is probed (and then every
// kProbeEvery): one that died is a PeerFailure at once rather than at the deadline.
constexpr std::chrono::milliseconds kProbeAfter{100};
constexpr std::chrono::milliseconds kProbeEvery{500};
// In run()'s poll set, the doorbell of peer p's rings is tagged kBellOf - p, its liveness lock
// deathOf(p), below them.
// What a peer sent before it died (or before it left with _exit, its part done) still counts:
// an op that needs a peer whose liveness lock says it died reads what arrives for this long
// (loopback delivery can be deferred to ksoftirqd) before it fails; poll(2)'s whole
// milliseconds make it ~1 ms.
constexpr std::chrono::microseconds kDeathGrace{500};
constexpr int kBellOf = -3;

std::string describeHeader(const WireHeader& h) {
  std::string s = std::string(opKindName(static_cast<OpKind>(h.op))) + " #" + std::to_string(h.seq) + " (" +
                  std::to_string(h.bytes) + " bytes of " + dataTypeName(static_cast<DataType>(h.dtype));
  if (static_cast<OpKind>(h.op) == OpKind::kAllReduce || static_cast<OpKind>(h.op) == OpKind::kReduce ||
      static_cast<OpKind>(h.op) == OpKind::kReduceScatter) {
    s += std::string(", ") + redOpName(static_cast<RedOp>(h.redop));
  }
  if (static_cast<OpKind>(h.op) == OpKind::kSendRecv) {
    s += ", tag " + std::to_string(h.tag);
  } else if (h.tag != 0) {
    s += ", root " + std::to_string(h.tag - 1);
  }
  return s + ")";
}

bool wouldBlock(int err) {
  return err == EAGAIN || err == EWOULDBLOCK || err == EINTR;
}

}  // namespace

Transfer::Transfer(std::vector<Peer>& peers, int self, const MsgMeta& meta, const Deadline& dl,
                   const AbortToken& abort, Links* links)
    : peers_(peers),
      self_(self),
      meta_(meta),
      dl_(dl),
      abort_(abort),
      q_(peers.size()),
      ignoreInput_(peers.size(), false),
      links_(links),
      probeAt_(Deadline::after(kProbeAfter)) {}

WireHeader Transfer::header(size_t bytes, uint64_t seq, uint64_t tag) const {
  WireHeader h{};
  h.magic = kWireMagic;
  h.kind = static_cast<uint8_t>(MsgKind::kData);
  h.op = static_cast<uint8_t>(meta_.op);
  h.dtype = static_cast<uint8_t>(meta_.dtype);
  h.redop = static_cast<uint8_t>(meta_.redop);
  h.seq = seq;
  h.bytes = bytes;
  h.tag = tag;
  return h;
}

void Transfer::send(int peer, const void* buf, size_t bytes) {
  sendP2P(peer, buf, bytes, meta_.seq, meta_.tag);
}

void Transfer::sendConfirmed(int peer, const void* buf, size_t bytes) {
  WireHeader h = header(bytes, meta_.seq, meta_.tag);
  h.kind = static_cast<uint8_t>(MsgKind::kDataAck);
  q_[peer].sends.push_back(SendItem{h, static_cast<const char*>(buf), 0});
  WireHeader ack = header(0, meta_.seq, meta_.tag);
  ack.kind = static_cast<uint8_t>(MsgKind::kAck);
  q_[peer].recvs.push_back(RecvItem{ack, {}, nullptr, 0, false, nullptr});
}

void Transfer::sendP2P(int peer, const void* buf, size_t bytes, uint64_t seq, uint64_t tag) {
  q_[peer].sends.push_back(SendItem{header(bytes, seq, tag), static_cast<const char*>(buf), 0});
}

void Transfer::recv(int peer, void* buf, size_t bytes, Callback onDone) {
  q_[peer].recvs.push_back(
      RecvItem{header(bytes, meta_.seq, meta_.tag), {}, static_cast<char*>(buf), 0, false, std::move(onDone)});
}

void Transfer::recvReduce(int peer, void* scratch, void* target, size_t bytes, DataType dt, RedOp op,
                          Callback onDone) {
  RecvItem it{header(bytes, meta_.seq, meta_.tag), {}, static_cast<char*>(scratch), 0, false, std::move(onDone)};
  it.target = static_cast<char*>(target);
  it.dt = dt;
  it.op = op;
  q_[peer].recvs.push_back(std::move(it));
}

void Transfer::recvP2P(int peer, void* buf, size_t bytes, uint64_t seq, uint64_t tag) {
  q_[peer].recvs.push_back(RecvItem{header(bytes, seq, tag), {}, static_cast<char*>(buf), 0, false, nullptr});
}

void Transfer::recvAny(void* buf, size_t bytes, uint64_t tag, std::vector<uint64_t>& seqs, int* source) {
  any_ = AnyRecv{true, static_cast<char*>(buf), bytes, tag, &seqs, source};
}

Status Transfer::peerAlive(int peer, Deadline* soonest) {
  const liveness::Watch& live = *peers_[peer].live;
  const Deadline dead = live.deadAfter(kDeathGrace);
  if (!dead.passed()) {  // alive, or its grace runs
    *soonest = soonest->earliest(dead);
    return Status::ok();
  }
  return Status(StatusCode::kPeerFailure, "rank " + std::to_string(peer) + " died while rank " +
                                              std::to_string(self_) + " waited on it (" + live.why() + ")");
}

int Transfer::deathOf(int peer) const {
  return kBellOf - static_cast<int>(peers_.size()) - peer;  // below every doorbell's tag
}

Status Transfer::anyPeersLeft() const {
  if (!any_.open) {
    return Status::ok();
  }
  for (size_t p = 0; p < peers_.size(); ++p) {
    if (static_cast<int>(p) != self_ && !peers_[p].hangupSeen) {
      return Status::ok();
    }
  }
  return Status(StatusCode::kPeerFailure, "every other rank hung up while rank " + std::to_string(self_) +
                                              " waited to receive from any source");
}

bool Transfer::pending() const {
  if (any_.open) {
    return true;
  }
  for (const Queues& q : q_) {
    if (!q.sends.empty() || !q.recvs.empty()) {
      return true;
    }
  }
  return false;
}

bool Transfer::sendInRing(int peer) const {
  const Queues& q = q_[peer];
  return !q.sends.empty() && q.sends.front().done >= kHdr && viaRing(peers_[peer], q.sends.front().hdr);
}

bool Transfer::recvInRing(int peer) const {
  const Queues& q = q_[peer];
  return !q.recvs.empty() && q.recvs.front().checked && viaRing(peers_[peer], q.recvs.front().expect);
}

Status Transfer::progressSend(int peer, bool* progressed) {
  Queues& q = q_[peer];
  while (!q.sends.empty()) {
    SendItem& it = q.sends.front();
    const size_t total = kHdr + it.hdr.bytes;
    const bool ring = viaRing(peers_[peer], it.hdr);
    if (ring && it.done >= kHdr) {  // the header went through the socket; the payload goes here
      Result<size_t> n = peers_[peer].shm->write(it.buf + (it.done - kHdr), total - it.done);
      if (!n.isOk()) {
        return n.status();
      }
      if (n.value() == 0) {
        return Status::ok();  // the ring is full: the peer's bell says when it is not
      }
      *progressed = true;
      it.done += n.value();
      if (it.done == total) {
        q.sends.pop_front();
      }
      continue;
    }
    iovec iov[2];
    int n = 0;
    if (it.done < kHdr) {
      iov[n++] = {reinterpret_cast<char*>(&it.hdr) + it.done, kHdr - it.done};
      if (it.hdr.bytes > 0 && !ring) {
        iov[n++] = {const_cast<char*>(it.buf), it.hdr.bytes};
      }
    } else {
      iov[n++] = {const_cast<char*>(it.buf) + (it.done - kHdr), total - it.done};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    ssize_t w = ::sendmsg(peers_[peer].sock.fd(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (wouldBlock(errno)) {
        return Status::ok();
      }
      if (peers_[peer].fence != 0) {
        return fenceEnded(peers_[peer], peer, errno);  // it never joined this (shrunk) group
      }
      return Status(StatusCode::kPeerFailure, "lost the connection to rank " + std::to_string(peer) + " (send: " +
                                                  std::strerror(errno) + "); it died or aborted");
    }
    *progressed = true;
    it.done += static_cast<size_t>(w);
    if (it.done < (ring ? kHdr : total)) {
      return Status::ok();
    }
    if (it.done == total) {
      q.sends.pop_front();
    }
  }
  return Status::ok();
}

Status Transfer::checkHeader(int peer, RecvItem& item) {
  const WireHeader& g = item.got;
  const WireHeader& e = item.expect;
  if (g.magic != kWireMagic) {
    return Status(StatusCode::kInternal, "corrupt stream from rank " + std::to_string(peer) + " (bad magic)");
  }
  if (g.kind == static_cast<uint8_t>(MsgKind::kError)) {
    return peerError(peer, item);
  }
  const bool wantAck = e.kind == static_cast<uint8_t>(MsgKind::kAck);
  const bool isAck = g.kind == static_cast<uint8_t>(MsgKind::kAck);
  const bool isData = g.kind == static_cast<uint8_t>(MsgKind::kData) || g.kind == static_cast<uint8_t>(MsgKind::kDataAck);
  if (g.op != e.op || g.seq != e.seq || g.bytes != e.bytes || g.dtype != e.dtype || g.redop != e.redop ||
      g.tag != e.tag || wantAck != isAck || !(isAck || isData)) {
    const std::string want = wantAck ? std::string("its confirmation of ") + opKindName(static_cast<OpKind>(e.op)) + " #" +
                                           std::to_string(e.seq)
                                     : describeHeader(e);
    return Status(StatusCode::kMismatch,
                  "rank " + std::to_string(peer) + " sent " + (isAck ? "a confirmation of " : "") + describeHeader(g) +
                      " where rank " + std::to_string(self_) + " expected " + want +
                      "; every rank must call the same collectives in the same order with matching tensors");
  }
  item.checked = true;
  if (g.kind == static_cast<uint8_t>(MsgKind::kDataAck)) {
    WireHeader ack = header(0, g.seq, g.tag);
    ack.kind = static_cast<uint8_t>(MsgKind::kAck);
    q_[peer].sends.push_back(SendItem{ack, nullptr, 0});  // sent before this op ends (run)
  }
  return Status::ok();
}

namespace {

// A peer's error text goes into exceptions and logs: keep well-formed UTF-8, printable, and
// replace anything else (a garbled stream, a hostile peer) with '?'.
std::string printableText(const std::string& in) {
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size();) {
    const auto c = static_cast<unsigned char>(in[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool ok = len > 0 && i + len <= in.size() && (len > 1 || c >= 0x20 || c == '\n' || c == '\t') && c != 0x7f;
    for (size_t k = 1; ok && k < len; ++k) {
      ok = (static_cast<unsigned char>(in[i + k]) & 0xc0) == 0x80;
    }
    if (ok) {
      out.append(in, i, len);
      i += len;
    } else {
      out.push_back('?');
      ++i;
    }
  }
  return out;
}

}  // namespace

Status peerErrorStatus(Peer& peer, int index, const WireHeader& h, std::string text, bool* clean) {
  const size_t textLen = std::min<size_t>(h.bytes, kMaxErrorText);
  *clean = text.size() <= h.bytes && h.bytes <= kMaxErrorText;
  while (*clean && text.size() < textLen) {
    char buf[kMaxErrorText];
    pollfd p{peer.sock.fd(), POLLIN, 0};
    ssize_t r = ::poll(&p, 1, 50) > 0 ? ::recv(p.fd, buf, textLen - text.size(), MSG_DONTWAIT) : -1;
    if (r <= 0) {
      *clean = false;
      break;
    }
    text.append(buf, static_cast<size_t>(r));
  }
  text.resize(std::min(text.size(), textLen));
  auto code = static_cast<StatusCode>(h.dtype);
  if (code != StatusCode::kMismatch && code != StatusCode::kTimeout) {
    code = StatusCode::kPeerFailure;
  }
  return Status(code, "rank " + std::to_string(index) + " failed: " + printableText(text));
}

Status Transfer::peerError(int peer, RecvItem& item) {
  // The text may have landed in the payload buffer already (read with the header).
  const size_t inBuf = item.done - kHdr;
  std::string text(item.buf ? item.buf : "", item.buf ? inBuf : 0);
  bool clean = false;
  Status st = peerErrorStatus(peers_[peer], peer, item.got, std::move(text), &clean);
  if (clean) {
    item.done = 0;
    item.checked = false;
    peers_[peer].ended = true;  // nothing of this communicator follows (wire.h)
  } else {
    peers_[peer].dirty = true;
  }
  return st;
}

Status Transfer::peekUnexpected(int peer) {
  if (peers_[peer].fence != 0) {
    // A shrink's fence comes first (resync.h): reading it now tells a mismatch at once.
    RC_RETURN_IF_ERROR(takeFence(peers_[peer], peer));
    if (peers_[peer].fence != 0) {
      return Status::ok();  // the rest of it is on its way
    }
  }
  const int fd = peers_[peer].sock.fd();
  WireHeader h{};
  ssize_t r = ::recv(fd, &h, kHdr, MSG_PEEK | MSG_DONTWAIT);
  if (r < 0 && wouldBlock(errno)) {
    return Status::ok();
  }
  if (r <= 0) {
    peers_[peer].hangupSeen = true;  // closed or reset: the hang-up checks decide
    ignoreInput_[peer] = true;
    return Status::ok();
  }
  if (static_cast<size_t>(r) < kHdr) {
    return Status::ok();  // the rest of the header is on its way
  }
  if (any_.open && h.magic == kWireMagic && h.kind == static_cast<uint8_t>(MsgKind::kData) &&
      h.op == static_cast<uint8_t>(OpKind::kSendRecv) && h.tag == any_.tag && h.seq == (*any_.seqs)[peer]) {
    // The message recvAny() waits for: received from this peer like any other (its size is
    // checked there), and no longer from anyone else.
    any_.open = false;
    *any_.source = peer;
    recvP2P(peer, any_.buf, any_.bytes, (*any_.seqs)[peer]++, any_.tag);
    return progressRecv(peer);
  }
  if (h.magic != kWireMagic || h.kind != static_cast<uint8_t>(MsgKind::kError)) {
    ignoreInput_[peer] = true;
    return Status::ok();
  }
  RecvItem item{h, h, nullptr, kHdr, true, nullptr};
  (void)::recv(fd, &h, kHdr, MSG_DONTWAIT);  // consume the header peeked at
  return peerError(peer, item);
}

// The peer's fence is due before the first message this op receives from it: one read takes
// the fence and as much of that message as has arrived (resync.h).
Status Transfer::progressFence(int peer) {
  Peer& p = peers_[peer];
  RecvItem& it = q_[peer].recvs.front();
  if (p.fenceGot != 0 || it.done != 0) {
    return takeFence(p, peer);  // the rest of a fence already begun
  }
  iovec iov[3] = {{&p.fenceIn, kHdr}, {&it.got, kHdr}, {it.buf, it.expect.bytes}};
  ssize_t r = ::readv(p.sock.fd(), iov, it.expect.bytes > 0 && !viaRing(p, it.expect) ? 3 : 2);
  if (r < 0 && wouldBlock(errno)) {
    return Status::ok();
  }
  if (r <= 0) {
    return fenceEnded(p, peer, r < 0 ? errno : 0);
  }
  const size_t got = static_cast<size_t>(r);
  p.fenceGot = std::min(got, kHdr);
  if (p.fenceGot < kHdr) {
    return Status::ok();
  }
  const size_t past = got - kHdr;  // bytes of the next frame, in it.got and then it.buf
  if (fenceMatches(p, peer)) {
    RC_RETURN_IF_ERROR(fenceVerdict(p, peer, std::string()));
    it.done = past;
    if (!it.checked && it.done >= kHdr) {
      RC_RETURN_IF_ERROR(checkHeader(peer, it));
    }
    return Status::ok();  // progressRecv goes on with the message
  }
  std::string after(reinterpret_cast<const char*>(&it.got), std::min(past, kHdr));
  if (past > kHdr) {
    after.append(it.buf, past - kHdr);
  }
  return fenceVerdict(p, peer, std::move(after));
}

void Transfer::markDirty(bool sending) {
  for (size_t p = 0; p < q_.size(); ++p) {
    const Queues& q = q_[p];
    const bool mid = sending ? !q.sends.empty() && q.sends.front().done != 0
                             : (!q.recvs.empty() && q.recvs.front().done != 0) ||
                                   (peers_[p].fence != 0 && peers_[p].fenceGot != 0);
    if (mid) {
      peers_[p].dirty = true;
    }
  }
}

int rateBucket(double bytesPerSecond) {
  const double b = std::floor(4.0 * std::log2(std::max(bytesPerSecond, 1.0) / (1024.0 * 1024.0)));
  return static_cast<int>(std::clamp(b, 0.0, static_cast<double>(kRateBuckets - 1)));
}

// One read of the message `it` from `peer`; `*blocked` when nothing has arrived.
Status Transfer::readMore(int peer, RecvItem& it, bool* blocked) {
  *blocked = false;
  const size_t total = kHdr + it.expect.bytes;
  const bool ring = viaRing(peers_[peer], it.expect);
  if (ring && it.checked) {  // the header matched: the payload comes through the ring
    const size_t at = it.done - kHdr;
    Result<size_t> got =
        it.target == nullptr ? peers_[peer].shm->read(it.buf + at, total - it.done)
                             : peers_[peer].shm->consume(total - it.done, [&it, at](size_t off, const char* p, size_t len) {
                                 const size_t es = dataTypeSize(it.dt);
                                 reduceInto(it.target + at + off, p, len / es, it.dt, it.op);
                               });
    if (!got.isOk()) {
      return got.status();
    }
    if (got.value() == 0) {
      if (peers_[peer].hangupSeen) {  // and nothing more was published before it
        return Status(StatusCode::kPeerFailure, "rank " + std::to_string(peer) + " closed its connection in the middle of " +
                                                    describeHeader(it.expect) + "; it died, exited or aborted");
      }
      *blocked = true;  // the peer's bell says when more is there
    }
    it.done += got.value();
    return Status::ok();
  }
  iovec iov[2];
  int n = 0;
  if (it.done < kHdr) {
    iov[n++] = {reinterpret_cast<char*>(&it.got) + it.done, kHdr - it.done};
    if (it.expect.bytes > 0 && !ring) {
      iov[n++] = {it.buf, it.expect.bytes};
    }
  } else {
    iov[n++] = {it.buf + (it.done - kHdr), total - it.done};
  }
  ssize_t r = ::readv(peers_[peer].sock.fd(), iov, n);
  if (r < 0) {
    if (wouldBlock(errno)) {
      *blocked = true;
      return Status::ok();
    }
    return Status(StatusCode::kPeerFailure, "lost the connection to rank " + std::to_string(peer) + " (recv: " +
                                                std::strerror(errno) + "); it died or aborted");
  }
  if (r == 0) {
    peers_[peer].hangupSeen = true;
    return Status(StatusCode::kPeerFailure, "rank " + std::to_string(peer) + " closed its connection in the middle of " +
                                                describeHeader(it.expect) + "; it died, exited or aborted");
  }
  if (it.done == 0) {
    it.first = std::chrono::steady_clock::now();
  }
  it.done += static_cast<size_t>(r);
  if (!ring && it.done == total && it.expect.bytes >= kRateMinBytes &&
      it.first != std::chrono::steady_clock::time_point{}) {  // not begun with a fence
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - it.first).count();
    peers_[peer].rxRates.add(rateBucket(static_cast<double>(it.expect.bytes) / std::max(secs, 1e-9)));
  }
  if (!it.checked && it.done >= kHdr) {
    RC_RETURN_IF_ERROR(checkHeader(peer, it));
  }
  return Status::ok();
}

Status Transfer::progressRecv(int peer) {
  Queues& q = q_[peer];
  if (!q.recvs.empty() && peers_[peer].fence != 0) {
    RC_RETURN_IF_ERROR(progressFence(peer));
    if (peers_[peer].fence != 0) {
      return Status::ok();  // the rest of it is on its way
    }
  }
  while (!q.recvs.empty()) {
    RecvItem& it = q.recvs.front();
    const size_t total = kHdr + it.expect.bytes;
    if (it.done < total) {  // else read whole together with the fence (progressFence)
      bool blocked = false;
      RC_RETURN_IF_ERROR(readMore(peer, it, &blocked));
      if (blocked) {
        return Status::ok();
      }
      if (it.done < total) {
        continue;
      }
    }
    if (it.target != nullptr && !viaRing(peers_[peer], it.expect)) {
      reduceInto(it.target, it.buf, it.expect.bytes / dataTypeSize(it.dt), it.dt, it.op);
    }
    Callback cb = std::move(it.cb);
    q.recvs.pop_front();
    if (cb) {
      RC_RETURN_IF_ERROR(cb());
    }
  }
  return Status::ok();
}

std::string Transfer::describePending() const {
  std::string s;
  if (any_.open) {
    s = "receiving from any rank (tag " + std::to_string(any_.tag) + ")";
  }
  for (size_t p = 0; p < q_.size(); ++p) {
    if (!q_[p].recvs.empty()) {
      s += (s.empty() ? "" : ", ") + std::string("receiving from rank ") + std::to_string(p);
    }
    if (!q_[p].sends.empty()) {
      s += (s.empty() ? "" : ", ") + std::string("sending to rank ") + std::to_string(p);
    }
    if ((!q_[p].recvs.empty() || !q_[p].sends.empty()) && !peers_[p].sock.valid()) {
      s += " (rank " + std::to_string(p) + " never connected)";
    }
  }
  return s;
}

void sendErrorFrames(std::vector<Peer>& peers, int self, const Status& failure, uint64_t seq, uint64_t comm) {
  std::string text = "rank " + std::to_string(self) + ": " + failure.message();
  text.resize(std::min(text.size(), kMaxErrorText));
  WireHeader h{};
  h.magic = kWireMagic;
  h.kind = static_cast<uint8_t>(MsgKind::kError);
  h.dtype = static_cast<uint8_t>(failure.code());
  h.seq = seq;
  h.bytes = text.size();
  h.tag = comm;
  for (size_t p = 0; p < peers.size(); ++p) {
    if (static_cast<int>(p) == self || !peers[p].sock.valid() || peers[p].dirty) {
      continue;
    }
    iovec iov[2] = {{&h, kHdr}, {text.data(), text.size()}};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = 2;
    ssize_t w = ::sendmsg(peers[p].sock.fd(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w != static_cast<ssize_t>(kHdr + text.size())) {
      peers[p].dirty = true;  // not (wholly) sent: the hang-up tells the peer instead
    }
  }
}

void Transfer::notifyPeers(const Status& failure) {
  sendErrorFrames(peers_, self_, failure, meta_.seq, meta_.comm);
}

Status Transfer::link(bool* waiting) {
  *waiting = false;
  for (size_t p = 0; p < q_.size(); ++p) {
    if (peers_[p].sock.valid() || static_cast<int>(p) == self_) {
      continue;
    }
    if (q_[p].sends.empty() && q_[p].recvs.empty()) {
      if (any_.open && links_ != nullptr && static_cast<int>(p) > self_) {
        // A higher rank that sends to recvAny() dials us: take its connection if it came
        // (never blocks; a lower rank must be connected already, see recvAny's caller).
        RC_RETURN_IF_ERROR(links_->link(static_cast<int>(p), dl_));
      }
      continue;
    }
    if (links_ == nullptr) {
      return Status(StatusCode::kPeerFailure, "no connection to rank " + std::to_string(p));
    }
    RC_RETURN_IF_ERROR(links_->link(static_cast<int>(p), dl_));
    if (!peers_[p].sock.valid()) {
      *waiting = true;
      if (probeAt_.passed()) {
        RC_RETURN_IF_ERROR(links_->probe(static_cast<int>(p), dl_));
      }
    }
  }
  if (*waiting && probeAt_.passed()) {
    probeAt_ = Deadline::after(kProbeEvery);
  }
  return Status::ok();
}

Status Transfer::run() {
  Status st = [&]() -> Status {
    bool progressed = false;
    bool waiting = false;  // for a higher rank to dial us (mesh.h, [Note: lazy connections])
    RC_RETURN_IF_ERROR(link(&waiting));
    RC_RETURN_IF_ERROR(anyPeersLeft());
    for (size_t p = 0; p < q_.size(); ++p) {
      if (peers_[p].sock.valid()) {
        RC_RETURN_IF_ERROR(progressSend(static_cast<int>(p), &progressed));
      }
    }
    // A rank whose peers connect on first use answers their Hellos while it waits.
    const bool pumping = links_ != nullptr && links_->onDemand();
    const Deadline watchFenced(Deadline::Clock::now() + kWatchFencedAfter);
    std::vector<pollfd> fds;
    std::vector<int> who;
    fds.reserve(peers_.size());
    who.reserve(peers_.size());
    while (pending()) {
      if (abort_.aborted()) {
        return Status(StatusCode::kAborted, "communicator aborted: " + abort_.reason());
      }
      if (dl_.passed()) {
        // "Timed out", as gloo says it: code written for torch matches on it.
        return Status(StatusCode::kTimeout, "Timed out " + describePending());
      }
      fds.clear();
      who.clear();
      bool deferred = false;  // a fenced peer left unwatched for now
      Deadline grace = Deadline::never();  // the soonest end of a dead peer's grace
      for (size_t p = 0; p < peers_.size(); ++p) {
        if (static_cast<int>(p) == self_ || !peers_[p].sock.valid()) {
          continue;
        }
        const Queues& q = q_[p];
        short ev = 0;
        const bool sendRing = sendInRing(static_cast<int>(p));
        const bool recvRing = recvInRing(static_cast<int>(p));
        if (!q.sends.empty() && !sendRing) {
          ev |= POLLOUT;
        }
        const bool fenced = peers_[p].fence != 0;
        if (recvRing) {
          // Moving a payload through the ring: what follows on the socket is a later frame,
          // read once this one is whole; the socket is watched for the hang-up only.
        } else if (!q.recvs.empty() ||
                   !(ignoreInput_[p] || peers_[p].hangupSeen || (fenced && !watchFenced.passed() && !any_.open))) {
          // Without a receive queued: watching for a kError frame, behind a shrink's fence
          // only once this op has waited a while (see kWatchFencedAfter).
          ev |= POLLIN;
        } else if (fenced && !watchFenced.passed()) {
          deferred = true;
        }
        if (ev == 0 && peers_[p].hangupSeen) {
          continue;  // already known to be gone; only an error if an op needs it
        }
        fds.push_back(pollfd{peers_[p].sock.fd(), static_cast<short>(ev | POLLRDHUP), 0});
        who.push_back(static_cast<int>(p));
        if (peers_[p].live != nullptr && (!q.sends.empty() || !q.recvs.empty())) {
          // A same-host peer this op needs: its death is known before its socket closes.
          RC_RETURN_IF_ERROR(peerAlive(static_cast<int>(p), &grace));
          if (peers_[p].live->verdict() == liveness::Verdict::kWatching) {
            fds.push_back(pollfd{peers_[p].live->fd(), POLLIN, 0});
            who.push_back(deathOf(static_cast<int>(p)));
          }
        }
        if (sendRing || recvRing) {
          fds.push_back(pollfd{peers_[p].shm->bellFd(), POLLIN, 0});
          who.push_back(kBellOf - static_cast<int>(p));
        }
      }
      if (wakeFd_ >= 0) {
        fds.push_back(pollfd{wakeFd_, POLLIN, 0});
        who.push_back(-1);
      }
      int cap = 1 << 30;
      if (pumping) {
        fds.push_back(pollfd{links_->listenerSocket().fd(), POLLIN, 0});
        who.push_back(-2);
        // A Hello's bytes after its accept do not wake the listener; an abort does not wake a
        // wait for a connection: both are polled for.
        cap = links_->helloPending() ? 1 : waiting ? 10 : cap;
      }
      int rc = ::poll(fds.data(), fds.size(),
                      (deferred ? watchFenced.earliest(dl_) : dl_).earliest(grace).remainingMs(cap));
      bool listenerReady = false;
      if (rc < 0) {
        if (errno == EINTR) {
          continue;
        }
        return RC_SYS_ERROR("poll");
      }
      for (size_t i = 0; i < fds.size() && rc > 0; ++i) {
        short re = fds[i].revents;
        if (re == 0) {
          continue;
        }
        int p = who[i];
        if (p == -2) {
          listenerReady = true;  // pumped below
          continue;
        }
        if (p <= deathOf(0)) {
          continue;  // a same-host peer's liveness lock has its verdict: the next turn reads it
        }
        if (p <= kBellOf) {  // a peer moved its ring or ours
          p = kBellOf - p;
          peers_[p].shm->drainBell();
          if (!q_[p].recvs.empty()) {
            RC_RETURN_IF_ERROR(progressRecv(p));
          }
          if (!q_[p].sends.empty()) {
            bool moved = false;
            RC_RETURN_IF_ERROR(progressSend(p, &moved));
          }
          continue;
        }
        if (p < 0) {
          uint64_t n = 0;
          (void)!::read(wakeFd_, &n, sizeof(n));
          RC_RETURN_IF_ERROR(onWake_());
          continue;
        }
        bool involved = !q_[p].sends.empty() || !q_[p].recvs.empty();
        bool hup = (re & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
        if (hup && recvInRing(p)) {
          peers_[p].hangupSeen = true;  // what it published before still counts (readMore)
        }
        if (q_[p].recvs.empty() && (re & POLLIN) && !ignoreInput_[p]) {
          RC_RETURN_IF_ERROR(peekUnexpected(p));
        }
        if (!involved) {
          if (hup && peers_[p].fence != 0) {
            // A fenced peer that hung up may have left its verdict in front of the end (a
            // fence for another group, or its failure): read it. A plain end is only noted.
            Status f = takeFence(peers_[p], p);
            if (!f.isOk() && !peers_[p].hangupSeen) {
              return f;
            }
          }
          peers_[p].hangupSeen = peers_[p].hangupSeen || hup;
          RC_RETURN_IF_ERROR(anyPeersLeft());
          continue;
        }
        if (!q_[p].recvs.empty() && (re & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) {
          RC_RETURN_IF_ERROR(progressRecv(p));
        }
        if (!q_[p].sends.empty() && (re & (POLLOUT | POLLHUP | POLLERR))) {
          bool moved = false;
          RC_RETURN_IF_ERROR(progressSend(p, &moved));
        }
        if (hup && !q_[p].sends.empty()) {
          // A peer that hung up will never read what we still owe it.
          peers_[p].hangupSeen = true;
          return Status(StatusCode::kPeerFailure,
                        "rank " + std::to_string(p) + " hung up while rank " + std::to_string(self_) +
                            " was still sending to it; it died, exited or aborted");
        }
      }
      if (listenerReady || (pumping && links_->helloPending())) {
        links_->pump();
      }
      // Callbacks may have queued messages to peers not connected yet, and sends: connect
      // them, and push the sends out before sleeping again.
      RC_RETURN_IF_ERROR(link(&waiting));
      for (size_t p = 0; p < q_.size(); ++p) {
        if (!q_[p].sends.empty() && peers_[p].sock.valid()) {
          bool moved = false;
          RC_RETURN_IF_ERROR(progressSend(static_cast<int>(p), &moved));
        }
      }
    }
    return Status::ok();
  }();
  if (!st.isOk()) {
    // A stream stopped in the middle of a frame we read still takes our kError, in front of
    // the hang-up: the peer learns the cause (a mismatch, say), not just that we went away.
    markDirty(/*sending=*/true);
    if (st.code() != StatusCode::kAborted) {
      notifyPeers(st);
    }
    markDirty(/*sending=*/false);
  }
  return st;
}

}  // namespace resilient_comm::tcp
