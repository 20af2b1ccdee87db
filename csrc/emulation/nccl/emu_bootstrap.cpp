#include "emulation/nccl/emu_bootstrap.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "common/check.h"
#include "common/logging.h"
#include "transport/tcp/socket.h"

namespace resilient_comm::nccl::emu {

namespace {

constexpr char kMagic[8] = {'R', 'C', 'E', 'M', 'U', '0', '1', '\0'};
constexpr size_t kHostOffset = 20;
constexpr uint32_t kMaxAddr = 256;

struct Hello {
  uint64_t nonce;
  int32_t nranks;
  int32_t rank;
  uint32_t addrLen;
};

struct Arrival {
  tcp::Socket sock;
  std::string addr;
};

void runRoot(tcp::Socket listener, uint64_t nonce, Deadline lifetime) {
  AbortToken never;
  std::map<int, Arrival> arrived;
  int nranks = -1;
  while (nranks < 0 || static_cast<int>(arrived.size()) < nranks) {
    Result<tcp::Socket> conn = tcp::acceptOne(listener, lifetime, never);
    if (!conn.isOk()) {
      RC_LOG(kWarning, "NCCL emulator: a bootstrap root gave up with " << arrived.size() << " of " << nranks
                                                                        << " ranks: " << conn.status().toString());
      return;
    }
    tcp::Socket s = conn.take();
    Deadline helloDl = Deadline::after(std::chrono::seconds(1));
    Hello h{};
    if (!tcp::readAll(s, &h, sizeof(h), helloDl, never).isOk() || h.nonce != nonce || h.nranks < 1 ||
        h.rank < 0 || h.rank >= h.nranks || h.addrLen == 0 || h.addrLen > kMaxAddr ||
        (nranks >= 0 && h.nranks != nranks)) {
      continue;  // not a rank of this communicator: dropped
    }
    std::string addr(h.addrLen, '\0');
    if (!tcp::readAll(s, addr.data(), addr.size(), helloDl, never).isOk()) {
      continue;
    }
    nranks = h.nranks;
    arrived[h.rank] = Arrival{std::move(s), std::move(addr)};
  }
  std::string book;
  auto put = [&book](const void* p, size_t n) { book.append(static_cast<const char*>(p), n); };
  for (const auto& [rank, a] : arrived) {
    uint32_t len = static_cast<uint32_t>(a.addr.size());
    put(&len, sizeof(len));
    put(a.addr.data(), a.addr.size());
  }
  Deadline sendDl = Deadline::after(std::chrono::seconds(10));
  for (const auto& [rank, a] : arrived) {
    (void)tcp::writeAll(a.sock, book.data(), book.size(), sendDl, never);  // a rank gone meanwhile fails alone
  }
}

}  // namespace

uint64_t idNonce(const ncclUniqueId& id) {
  if (std::memcmp(id.internal, kMagic, sizeof(kMagic)) != 0) {
    return 0;
  }
  uint64_t nonce = 0;
  std::memcpy(&nonce, id.internal + 8, sizeof(nonce));
  return nonce;
}

Status startRoot(ncclUniqueId* id, std::chrono::milliseconds lifetime) {
  int port = 0;
  tcp::Socket listener;
  RC_ASSIGN_OR_RETURN(listener, tcp::listenPublished(&port));
  std::string host = tcp::publishedHost();
  if (host.size() >= sizeof(id->internal) - kHostOffset) {
    return Status(StatusCode::kInvalidArgument, "host name too long for a unique id: " + host);
  }
  static std::mt19937_64 rng(std::random_device{}() ^ static_cast<uint64_t>(Deadline::Clock::now().time_since_epoch().count()));
  static std::mutex rngMu;
  uint64_t nonce = 0;
  {
    std::lock_guard<std::mutex> lock(rngMu);
    while (nonce == 0) {
      nonce = rng();
    }
  }
  std::memset(id->internal, 0, sizeof(id->internal));
  std::memcpy(id->internal, kMagic, sizeof(kMagic));
  std::memcpy(id->internal + 8, &nonce, sizeof(nonce));
  int32_t p = port;
  std::memcpy(id->internal + 16, &p, sizeof(p));
  std::memcpy(id->internal + kHostOffset, host.data(), host.size());
  std::thread(runRoot, std::move(listener), nonce, Deadline::after(lifetime)).detach();
  return Status::ok();
}

Result<std::vector<std::string>> joinRoot(const ncclUniqueId& id, int rank, int nranks, const std::string& myAddr,
                                          const Deadline& dl, const AbortToken& abort) {
  uint64_t nonce = idNonce(id);
  if (nonce == 0) {
    return Status(StatusCode::kInvalidArgument, "not a unique id made by the NCCL emulator's ncclGetUniqueId");
  }
  int32_t port = 0;
  std::memcpy(&port, id.internal + 16, sizeof(port));
  std::string host(id.internal + kHostOffset, strnlen(id.internal + kHostOffset, sizeof(id.internal) - kHostOffset));
  tcp::Socket s;
  RC_ASSIGN_OR_RETURN(s, tcp::connectTo(host, port, dl, abort));
  Hello h{nonce, nranks, rank, static_cast<uint32_t>(myAddr.size())};
  RC_RETURN_IF_ERROR(tcp::writeAll(s, &h, sizeof(h), dl, abort));
  RC_RETURN_IF_ERROR(tcp::writeAll(s, myAddr.data(), myAddr.size(), dl, abort));
  std::vector<std::string> book;
  for (int r = 0; r < nranks; ++r) {
    uint32_t len = 0;
    RC_RETURN_IF_ERROR(tcp::readAll(s, &len, sizeof(len), dl, abort));
    if (len == 0 || len > kMaxAddr) {
      return Status(StatusCode::kInternal, "the bootstrap root sent a malformed address book");
    }
    std::string addr(len, '\0');
    RC_RETURN_IF_ERROR(tcp::readAll(s, addr.data(), len, dl, abort));
    book.push_back(std::move(addr));
  }
  return book;
}

}  // namespace resilient_comm::nccl::emu
