// Ring algorithms, chunk-pipelined.
//
// [Note: one ring schedule for reduce-scatter and all-gather]
// Number the 2(N-1) steps of a ring all-reduce t = 0 .. 2N-3. At step t rank r sends
// segment (r-1-t) mod N to its right neighbour and receives segment (r-2-t) mod N from its
// left one; steps t < N-1 reduce what arrives (reduce-scatter), later steps store it
// (all-gather). After step N-2 rank r owns the fully reduced segment r, and the segment
// received at step t is the one sent at step t+1, so each chunk is forwarded the moment it
// has been reduced: the whole all-reduce is one pipeline with no barrier between phases.
// Reduce-scatter runs steps [0, N-1), all-gather steps [N-1, 2N-2).
#include <algorithm>
#include <cstring>
#include <memory>

#include "common/check.h"
#include "transport/tcp/algorithms/algorithms.h"
#include "transport/tcp/reduce.h"

namespace resilient_comm::tcp {

char* Scratch::get(Slot slot, size_t bytes) {
  if (cap_[slot] < bytes) {
    buf_[slot].reset(new char[bytes]);
    cap_[slot] = bytes;
  }
  return buf_[slot].get();
}

namespace {

constexpr size_t kWindow = 4;  // receives posted ahead into ring slots

int mod(int a, int n) {
  return ((a % n) + n) % n;
}

struct Segments {
  std::vector<size_t> off;  // in elements
  std::vector<size_t> cnt;
};

Segments evenSegments(size_t count, int n) {
  Segments s;
  size_t base = count / n;
  size_t rem = count % n;
  size_t off = 0;
  for (int i = 0; i < n; ++i) {
    size_t c = base + (static_cast<size_t>(i) < rem ? 1 : 0);
    s.off.push_back(off);
    s.cnt.push_back(c);
    off += c;
  }
  return s;
}

Segments blockSegments(size_t count, int n) {
  Segments s;
  for (int i = 0; i < n; ++i) {
    s.off.push_back(static_cast<size_t>(i) * count);
    s.cnt.push_back(count);
  }
  return s;
}

// Runs ring steps [tBegin, tEnd) of the schedule above over `buf`.
class RingRun {
 public:
  RingRun(const AlgoContext& c, char* buf, const Segments& segs, DataType dt, RedOp op, int tBegin, int tEnd)
      : c_(c),
        buf_(buf),
        segs_(segs),
        dt_(dt),
        op_(op),
        es_(dataTypeSize(dt)),
        tBegin_(tBegin),
        tEnd_(tEnd),
        n_(c.size),
        right_(mod(c.rank + 1, c.size)),
        left_(mod(c.rank - 1, c.size)),
        chunkElems_(std::max<size_t>(1, c.chunkBytes / es_)),
        xfer_(c.transfer()) {}

  Status run() {
    if (n_ == 1 || tBegin_ >= tEnd_) {
      return Status::ok();
    }
    for (int t = tBegin_; t < tEnd_; ++t) {
      int seg = recvSeg(t);
      for (size_t k = 0; k < numChunks(seg); ++k) {
        schedule_.push_back({t, k});
      }
    }
    slots_ = c_.scratch.get(Scratch::kRing, kWindow * chunkElems_ * es_);
    for (size_t i = 0; i < kWindow; ++i) {
      freeSlots_.push_back(i);
    }
    int seg0 = sendSeg(tBegin_);
    for (size_t k = 0; k < numChunks(seg0); ++k) {
      postSend(tBegin_, k);
    }
    for (size_t i = 0; i < kWindow; ++i) {
      postNextRecv();
    }
    return xfer_.run();
  }

 private:
  struct Item {
    int t;
    size_t k;
  };

  int sendSeg(int t) const {
    return mod(c_.rank - 1 - t, n_);
  }
  int recvSeg(int t) const {
    return mod(c_.rank - 2 - t, n_);
  }
  size_t numChunks(int seg) const {
    return (segs_.cnt[seg] + chunkElems_ - 1) / chunkElems_;
  }
  // Element range [first, first + len) of chunk k of segment seg.
  void chunk(int seg, size_t k, size_t* first, size_t* len) const {
    *first = segs_.off[seg] + k * chunkElems_;
    *len = std::min(chunkElems_, segs_.cnt[seg] - k * chunkElems_);
  }
  bool reduces(int t) const {
    return t < n_ - 1;
  }

  void postSend(int t, size_t k) {
    size_t first = 0;
    size_t len = 0;
    chunk(sendSeg(t), k, &first, &len);
    xfer_.send(right_, buf_ + first * es_, len * es_);
  }

  void postNextRecv() {
    if (next_ >= schedule_.size()) {
      return;
    }
    Item it = schedule_[next_++];
    size_t first = 0;
    size_t len = 0;
    chunk(recvSeg(it.t), it.k, &first, &len);
    char* dst = buf_ + first * es_;
    size_t slot = SIZE_MAX;
    if (reduces(it.t)) {
      slot = freeSlots_.back();
      freeSlots_.pop_back();
      dst = slots_ + slot * chunkElems_ * es_;
    }
    char* target = buf_ + first * es_;
    auto done = [this, it, target, len, slot]() -> Status {
      if (slot != SIZE_MAX) {  // reduced into target by the transfer
        if (op_ == RedOp::kAvg && it.t == n_ - 2) {
          scale(target, len, dt_, n_);
        }
        freeSlots_.push_back(slot);
      }
      if (it.t + 1 < tEnd_) {
        postSend(it.t + 1, it.k);
      }
      postNextRecv();
      return Status::ok();
    };
    if (slot != SIZE_MAX) {
      xfer_.recvReduce(left_, dst, target, len * es_, dt_, op_, std::move(done));
    } else {
      xfer_.recv(left_, dst, len * es_, std::move(done));
    }
  }

  const AlgoContext& c_;
  char* buf_;
  const Segments& segs_;
  DataType dt_;
  RedOp op_;
  size_t es_;
  int tBegin_;
  int tEnd_;
  int n_;
  int right_;
  int left_;
  size_t chunkElems_;
  Transfer xfer_;
  std::vector<Item> schedule_;
  size_t next_ = 0;
  char* slots_ = nullptr;
  std::vector<size_t> freeSlots_;
};

}  // namespace

Status ringAllReduce(const AlgoContext& c, void* buf, size_t count, DataType dt, RedOp op) {
  Segments segs = evenSegments(count, c.size);
  return RingRun(c, static_cast<char*>(buf), segs, dt, op, 0, 2 * c.size - 2).run();
}

Status ringReduceScatterInPlace(const AlgoContext& c, void* buf, size_t count, DataType dt, RedOp op) {
  Segments segs = blockSegments(count, c.size);
  return RingRun(c, static_cast<char*>(buf), segs, dt, op, 0, c.size - 1).run();
}

Status ringAllGather(const AlgoContext& c, void* recv, size_t count, DataType dt) {
  Segments segs = blockSegments(count, c.size);
  return RingRun(c, static_cast<char*>(recv), segs, dt, RedOp::kSum, c.size - 1, 2 * c.size - 2).run();
}

Status ringReduce(const AlgoContext& c, void* acc, size_t count, DataType dt, RedOp op, int root) {
  Segments segs = evenSegments(count, c.size);
  char* base = static_cast<char*>(acc);
  RC_RETURN_IF_ERROR(RingRun(c, base, segs, dt, op, 0, c.size - 1).run());
  size_t es = dataTypeSize(dt);
  Transfer x = c.transfer();
  if (c.rank == root) {
    for (int p = 0; p < c.size; ++p) {
      if (p != root) {
        x.recv(p, base + segs.off[p] * es, segs.cnt[p] * es);
      }
    }
  } else {
    x.sendConfirmed(root, base + segs.off[c.rank] * es, segs.cnt[c.rank] * es);  // transfer.h
  }
  return x.run();
}

Status chainBroadcast(const AlgoContext& c, void* buf, size_t bytes, int root) {
  if (c.size == 1) {
    return Status::ok();
  }
  int vr = mod(c.rank - root, c.size);
  int next = vr + 1 < c.size ? mod(c.rank + 1, c.size) : -1;
  int prev = mod(c.rank - 1, c.size);
  char* p = static_cast<char*>(buf);
  size_t chunks = std::max<size_t>(1, (bytes + c.chunkBytes - 1) / c.chunkBytes);
  Transfer x = c.transfer();
  for (size_t k = 0; k < chunks; ++k) {
    size_t first = k * c.chunkBytes;
    size_t len = std::min(c.chunkBytes, bytes - std::min(bytes, first));
    if (vr == 0) {
      // The first chunk's confirmation tells a mismatch (transfer.h); one per peer is enough.
      k == 0 ? x.sendConfirmed(next, p + first, len) : x.send(next, p + first, len);
    } else {
      x.recv(prev, p + first, len, [&x, next, p, first, len, k]() -> Status {
        if (next >= 0) {
          k == 0 ? x.sendConfirmed(next, p + first, len) : x.send(next, p + first, len);
        }
        return Status::ok();
      });
    }
  }
  return x.run();
}

}  // namespace resilient_comm::tcp
