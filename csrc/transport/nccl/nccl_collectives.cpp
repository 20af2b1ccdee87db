// NcclCommunicator's collectives: each is one NCCL group of calls (see collective() and
// enqueue() in nccl_communicator.cpp). Data-movement ops travel as bytes, so every dtype works;
// reductions map dtypes and ops onto NCCL's (int16 has no NCCL type; bool reduces as uint8
// max/min, i.e. or/and, as the TCP transport does).
#include "transport/nccl/nccl_communicator.h"

#include "common/check.h"

namespace resilient_comm::nccl {

namespace {

Result<ncclDataType_t> toNccl(DataType dt) {
  switch (dt) {
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
    case DataType::kBool:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kInt16:
      break;
  }
  return Status(StatusCode::kInvalidArgument, std::string("NCCL has no ") + dataTypeName(dt) + " type");
}

ncclRedOp_t toNccl(RedOp op, DataType dt) {
  if (dt == DataType::kBool) {
    return (op == RedOp::kProd || op == RedOp::kMin) ? ncclMin : ncclMax;
  }
  switch (op) {
    case RedOp::kSum:
      return ncclSum;
    case RedOp::kProd:
      return ncclProd;
    case RedOp::kMin:
      return ncclMin;
    case RedOp::kMax:
      return ncclMax;
    case RedOp::kAvg:
      return ncclAvg;
  }
  return ncclSum;
}

}  // namespace

Status NcclCommunicator::allReduce(void* buf, size_t count, DataType dt, RedOp op, const Deadline& dl) {
  ncclDataType_t t{};
  RC_ASSIGN_OR_RETURN(t, toNccl(dt));
  const ncclRedOp_t o = toNccl(op, dt);
  return collective("all_reduce", dl, [&] {
    return enqueue(
        "ncclAllReduce", [&](ncclComm_t c, cudaStream_t s) { return api_->allReduce(buf, buf, count, t, o, c, s); }, dl);
  });
}

Status NcclCommunicator::broadcast(void* buf, size_t count, DataType dt, int root, const Deadline& dl) {
  const size_t bytes = count * dataTypeSize(dt);
  return collective("broadcast", dl, [&] {
    return enqueue(
        "ncclBroadcast", [&](ncclComm_t c, cudaStream_t s) { return api_->broadcast(buf, buf, bytes, ncclUint8, root, c, s); },
        dl);
  });
}

Status NcclCommunicator::reduce(void* buf, size_t count, DataType dt, RedOp op, int root, const Deadline& dl) {
  ncclDataType_t t{};
  RC_ASSIGN_OR_RETURN(t, toNccl(dt));
  const ncclRedOp_t o = toNccl(op, dt);
  return collective("reduce", dl, [&] {
    return enqueue(
        "ncclReduce", [&](ncclComm_t c, cudaStream_t s) { return api_->reduce(buf, buf, count, t, o, root, c, s); }, dl);
  });
}

Status NcclCommunicator::allGather(const void* send, void* recv, size_t count, DataType dt, const Deadline& dl) {
  const size_t bytes = count * dataTypeSize(dt);
  return collective("all_gather", dl, [&] {
    return enqueue(
        "ncclAllGather", [&](ncclComm_t c, cudaStream_t s) { return api_->allGather(send, recv, bytes, ncclUint8, c, s); },
        dl);
  });
}

Status NcclCommunicator::reduceScatter(const void* send, void* recv, size_t count, DataType dt, RedOp op,
                                       const Deadline& dl) {
  ncclDataType_t t{};
  RC_ASSIGN_OR_RETURN(t, toNccl(dt));
  const ncclRedOp_t o = toNccl(op, dt);
  return collective("reduce_scatter", dl, [&] {
    return enqueue(
        "ncclReduceScatter",
        [&](ncclComm_t c, cudaStream_t s) { return api_->reduceScatter(send, recv, count, t, o, c, s); }, dl);
  });
}

Status NcclCommunicator::allToAll(const void* send, const std::vector<size_t>& sendCounts,
                                  const std::vector<size_t>& sendDispls, void* recv,
                                  const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                                  DataType dt, const Deadline& dl) {
  const size_t es = dataTypeSize(dt);
  return collective("all_to_all", dl, [&]() -> Status {
    for (int p = 0; p < opts_.size; ++p) {
      const char* from = static_cast<const char*>(send) + sendDispls[p] * es;
      char* into = static_cast<char*>(recv) + recvDispls[p] * es;
      RC_RETURN_IF_ERROR(enqueue(
          "ncclSend", [&](ncclComm_t c, cudaStream_t s) { return api_->send(from, sendCounts[p] * es, ncclUint8, p, c, s); },
          dl));
      RC_RETURN_IF_ERROR(enqueue(
          "ncclRecv", [&](ncclComm_t c, cudaStream_t s) { return api_->recv(into, recvCounts[p] * es, ncclUint8, p, c, s); },
          dl));
    }
    return Status::ok();
  });
}

Status NcclCommunicator::gather(const void* send, void* recv, size_t count, DataType dt, int root,
                                const Deadline& dl) {
  const size_t bytes = count * dataTypeSize(dt);
  return collective("gather", dl, [&]() -> Status {
    if (opts_.rank == root) {
      for (int p = 0; p < opts_.size; ++p) {
        char* into = static_cast<char*>(recv) + p * bytes;
        RC_RETURN_IF_ERROR(enqueue(
            "ncclRecv", [&](ncclComm_t c, cudaStream_t s) { return api_->recv(into, bytes, ncclUint8, p, c, s); }, dl));
      }
    }
    return enqueue(
        "ncclSend", [&](ncclComm_t c, cudaStream_t s) { return api_->send(send, bytes, ncclUint8, root, c, s); }, dl);
  });
}

Status NcclCommunicator::scatter(const void* send, void* recv, size_t count, DataType dt, int root,
                                 const Deadline& dl) {
  const size_t bytes = count * dataTypeSize(dt);
  return collective("scatter", dl, [&]() -> Status {
    if (opts_.rank == root) {
      for (int p = 0; p < opts_.size; ++p) {
        const char* from = static_cast<const char*>(send) + p * bytes;
        RC_RETURN_IF_ERROR(enqueue(
            "ncclSend", [&](ncclComm_t c, cudaStream_t s) { return api_->send(from, bytes, ncclUint8, p, c, s); }, dl));
      }
    }
    return enqueue(
        "ncclRecv", [&](ncclComm_t c, cudaStream_t s) { return api_->recv(recv, bytes, ncclUint8, root, c, s); }, dl);
  });
}

Status NcclCommunicator::barrier(const Deadline& dl) {
  void* one = nullptr;
  RC_ASSIGN_OR_RETURN(one, streams_->scratch(sizeof(float)));
  return collective("barrier", dl, [&] {
    return enqueue(
        "ncclAllReduce (barrier)",
        [&](ncclComm_t c, cudaStream_t s) { return api_->allReduce(one, one, 1, ncclFloat32, ncclSum, c, s); }, dl);
  });
}

Status NcclCommunicator::sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed*) {
  for (const P2POp& op : ops) {
    if (op.peer < 0 || op.peer >= opts_.size || op.peer == opts_.rank) {
      return Status(StatusCode::kInvalidArgument, "send/recv: peer " + std::to_string(op.peer) +
                                                      " is not another rank of a group of " +
                                                      std::to_string(opts_.size));
    }
  }
  return collective("send/recv", dl, [&]() -> Status {
    for (const P2POp& op : ops) {
      if (op.kind == P2POp::Kind::kSend) {
        RC_RETURN_IF_ERROR(enqueue(
            "ncclSend", [&](ncclComm_t c, cudaStream_t s) { return api_->send(op.buf, op.bytes, ncclUint8, op.peer, c, s); },
            dl));
      } else {
        RC_RETURN_IF_ERROR(enqueue(
            "ncclRecv", [&](ncclComm_t c, cudaStream_t s) { return api_->recv(op.buf, op.bytes, ncclUint8, op.peer, c, s); },
            dl));
      }
    }
    return Status::ok();
  });
}

}  // namespace resilient_comm::nccl
