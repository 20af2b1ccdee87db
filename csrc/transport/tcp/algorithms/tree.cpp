// Log-depth algorithms for small messages: recursive-doubling all-reduce and binomial-tree
// broadcast/reduce.
#include <cstring>

#include "common/check.h"
#include "transport/tcp/algorithms/algorithms.h"
#include "transport/tcp/reduce.h"

namespace resilient_comm::tcp {

namespace {

int mod(int a, int n) {
  return ((a % n) + n) % n;
}

int floorPow2(int n) {
  int p = 1;
  while (p * 2 <= n) {
    p *= 2;
  }
  return p;
}

}  // namespace

// [Note: recursive doubling on any world size]
// With P the largest power of two <= N and E = N - P, the first 2E ranks pair up: each even
// one hands its data to the odd one above it and waits for the result. The remaining P ranks
// exchange-and-reduce with partner (v XOR mask) for mask = 1, 2, 4, ... Both partners of an
// exchange combine the same two operands, and IEEE + and * are commutative, so every rank
// ends with bit-identical results.
Status rdAllReduce(const AlgoContext& c, void* buf, size_t count, DataType dt, RedOp op) {
  const int n = c.size;
  const int r = c.rank;
  const size_t bytes = count * dataTypeSize(dt);
  if (n == 1) {
    return Status::ok();
  }
  char* tmp = c.scratch.get(Scratch::kTmp, bytes);
  const int p2 = floorPow2(n);
  const int extra = n - p2;
  int vr = 0;
  if (r < 2 * extra) {
    Transfer x = c.transfer();
    if (r % 2 == 0) {
      x.send(r + 1, buf, bytes);
      x.recv(r + 1, buf, bytes);
      return x.run();
    }
    x.recv(r - 1, tmp, bytes);
    RC_RETURN_IF_ERROR(x.run());
    reduceInto(buf, tmp, count, dt, op);
    vr = r / 2;
  } else {
    vr = r - extra;
  }
  for (int mask = 1; mask < p2; mask <<= 1) {
    int vp = vr ^ mask;
    int peer = vp < extra ? 2 * vp + 1 : vp + extra;
    Transfer x = c.transfer();
    x.send(peer, buf, bytes);
    x.recv(peer, tmp, bytes);
    RC_RETURN_IF_ERROR(x.run());
    reduceInto(buf, tmp, count, dt, op);
  }
  if (op == RedOp::kAvg) {
    scale(buf, count, dt, n);
  }
  if (r < 2 * extra) {
    Transfer x = c.transfer();
    x.send(r - 1, buf, bytes);
    return x.run();
  }
  return Status::ok();
}

Status binomialBroadcast(const AlgoContext& c, void* buf, size_t bytes, int root) {
  const int n = c.size;
  const int vr = mod(c.rank - root, n);
  int mask = 1;
  while (mask < n) {
    if (vr & mask) {
      Transfer x = c.transfer();
      x.recv(mod(vr - mask + root, n), buf, bytes);
      RC_RETURN_IF_ERROR(x.run());
      break;
    }
    mask <<= 1;
  }
  mask >>= 1;
  Transfer x = c.transfer();
  for (; mask > 0; mask >>= 1) {
    if (vr + mask < n) {
      x.sendConfirmed(mod(vr + mask + root, n), buf, bytes);  // the child reads nothing back
    }
  }
  return x.run();
}

Status binomialReduce(const AlgoContext& c, void* acc, size_t count, DataType dt, RedOp op, int root) {
  const int n = c.size;
  const int vr = mod(c.rank - root, n);
  const size_t bytes = count * dataTypeSize(dt);
  char* tmp = c.scratch.get(Scratch::kTmp, bytes);
  for (int mask = 1; mask < n; mask <<= 1) {
    Transfer x = c.transfer();
    if ((vr & mask) == 0) {
      int src = vr | mask;
      if (src >= n) {
        continue;
      }
      x.recv(mod(src + root, n), tmp, bytes);
      RC_RETURN_IF_ERROR(x.run());
      reduceInto(acc, tmp, count, dt, op);
    } else {
      x.sendConfirmed(mod((vr & ~mask) + root, n), acc, bytes);  // the parent reads nothing back
      return x.run();
    }
  }
  if (op == RedOp::kAvg) {
    scale(acc, count, dt, n);
  }
  return Status::ok();
}

}  // namespace resilient_comm::tcp
