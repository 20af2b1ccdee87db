#include "transport/tcp/mesh.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "common/check.h"
#include "common/env.h"
#include "common/logging.h"
#include "transport/tcp/auth.h"
#include "transport/tcp/resync.h"

namespace resilient_comm::tcp {

namespace {

constexpr uint8_t kAccepted = 1;
constexpr uint8_t kOtherComm = 2;
constexpr uint8_t kEnded = 3;

// A dialler writes its Hello as soon as it is connected: a connection that has not delivered
// one within this bound (a port scanner, a health check, a half-open socket) is dropped, and
// never holds up the Hellos of the others, which are read side by side.
constexpr std::chrono::milliseconds kHelloTimeout{2000};
// Hellos kept for communicators not started yet; past this many (a flood of strangers'
// well-formed Hellos, possible only without a job token) the oldest is dropped.
constexpr size_t kMaxEarly = 1024;
// Waits on the shared listener go in slices this long: an abort (which shuts down only the
// communicator's own sockets) is seen within one.
constexpr int kSliceMs = 10;

std::string peerName(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0 || a.sin_family != AF_INET) {
    return "an unknown address";
  }
  char buf[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof(buf));
  return std::string(buf) + ":" + std::to_string(ntohs(a.sin_port));
}

uint64_t helloMac(const JobKey& key, const Hello& h) {
  return key.mac(&h, offsetof(Hello, mac));
}

uint64_t answerMac(const JobKey& key, uint8_t answer, const Hello& h) {
  struct {
    uint64_t answer, nonce, hash;
  } covered{answer, h.nonce, h.commHash};
  return key.mac(&covered, sizeof(covered));
}

std::string otherComm(const Hello& h, int rank) {
  return "a peer connected as rank " + std::to_string(h.rank) + " of " + std::to_string(h.size) +
         " for a different communicator (its member list, color or epoch differs from rank " + std::to_string(rank) +
         "'s); every member must shrink/split/grow with the same arguments";
}

int waitMs(const Deadline& dl, bool helloPending) {
  return dl.remainingMs(helloPending ? 1 : kSliceMs);
}

}  // namespace

// An accepted connection whose Hello is still arriving, or kept unanswered.
struct Listener::Incoming {
  Socket sock;
  Deadline dl;
  std::string from;
  Hello hello{};
  size_t got = 0;

  // Reads what has arrived of the Hello without blocking. Ok: keep waiting, or complete
  // (got == sizeof(Hello)); an error: the connection ended or failed.
  Status read() {
    while (got < sizeof(Hello)) {
      ssize_t n = ::recv(sock.fd(), reinterpret_cast<char*>(&hello) + got, sizeof(Hello) - got, 0);
      if (n > 0) {
        got += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        return Status::ok();
      }
      return Status(StatusCode::kPeerFailure, n == 0 ? "closed before its Hello" : std::strerror(errno));
    }
    return Status::ok();
  }
};

Listener::Listener(Socket sock) : sock_(std::move(sock)) {}

Listener::~Listener() = default;

void Listener::started(uint64_t hash, int size, int rank) {
  const JobKey key = JobKey::fromEnv();
  std::lock_guard<std::mutex> lock(mu_);
  Comm& c = comms_[hash];
  if (c.size != 0) {
    return;
  }
  c.size = size;
  c.rank = rank;
  c.claimed.assign(static_cast<size_t>(size), false);
  for (size_t i = early_.size(); i-- > 0;) {
    if (early_[i]->hello.commHash == hash) {
      answer(key, *early_[i], c);
      early_.erase(early_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
}

void Listener::ended(uint64_t hash) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm& c = comms_[hash];
  c.ended = true;
  c.kept.clear();  // nobody polls these: closing them is safe, and the diallers see the end
  c.claimed = std::vector<bool>();
}

void Listener::pump() {
  const JobKey key = JobKey::fromEnv();
  std::lock_guard<std::mutex> lock(mu_);
  for (;;) {
    int fd = ::accept4(sock_.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
        RC_LOG(kWarning, "TCP listener: accept failed: " << std::strerror(errno));
      }
      break;
    }
    (void)setNoDelay(fd);
    auto in = std::make_unique<Incoming>(Incoming{Socket(fd), Deadline::after(kHelloTimeout), peerName(fd)});
    incoming_.push_back(std::move(in));
  }
  for (size_t i = incoming_.size(); i-- > 0;) {
    Incoming& in = *incoming_[i];
    Status st = in.read();
    const bool done = st.isOk() && in.got == sizeof(Hello);
    if (!st.isOk() || (!done && in.dl.passed())) {
      RC_LOG(kWarning, "TCP listener: dropped a connection from "
                           << in.from << " that "
                           << (st.isOk() ? "sent no Hello within " + std::to_string(kHelloTimeout.count()) + " ms"
                                         : st.message()));
    }
    if (done || !st.isOk() || in.dl.passed()) {
      std::unique_ptr<Incoming> gone = std::move(incoming_[i]);
      incoming_.erase(incoming_.begin() + static_cast<std::ptrdiff_t>(i));
      if (done) {
        admit(key, std::move(gone));
      }
    }
  }
}

void Listener::admit(const JobKey& key, std::unique_ptr<Incoming> in) {
  const Hello& h = in->hello;
  if (h.magic != kWireMagic) {
    RC_LOG(kWarning, "TCP listener: dropped a connection from " << in->from
                                                                << " that is not a resilient_comm peer (bad magic)");
    return;
  }
  if (h.mac != helloMac(key, h)) {
    RC_LOG(kWarning, "TCP listener: dropped a connection from "
                         << in->from << " whose Hello does not carry this job's token (RESILIENT_COMM_TOKEN)");
    return;
  }
  if (h.commHash == 0 && h.rank < 0) {
    return;  // a probe (Links::probe): its sender only wanted to know that this process lives
  }
  auto it = comms_.find(h.commHash);
  if (it != comms_.end()) {
    answer(key, *in, it->second);
    return;
  }
  early_.push_back(std::move(in));
  if (early_.size() > kMaxEarly) {
    RC_LOG(kWarning, "TCP listener: dropped the Hello from " << early_.front()->from
                                                             << ": too many Hellos for communicators not started here");
    early_.erase(early_.begin());
  }
}

void Listener::answer(const JobKey& key, Incoming& in, Comm& c) {
  const Hello& h = in.hello;
  uint8_t a = kAccepted;
  if (c.ended) {
    a = kEnded;
  } else if (h.size != c.size || h.rank <= c.rank || h.rank >= c.size) {
    a = kOtherComm;
    c.refused = otherComm(h, c.rank);
  } else if (c.claimed[static_cast<size_t>(h.rank)]) {
    a = kOtherComm;
    c.refused = "two peers claimed rank " + std::to_string(h.rank);
  }
  HelloAnswer reply{a, {}, answerMac(key, a, h)};
  // A fresh connection's send buffer is empty: the 16 bytes go at once or the peer is gone.
  ssize_t w = ::send(in.sock.fd(), &reply, sizeof(reply), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (a == kAccepted && w == static_cast<ssize_t>(sizeof(reply))) {
    c.claimed[static_cast<size_t>(h.rank)] = true;
    c.kept[h.rank] = std::move(in.sock);
  }
}

Result<Socket> Listener::take(uint64_t hash, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(hash);
  if (it == comms_.end()) {
    return Socket();
  }
  Comm& c = it->second;
  if (!c.refused.empty()) {
    return Status(StatusCode::kMismatch, c.refused);
  }
  auto k = c.kept.find(rank);
  if (k == c.kept.end()) {
    return Socket();
  }
  Socket s = std::move(k->second);
  c.kept.erase(k);
  return s;
}

Status Listener::strangers(int rank) {
  const JobKey key = JobKey::fromEnv();
  std::lock_guard<std::mutex> lock(mu_);
  if (early_.empty()) {
    return Status::ok();
  }
  std::unique_ptr<Incoming> in = std::move(early_.front());
  early_.erase(early_.begin());
  HelloAnswer no{kOtherComm, {}, answerMac(key, kOtherComm, in->hello)};
  (void)::send(in->sock.fd(), &no, sizeof(no), MSG_NOSIGNAL | MSG_DONTWAIT);
  return Status(StatusCode::kMismatch, otherComm(in->hello, rank));
}

bool Listener::helloPending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !incoming_.empty();
}

Links::Links(MeshSpec spec, std::shared_ptr<Listener> listener, std::vector<Peer>& peers, std::mutex& mu,
             const AbortToken& abort)
    : spec_(std::move(spec)), listener_(std::move(listener)), peers_(peers), mu_(mu), abort_(abort) {}

bool Links::eager(int peer) const {
  const int n = spec_.size;
  return n <= spec_.fullMesh || peer == (spec_.rank + 1) % n || peer == (spec_.rank + n - 1) % n;
}

void Links::store(int peer, Socket s) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_[peer].sock = std::move(s);
  peers_[peer].shm.reset();  // a new connection's rings are set up with it (shm.h)
  if (abort_.aborted()) {
    peers_[peer].sock.shutdownBoth();
  }
}

Result<Socket> Links::connect(int peer, const Deadline& dl, bool retryRefused) {
  const std::string& addr = spec_.addrs[peer];
  auto colon = addr.rfind(':');
  if (colon == std::string::npos) {
    return Status(StatusCode::kInternal, "malformed address '" + addr + "' for rank " + std::to_string(peer));
  }
  Result<Socket> s = connectTo(addr.substr(0, colon), std::stoi(addr.substr(colon + 1)), dl, abort_, retryRefused);
  if (!s.isOk()) {
    return s.status().withContext("connecting to rank " + std::to_string(peer) + " at " + addr);
  }
  return s;
}

Status Links::dial(int j, const Deadline& dl, bool retryRefused) {
  const std::string& addr = spec_.addrs[j];
  const std::string who = "rank " + std::to_string(j);
  Result<Socket> s = connect(j, dl, retryRefused);
  RC_RETURN_IF_ERROR(s.status());
  const JobKey key = JobKey::fromEnv();
  Hello hello{kWireMagic, spec_.rank, spec_.size, 0, spec_.hash, randomNonce(), 0};
  hello.mac = helloMac(key, hello);
  RC_RETURN_IF_ERROR(writeAll(s.value(), &hello, sizeof(hello), dl, abort_));
  // Waiting for the answer, this rank answers the ranks that dial it (see the note in mesh.h).
  HelloAnswer reply{};
  size_t got = 0;
  Status st;
  while (got < sizeof(reply) && st.isOk()) {
    if (abort_.aborted()) {
      return Status(StatusCode::kAborted, "waiting for " + who + " to accept: " + abort_.reason());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout, "waiting for " + who + " to accept");
    }
    pollfd fds[2] = {{s.value().fd(), POLLIN, 0}, {listener_->socket().fd(), POLLIN, 0}};
    if (::poll(fds, 2, waitMs(dl, listener_->helloPending())) < 0 && errno != EINTR) {
      return RC_SYS_ERROR("poll");
    }
    if (fds[1].revents != 0 || listener_->helloPending()) {
      listener_->pump();
    }
    ssize_t n = ::recv(s.value().fd(), reinterpret_cast<char*>(&reply) + got, sizeof(reply) - got, MSG_DONTWAIT);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      st = Status(StatusCode::kPeerFailure, n == 0 ? "it closed the connection" : std::strerror(errno));
    }
  }
  const uint8_t answer = reply.answer;
  if (st.isOk() && key.set() && reply.mac != answerMac(key, answer, hello)) {
    return Status(StatusCode::kMismatch, "the listener at " + addr + " (" + who +
                                             ") does not hold this job's token (RESILIENT_COMM_TOKEN): it is not " +
                                             who + ", or the ranks were given different tokens");
  }
  if (!st.isOk()) {  // a listener answers every Hello it reads: this one's process is gone
    return Status(StatusCode::kPeerFailure,
                  who + "'s listener at " + addr + " ended the connection before answering (" + st.message() +
                      "): it died or exited");
  }
  if (answer == kEnded) {
    return Status(StatusCode::kPeerFailure,
                  who + " has already left this communicator (it failed, aborted or moved on to another group)");
  }
  if (answer != kAccepted) {
    return Status(StatusCode::kMismatch, who +
                                             " is building a different communicator (its member list, color or "
                                             "epoch differs); every member must shrink/split/grow with the same "
                                             "arguments");
  }
  store(j, s.take());
  return Status::ok();
}

Status Links::take(int peer) {
  Result<Socket> s = listener_->take(spec_.hash, peer);
  RC_RETURN_IF_ERROR(s.status());
  if (s.value().valid()) {
    store(peer, s.take());
  }
  return Status::ok();
}

Status Links::probe(int peer, const Deadline& dl) {
  // Short: a peer behind a partition neither refuses nor answers, and is not judged here.
  Result<Socket> s = connect(peer, dl.earliest(Deadline::after(std::chrono::milliseconds(50))), /*retryRefused=*/false);
  if (s.status().code() == StatusCode::kPeerFailure) {
    return Status(StatusCode::kPeerFailure, "rank " + std::to_string(peer) + " never connected, and its listener at " +
                                                spec_.addrs[peer] + " refuses connections: it died or exited");
  }
  if (s.isOk()) {
    Hello hello{kWireMagic, -1, 0, 0, 0, 0, 0};
    (void)::send(s.value().fd(), &hello, sizeof(hello), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  return Status::ok();
}

Status Links::link(int peer, const Deadline& dl) {
  // After the build every rank's listener exists: a refused connection means the peer is gone.
  return peer < spec_.rank ? dial(peer, dl, /*retryRefused=*/false) : take(peer);
}

Status Links::build(const Deadline& dl, int* reused) {
  const int rank = spec_.rank;
  const int size = spec_.size;
  std::vector<int> gone;
  *reused = 0;
  auto connected = [&](int j) {
    std::lock_guard<std::mutex> lock(mu_);
    return peers_[j].sock.valid();
  };
  if (spec_.parent != 0) {
    RC_RETURN_IF_ERROR(resyncStreams(rank, spec_.hash, spec_.parent, peers_, mu_, dl, abort_, &gone));
    bool missing = false;
    for (int j = 0; j < size; ++j) {
      *reused += j != rank && connected(j) ? 1 : 0;
      missing = missing || (j != rank && eager(j) && !connected(j));
    }
    if (missing) {
      // Connecting afresh waits for the peers anyway: read their fences first, so that
      // members that shrank with other arguments fail now rather than at the deadline.
      RC_RETURN_IF_ERROR(awaitFences(peers_, rank, dl, abort_));
    }
  }
  // A higher rank whose reused stream ended must dial us afresh, unless it died: a dead
  // process refuses connections, so one probe tells at once instead of at the deadline. A
  // live peer's listener drops the probe (no Hello).
  for (int j : gone) {
    if (j > rank && eager(j)) {
      RC_RETURN_IF_ERROR(connect(j, dl, /*retryRefused=*/!spec_.derived).status());
    }
  }
  std::vector<int> fresh;  // connected here: their shared-memory rings are set up below
  for (int j = 0; j < size; ++j) {
    if (j != rank && eager(j) && !connected(j)) {
      fresh.push_back(j);
    }
  }
  for (int j = 0; j < rank; ++j) {
    if (eager(j) && !connected(j)) {
      RC_RETURN_IF_ERROR(dial(j, dl, /*retryRefused=*/!spec_.derived));
    }
  }
  for (;;) {
    std::string waiting;
    for (int j = rank + 1; j < size; ++j) {
      if (eager(j) && !connected(j)) {
        RC_RETURN_IF_ERROR(take(j));
        if (!connected(j)) {
          waiting += (waiting.empty() ? "" : ", ") + std::to_string(j);
        }
      }
    }
    if (waiting.empty()) {
      return negotiateShm(peers_, fresh, mu_, dl, abort_);
    }
    if (abort_.aborted()) {  // an abandoned build must not take a connection a later one needs
      return Status(StatusCode::kAborted, "accept interrupted: " + abort_.reason());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout, "rank(s) " + waiting + " never connected before the deadline");
    }
    pollfd fd{listener_->socket().fd(), POLLIN, 0};
    if (::poll(&fd, 1, waitMs(dl, listener_->helloPending())) < 0 && errno != EINTR) {
      return RC_SYS_ERROR("poll");
    }
    listener_->pump();
    RC_RETURN_IF_ERROR(listener_->strangers(rank));
  }
}

int fullMeshFromEnv() {
  return static_cast<int>(env::getInt(env::Knob::kTcpFullMesh));
}

uint64_t fnv1a(const std::string& s, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char ch : s) {
    h = (h ^ ch) * 1099511628211ULL;
  }
  return h;
}

}  // namespace resilient_comm::tcp
