#include "transport/tcp/mesh.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "common/check.h"
#include "common/logging.h"
#include "transport/tcp/auth.h"
#include "transport/tcp/resync.h"
#include "transport/tcp/wire.h"

namespace resilient_comm::tcp {

namespace {

constexpr uint8_t kAccepted = 1;
constexpr uint8_t kOtherComm = 2;

// A dialler writes its Hello as soon as it is connected: a connection that has not delivered
// one within this bound (a port scanner, a health check, a half-open socket) is dropped, and
// never holds up the Hellos of the others, which are read side by side.
constexpr std::chrono::milliseconds kHelloTimeout{2000};

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

// An accepted connection whose Hello is still arriving.
struct Incoming {
  Socket sock;
  Hello hello{};
  size_t got = 0;
  Deadline dl;
  std::string from;
};

// Reads what has arrived of `in`'s Hello without blocking. Ok: keep waiting, or complete
// (got == sizeof(Hello)); an error: the connection ended or failed.
Status readHello(Incoming& in) {
  while (in.got < sizeof(Hello)) {
    ssize_t n = ::recv(in.sock.fd(), reinterpret_cast<char*>(&in.hello) + in.got, sizeof(Hello) - in.got, 0);
    if (n > 0) {
      in.got += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      return Status::ok();
    }
    return Status(StatusCode::kPeerFailure, n == 0 ? "closed before its Hello" : std::strerror(errno));
  }
  return Status::ok();
}

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
  const JobKey key = JobKey::fromEnv();
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
    Hello hello{kWireMagic, rank, size, 0, spec.hash, randomNonce(), 0};
    hello.mac = helloMac(key, hello);
    RC_RETURN_IF_ERROR(writeAll(s.value(), &hello, sizeof(hello), dl, abort));
    HelloAnswer reply{};
    Status st = readAll(s.value(), &reply, sizeof(reply), dl, abort);
    if (st.code() == StatusCode::kAborted || st.code() == StatusCode::kTimeout) {
      return st.withContext("waiting for rank " + std::to_string(j) + " to accept");
    }
    const uint8_t answer = reply.answer;
    if (st.isOk() && key.set() && reply.mac != answerMac(key, answer, hello)) {
      return Status(StatusCode::kMismatch,
                    "the listener at " + spec.addrs[j] + " (rank " + std::to_string(j) +
                        ") does not hold this job's token (RESILIENT_COMM_TOKEN): it is not rank " +
                        std::to_string(j) + ", or the ranks were given different tokens");
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
  // Connections are accepted and their Hellos read side by side, each bounded by
  // kHelloTimeout: one that sends nothing, or garbage, is dropped without delaying the rest.
  std::vector<Incoming> incoming;
  std::vector<pollfd> fds;
  for (std::string waiting = missing(); !waiting.empty(); waiting = missing()) {
    if (abort.aborted()) {  // an abandoned build must not take a connection a later one needs
      return Status(StatusCode::kAborted, "accept interrupted: " + abort.reason());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout, "rank(s) " + waiting + " never connected before the deadline");
    }
    fds.assign(1, pollfd{listener.socket().fd(), POLLIN, 0});
    Deadline next = dl;
    for (const Incoming& in : incoming) {
      fds.push_back(pollfd{in.sock.fd(), POLLIN, 0});
      next = next.earliest(in.dl);
    }
    // In slices, so that an abort from another thread is seen within 10 ms.
    int rc = ::poll(fds.data(), fds.size(), next.remainingMs(10));
    if (rc < 0 && errno != EINTR) {
      return RC_SYS_ERROR("poll");
    }
    std::vector<Incoming> complete;
    for (size_t i = incoming.size(); i-- > 0;) {
      Incoming& in = incoming[i];
      Status st = fds[i + 1].revents != 0 ? readHello(in) : Status::ok();
      bool done = st.isOk() && in.got == sizeof(Hello);
      if (!st.isOk() || (!done && in.dl.passed())) {
        RC_LOG(kWarning, "TCP build (rank " << rank << "): dropped a connection from " << in.from << " that "
                                            << (st.isOk() ? "sent no Hello within " + std::to_string(kHelloTimeout.count()) + " ms"
                                                          : st.message()));
      }
      if (done) {
        complete.push_back(std::move(in));
      }
      if (done || !st.isOk() || in.dl.passed()) {
        incoming.erase(incoming.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    if (fds[0].revents != 0) {
      for (;;) {
        int fd = ::accept4(listener.socket().fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) {
            break;
          }
          return RC_SYS_ERROR("accept");
        }
        Incoming in{Socket(fd), Hello{}, 0, dl.earliest(Deadline::after(kHelloTimeout)), peerName(fd)};
        RC_RETURN_IF_ERROR(setNoDelay(fd));
        incoming.push_back(std::move(in));
      }
    }
    for (Incoming& in : complete) {
      const Hello& hello = in.hello;
      if (hello.magic != kWireMagic) {
        RC_LOG(kWarning, "TCP build (rank " << rank << "): dropped a connection from " << in.from
                                            << " that is not a resilient_comm peer (bad magic)");
        continue;
      }
      if (hello.mac != helloMac(key, hello)) {
        RC_LOG(kWarning, "TCP build (rank " << rank << "): dropped a connection from " << in.from
                                            << " whose Hello does not carry this job's token (RESILIENT_COMM_TOKEN)");
        continue;
      }
      if (hello.commHash != spec.hash && listener.wasStarted(hello.commHash)) {
        continue;  // left in the backlog by an earlier build on this listener, since abandoned
      }
      if (hello.commHash != spec.hash || hello.size != size || hello.rank <= rank || hello.rank >= size) {
        HelloAnswer no{kOtherComm, {}, answerMac(key, kOtherComm, hello)};
        (void)writeAll(in.sock, &no, sizeof(no), dl, abort);
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
      HelloAnswer yes{kAccepted, {}, answerMac(key, kAccepted, hello)};
      RC_RETURN_IF_ERROR(writeAll(in.sock, &yes, sizeof(yes), dl, abort));
      store(peers, hello.rank, std::move(in.sock), mu, abort);
    }
  }
  return Status::ok();
}

}  // namespace resilient_comm::tcp
