// The TCP transport's collective algorithms. Each is a free function over an AlgoContext,
// so a communicator (or a benchmark) can pick one explicitly; TcpCommunicator chooses with
// the cost model in cost_model.h.
//
//   ring    reduce-scatter + all-gather around the ring, chunk-pipelined (bandwidth-optimal)
//   chain   pipelined broadcast along the ring
//   rd      recursive doubling (log-depth all-reduce, any world size)
//   binomial tree broadcast / reduce (log-depth)
//   direct  one round of point-to-point messages (gather, scatter, all_to_all, small all_gather)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"
#include "comm/types.h"
#include "transport/tcp/transfer.h"

namespace resilient_comm::tcp {

// Reusable, growable scratch memory; slots never alias each other.
class Scratch {
 public:
  enum Slot { kWork = 0, kTmp = 1, kRing = 2, kNumSlots = 3 };
  char* get(Slot slot, size_t bytes);

 private:
  std::unique_ptr<char[]> buf_[kNumSlots];
  size_t cap_[kNumSlots] = {0, 0, 0};
};

struct AlgoContext {
  std::vector<Peer>& peers;
  int rank;
  int size;
  MsgMeta meta;
  const Deadline& dl;
  const AbortToken& abort;
  Scratch& scratch;
  size_t chunkBytes;
  Links* links = nullptr;  // connects peers on first use (mesh.h); null: all connected

  Transfer transfer() const {
    return Transfer(peers, rank, meta, dl, abort, links);
  }
};

Status ringAllReduce(const AlgoContext& c, void* buf, size_t count, DataType dt, RedOp op);
Status rdAllReduce(const AlgoContext& c, void* buf, size_t count, DataType dt, RedOp op);

// `buf` holds size * count elements; afterwards block `rank` holds the reduction.
Status ringReduceScatterInPlace(const AlgoContext& c, void* buf, size_t count, DataType dt, RedOp op);

// `recv` holds size * count elements with this rank's block already in place.
Status ringAllGather(const AlgoContext& c, void* recv, size_t count, DataType dt);
Status directAllGather(const AlgoContext& c, void* recv, size_t count, DataType dt);

Status binomialBroadcast(const AlgoContext& c, void* buf, size_t bytes, int root);
Status chainBroadcast(const AlgoContext& c, void* buf, size_t bytes, int root);

// `acc` is the root's result buffer or a non-root's scratch copy of its input.
Status binomialReduce(const AlgoContext& c, void* acc, size_t count, DataType dt, RedOp op, int root);
Status ringReduce(const AlgoContext& c, void* acc, size_t count, DataType dt, RedOp op, int root);

Status directGather(const AlgoContext& c, const void* send, void* recv, size_t bytes, int root);
Status directScatter(const AlgoContext& c, const void* send, void* recv, size_t bytes, int root);
Status directAllToAll(const AlgoContext& c, const char* send, const std::vector<size_t>& sendBytes,
                      const std::vector<size_t>& sendOffs, char* recv, const std::vector<size_t>& recvBytes,
                      const std::vector<size_t>& recvOffs);

}  // namespace resilient_comm::tcp
