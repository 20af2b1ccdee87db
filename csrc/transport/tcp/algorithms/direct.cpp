// One-round algorithms: every message is posted at once and progressed together.
#include <cstring>

#include "transport/tcp/algorithms/algorithms.h"

namespace resilient_comm::tcp {

Status directAllGather(const AlgoContext& c, void* recv, size_t count, DataType dt) {
  const size_t bytes = count * dataTypeSize(dt);
  char* out = static_cast<char*>(recv);
  Transfer x = c.transfer();
  for (int p = 0; p < c.size; ++p) {
    if (p != c.rank) {
      x.send(p, out + c.rank * bytes, bytes);
      x.recv(p, out + p * bytes, bytes);
    }
  }
  return x.run();
}

Status directGather(const AlgoContext& c, const void* send, void* recv, size_t bytes, int root) {
  Transfer x = c.transfer();
  if (c.rank == root) {
    char* out = static_cast<char*>(recv);
    if (bytes > 0) {
      std::memcpy(out + root * bytes, send, bytes);
    }
    for (int p = 0; p < c.size; ++p) {
      if (p != root) {
        x.recv(p, out + p * bytes, bytes);
      }
    }
  } else {
    x.sendConfirmed(root, send, bytes);  // see transfer.h, confirmed sends
  }
  return x.run();
}

Status directScatter(const AlgoContext& c, const void* send, void* recv, size_t bytes, int root) {
  Transfer x = c.transfer();
  if (c.rank == root) {
    const char* in = static_cast<const char*>(send);
    if (bytes > 0) {
      std::memcpy(recv, in + root * bytes, bytes);
    }
    for (int p = 0; p < c.size; ++p) {
      if (p != root) {
        x.sendConfirmed(p, in + p * bytes, bytes);
      }
    }
  } else {
    x.recv(root, recv, bytes);
  }
  return x.run();
}

Status directAllToAll(const AlgoContext& c, const char* send, const std::vector<size_t>& sendBytes,
                      const std::vector<size_t>& sendOffs, char* recv, const std::vector<size_t>& recvBytes,
                      const std::vector<size_t>& recvOffs) {
  Transfer x = c.transfer();
  // Start with the right-hand neighbour and go round, so that ranks do not all queue on
  // rank 0 first.
  for (int i = 1; i < c.size; ++i) {
    int to = (c.rank + i) % c.size;
    int from = (c.rank - i + c.size) % c.size;
    x.send(to, send + sendOffs[to], sendBytes[to]);
    x.recv(from, recv + recvOffs[from], recvBytes[from]);
  }
  if (sendBytes[c.rank] != recvBytes[c.rank]) {
    return Status(StatusCode::kInvalidArgument,
                  "all_to_all: this rank sends itself " + std::to_string(sendBytes[c.rank]) +
                      " bytes but expects " + std::to_string(recvBytes[c.rank]));
  }
  if (sendBytes[c.rank] > 0) {
    std::memmove(recv + recvOffs[c.rank], send + sendOffs[c.rank], sendBytes[c.rank]);
  }
  return x.run();
}

}  // namespace resilient_comm::tcp
