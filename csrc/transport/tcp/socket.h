// Sockets for the TCP transport: an owning fd, listen/connect/accept bounded by a Deadline
// and an AbortToken, and the address a rank publishes.
//
// [Note: never close a socket another thread may be polling]
// abort() only shutdown()s fds (which wakes every poll on them); fds are closed by the
// owner's destructor, after the worker that polls them has stopped. Closing earlier could
// let the fd number be reused under a concurrent poll.
#pragma once

#include <cstdint>
#include <string>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"

namespace resilient_comm::tcp {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket();

  int fd() const {
    return fd_;
  }
  bool valid() const {
    return fd_ >= 0;
  }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Wakes every thread blocked on this socket; safe from any thread.
  void shutdownBoth() const;

 private:
  int fd_ = -1;
};

// Listens on an ephemeral port of the address publishedHost() names (every interface if that
// address is not this host's); `port` receives the port chosen.
Result<Socket> listenPublished(int* port);
// Connects to host:port, retrying refused connections until the deadline (or, without
// `retryRefused`, failing with PeerFailure at the first refusal: nobody listens there).
Result<Socket> connectTo(const std::string& host, int port, const Deadline& dl, const AbortToken& abort,
                         bool retryRefused = true);
// Accepts one connection, or fails at the deadline / on abort.
Result<Socket> acceptOne(const Socket& listener, const Deadline& dl, const AbortToken& abort);
// Blocking-style exact read/write on a non-blocking socket, bounded by the deadline.
Status writeAll(const Socket& s, const void* buf, size_t len, const Deadline& dl, const AbortToken& abort);
Status readAll(const Socket& s, void* buf, size_t len, const Deadline& dl, const AbortToken& abort);

Status setNonBlocking(int fd);
Status setNoDelay(int fd);

// The address other ranks should dial: RESILIENT_COMM_HOST, else the host name's IPv4
// address, else 127.0.0.1.
std::string publishedHost();

}  // namespace resilient_comm::tcp
