#include "transport/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>

#include "common/check.h"
#include "common/env.h"
#include "common/logging.h"

namespace resilient_comm::tcp {

namespace {

// Waits for `events` on fd; Ok when ready, else timeout/abort.
Status waitFd(int fd, short events, const Deadline& dl, const AbortToken& abort, const char* what) {
  for (;;) {
    if (abort.aborted()) {
      return Status(StatusCode::kAborted, std::string(what) + " interrupted: " + abort.reason());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout, std::string(what) + " timed out");
    }
    pollfd p{fd, events, 0};
    // Poll in slices so an abort from another thread is seen within 10 ms even when the fd
    // (a listener not yet shut down, say) never wakes us.
    int rc = ::poll(&p, 1, dl.remainingMs(10));
    if (rc > 0) {
      return Status::ok();
    }
    if (rc < 0 && errno != EINTR) {
      return RC_SYS_ERROR("poll");
    }
  }
}

}  // namespace

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) {
      ::close(fd_);
    }
    fd_ = other.release();
  }
  return *this;
}

Socket::~Socket() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

void Socket::shutdownBoth() const {
  if (fd_ >= 0) {
    ::shutdown(fd_, SHUT_RDWR);
  }
}

Status setNonBlocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return RC_SYS_ERROR("fcntl(O_NONBLOCK)");
  }
  return Status::ok();
}

Status setNoDelay(int fd) {
  int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) < 0) {
    return RC_SYS_ERROR("setsockopt(TCP_NODELAY)");
  }
  return Status::ok();
}

Result<Socket> listenPublished(int* port) {
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) {
    return RC_SYS_ERROR("socket");
  }
  int one = 1;
  ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  // Bound to the address peers are told to dial, not to every interface; where that address
  // is not this host's (a name resolving elsewhere, a NAT), to every interface, with a warning.
  const std::string host = publishedHost();
  bool bound = false;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) {
    bound = ::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (!bound && errno != EADDRNOTAVAIL) {
      return RC_SYS_ERROR("bind");
    }
  }
  if (!bound) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      RC_LOG(kWarning, "TCP transport: the published address " << host
                                                               << " is not this host's; listening on every interface");
    });
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0) {
      return RC_SYS_ERROR("bind");
    }
  }
  if (::listen(s.fd(), SOMAXCONN) < 0) {
    return RC_SYS_ERROR("listen");
  }
  socklen_t len = sizeof(addr);
  if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&addr), &len) < 0) {
    return RC_SYS_ERROR("getsockname");
  }
  *port = ntohs(addr.sin_port);
  RC_RETURN_IF_ERROR(setNonBlocking(s.fd()));
  return s;
}

Result<Socket> connectTo(const std::string& host, int port, const Deadline& dl, const AbortToken& abort,
                         bool retryRefused) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return Status(StatusCode::kInvalidArgument, "not an IPv4 address: '" + host + "'");
  }
  std::chrono::milliseconds backoff(1);
  for (;;) {
    Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s.valid()) {
      return RC_SYS_ERROR("socket");
    }
    RC_RETURN_IF_ERROR(setNonBlocking(s.fd()));
    int rc = ::connect(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      RC_RETURN_IF_ERROR(waitFd(s.fd(), POLLOUT, dl, abort, ("connect to " + host + ":" + std::to_string(port)).c_str()));
      socklen_t len = sizeof(err);
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    }
    if (err == 0) {
      RC_RETURN_IF_ERROR(setNoDelay(s.fd()));
      return s;
    }
    // A reset during the handshake is a refusal too: the listener closed with our connection
    // still in its accept queue (its process exiting), which the kernel answers with a RST.
    const bool refused = err == ECONNREFUSED || err == ECONNRESET;
    if (refused && !retryRefused) {
      return Status(StatusCode::kPeerFailure, "connect to " + host + ":" + std::to_string(port) + " " +
                                                  (err == ECONNRESET ? "reset" : "refused") + ": the process is gone");
    }
    if (!refused && err != ETIMEDOUT && err != EHOSTUNREACH && err != ENETUNREACH) {
      errno = err;
      return RC_SYS_ERROR(("connect to " + host + ":" + std::to_string(port)).c_str());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout,
                    "connect to " + host + ":" + std::to_string(port) + " kept failing: " + std::strerror(err));
    }
    // The peer published its address after listen(), so refusals are rare and short-lived;
    // back off without spinning, waking at once on abort.
    if (abort.aborted() || abort.waitFor(backoff)) {
      return Status(StatusCode::kAborted, "connect interrupted: " + abort.reason());
    }
    backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
  }
}

Result<Socket> acceptOne(const Socket& listener, const Deadline& dl, const AbortToken& abort) {
  for (;;) {
    if (abort.aborted()) {  // an abandoned build must not take a connection a later one needs
      return Status(StatusCode::kAborted, std::string("accept interrupted: ") + abort.reason());
    }
    int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      Socket s(fd);
      RC_RETURN_IF_ERROR(setNoDelay(fd));
      return s;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
      return RC_SYS_ERROR("accept");
    }
    RC_RETURN_IF_ERROR(waitFd(listener.fd(), POLLIN, dl, abort, "accept"));
  }
}

Status writeAll(const Socket& s, const void* buf, size_t len, const Deadline& dl, const AbortToken& abort) {
  const char* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::send(s.fd(), p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      RC_RETURN_IF_ERROR(waitFd(s.fd(), POLLOUT, dl, abort, "send"));
      continue;
    }
    return Status(StatusCode::kPeerFailure, std::string("send failed: ") + std::strerror(errno));
  }
  return Status::ok();
}

Status readAll(const Socket& s, void* buf, size_t len, const Deadline& dl, const AbortToken& abort) {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(s.fd(), p, len, 0);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      return Status(StatusCode::kPeerFailure, "connection closed by peer");
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      RC_RETURN_IF_ERROR(waitFd(s.fd(), POLLIN, dl, abort, "recv"));
      continue;
    }
    return Status(StatusCode::kPeerFailure, std::string("recv failed: ") + std::strerror(errno));
  }
  return Status::ok();
}

std::string publishedHost() {
  std::string host = env::getString(env::Knob::kHost);
  if (!host.empty()) {
    return host;
  }
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) == 0) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (::getaddrinfo(name, nullptr, &hints, &res) == 0 && res != nullptr) {
      char buf[INET_ADDRSTRLEN] = {0};
      auto* sin = reinterpret_cast<sockaddr_in*>(res->ai_addr);
      ::inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
      ::freeaddrinfo(res);
      return buf;
    }
  }
  return "127.0.0.1";
}

}  // namespace resilient_comm::tcp
