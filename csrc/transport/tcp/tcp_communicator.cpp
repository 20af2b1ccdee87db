#include "transport/tcp/tcp_communicator.h"

#include <cstring>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/check.h"
#include "common/logging.h"
#include "transport/tcp/reduce.h"
#include "transport/tcp/socket.h"

namespace resilient_comm::tcp {

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char ch : s) {
    h = (h ^ ch) * 1099511628211ULL;
  }
  return h;
}

template <typename Fn>
Status storeCall(const char* what, Fn&& fn) {
  try {
    fn();
    return Status::ok();
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, std::string("store ") + what + " failed: " + e.what());
  }
}

std::string bytesToString(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

}  // namespace

TcpCommunicator::TcpCommunicator(TcpOptions opts)
    : opts_(std::move(opts)),
      model_(CostModel::fromEnv()),
      peers_(opts_.size),
      sendSeq_(opts_.size, 0),
      recvSeq_(opts_.size, 0) {}

std::shared_ptr<TcpCommunicator> TcpCommunicator::create(TcpOptions opts, const Deadline& initDeadline) {
  std::shared_ptr<TcpCommunicator> comm(new TcpCommunicator(std::move(opts)));
  std::thread([comm, initDeadline] { comm->runInit(initDeadline); }).detach();
  return comm;
}

TcpCommunicator::~TcpCommunicator() = default;

Caps TcpCommunicator::transportCaps() {
  Caps c;
  c.nonBlockingInit = true;
  c.abort = true;
  c.multiRankPerDevice = true;
  return c;
}

Status TcpCommunicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void TcpCommunicator::runInit(const Deadline& dl) {
  Status st = connectMesh(dl);
  std::lock_guard<std::mutex> lock(mu_);
  if (state_.load() != CommState::kInitializing) {
    return;  // aborted meanwhile; abort() recorded the reason
  }
  if (st.isOk()) {
    state_.store(CommState::kReady);
    return;
  }
  error_ = st.withContext("init of group '" + opts_.name + "' on rank " + std::to_string(opts_.rank));
  state_.store(CommState::kError);
  for (Peer& p : peers_) {
    p.sock.shutdownBoth();
  }
}

Status TcpCommunicator::waitForKeys(const std::vector<std::string>& keys, const Deadline& dl) {
  // check() is one round trip and never blocks; back off between checks (waking at once on
  // abort) rather than blocking in store->wait(), which cannot be interrupted.
  std::chrono::microseconds backoff(500);
  for (;;) {
    bool present = false;
    RC_RETURN_IF_ERROR(storeCall("check", [&] { present = opts_.store->check(keys); }));
    if (present) {
      return Status::ok();
    }
    if (abort_.aborted()) {
      return Status(StatusCode::kAborted, abort_.reason());
    }
    if (dl.passed()) {
      return Status(StatusCode::kTimeout, "waited for the store key(s) of " + std::to_string(keys.size()) +
                                              " lower rank(s) until the init deadline; is every rank calling init?");
    }
    abort_.waitFor(std::chrono::duration_cast<std::chrono::milliseconds>(backoff) + std::chrono::milliseconds(0));
    backoff = std::min(backoff * 2, std::chrono::microseconds(20000));
  }
}

Status TcpCommunicator::connectMesh(const Deadline& dl) {
  const int rank = opts_.rank;
  const int size = opts_.size;
  if (size == 1) {
    return Status::ok();
  }
  int64_t incarnation = 0;
  RC_RETURN_IF_ERROR(storeCall("add", [&] {
    incarnation = opts_.store->add(opts_.prefix + "incarnation/" + std::to_string(rank), 1);
  }));
  const std::string epoch = opts_.prefix + "e" + std::to_string(incarnation) + "/";
  const uint64_t hash = fnv1a(epoch) ^ static_cast<uint64_t>(size);
  auto addrKey = [&](int r) { return epoch + "addr/" + std::to_string(r); };

  int port = 0;
  Result<Socket> listener = listenAnyPort(&port);
  RC_RETURN_IF_ERROR(listener.status());
  std::string addr = publishedHost() + ":" + std::to_string(port);
  RC_RETURN_IF_ERROR(storeCall("set", [&] {
    opts_.store->set(addrKey(rank), std::vector<uint8_t>(addr.begin(), addr.end()));
  }));

  std::vector<std::string> lower;
  for (int j = 0; j < rank; ++j) {
    lower.push_back(addrKey(j));
  }
  if (!lower.empty()) {
    RC_RETURN_IF_ERROR(waitForKeys(lower, dl));
  }
  for (int j = 0; j < rank; ++j) {
    std::string peerAddr;
    RC_RETURN_IF_ERROR(storeCall("get", [&] { peerAddr = bytesToString(opts_.store->get(addrKey(j))); }));
    auto colon = peerAddr.rfind(':');
    if (colon == std::string::npos) {
      return Status(StatusCode::kInternal, "malformed address '" + peerAddr + "' for rank " + std::to_string(j));
    }
    Result<Socket> s = connectTo(peerAddr.substr(0, colon), std::stoi(peerAddr.substr(colon + 1)), dl, abort_);
    RC_RETURN_IF_ERROR(s.status().withContext("connecting to rank " + std::to_string(j) + " at " + peerAddr));
    Hello hello{kWireMagic, rank, size, 0, hash};
    RC_RETURN_IF_ERROR(writeAll(s.value(), &hello, sizeof(hello), dl, abort_));
    std::lock_guard<std::mutex> lock(mu_);
    peers_[j].sock = s.take();
    if (abort_.aborted()) {
      peers_[j].sock.shutdownBoth();
    }
  }
  for (int accepted = 0; accepted < size - 1 - rank;) {
    Result<Socket> s = acceptOne(listener.value(), dl, abort_);
    if (s.status().code() == StatusCode::kTimeout) {
      return Status(StatusCode::kTimeout, std::to_string(size - 1 - rank - accepted) +
                                              " higher rank(s) never connected before the init deadline");
    }
    RC_RETURN_IF_ERROR(s.status());
    Hello hello{};
    Status st = readAll(s.value(), &hello, sizeof(hello), dl, abort_);
    if (!st.isOk() || hello.magic != kWireMagic || hello.commHash != hash || hello.size != size ||
        hello.rank <= rank || hello.rank >= size || peers_[hello.rank].sock.valid()) {
      RC_LOG(kWarning, opts_.name << " rank " << rank << ": rejected a stray connection");
      if (st.code() == StatusCode::kAborted) {
        return st;
      }
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    peers_[hello.rank].sock = s.take();
    if (abort_.aborted()) {
      peers_[hello.rank].sock.shutdownBoth();
    }
    ++accepted;
  }
  return Status::ok();
}

Status TcpCommunicator::poll() {
  switch (state_.load()) {
    case CommState::kInitializing:
      return Status(StatusCode::kInProgress, "init of group '" + opts_.name + "' in progress");
    case CommState::kReady:
      return Status::ok();
    default:
      return error();
  }
}

Status TcpCommunicator::waitReady(const Deadline& deadline) {
  std::chrono::microseconds backoff(200);
  for (;;) {
    Status st = poll();
    if (st.code() != StatusCode::kInProgress) {
      return st;
    }
    if (deadline.passed()) {
      Status t(StatusCode::kTimeout, "init of group '" + opts_.name + "' on rank " + std::to_string(opts_.rank) +
                                         " did not finish before its deadline; aborted");
      abort(t.message());
      return t;
    }
    abort_.waitFor(std::chrono::duration_cast<std::chrono::milliseconds>(backoff));
    backoff = std::min(backoff * 2, std::chrono::microseconds(5000));
  }
}

void TcpCommunicator::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    CommState s = state_.load();
    if (s == CommState::kInitializing || s == CommState::kReady) {
      error_ = Status(StatusCode::kAborted, "communicator of group '" + opts_.name + "' was aborted: " + reason);
      state_.store(CommState::kAborted);
    }
  }
  abort_.abort(reason);
  shutdownSockets();
}

void TcpCommunicator::shutdownSockets() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Peer& p : peers_) {
    p.sock.shutdownBoth();
  }
}

Status TcpCommunicator::fail(const Status& st, const std::string& where) {
  if (st.isOk() || st.code() == StatusCode::kInvalidArgument) {
    return st;  // a local argument error leaves the communicator usable
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() == CommState::kReady) {
      error_ = st.withContext(where);
      state_.store(CommState::kError);
      first = true;
    }
  }
  abort_.abort(st.message());
  shutdownSockets();
  // The op that broke the communicator reports its own cause; an op that merely ran into an
  // abort from another thread reports that abort (the first error wins).
  return first ? st : error();
}

// Ok if the communicator can run an op (waiting for a pending init, bounded by `dl`).
Status TcpCommunicator::ready(const Deadline& dl) {
  CommState s = state_.load();
  if (s == CommState::kInitializing) {
    RC_RETURN_IF_ERROR(waitReady(dl));
    s = state_.load();
  }
  return s == CommState::kReady ? Status::ok() : error();
}

template <typename Fn>
Status TcpCommunicator::collective(OpKind op, DataType dt, RedOp redop, const Deadline& dl, Fn&& body) {
  const uint64_t seq = seq_++;
  const std::string where = std::string(opKindName(op)) + " #" + std::to_string(seq) + " on group '" + opts_.name +
                            "' rank " + std::to_string(opts_.rank);
  RC_RETURN_IF_ERROR(ready(dl));
  if (redop == RedOp::kAvg && !isFloatingPoint(dt)) {
    return Status(StatusCode::kInvalidArgument, std::string("avg needs a floating-point dtype, got ") + dataTypeName(dt));
  }
  AlgoContext ctx{peers_, opts_.rank, opts_.size, MsgMeta{op, dt, redop, seq, 0}, dl, abort_, scratch_,
                  model_.chunkBytes};
  return fail(body(ctx), where);
}

Status TcpCommunicator::checkRoot(int root, const char* what) const {
  if (root < 0 || root >= opts_.size) {
    return Status(StatusCode::kInvalidArgument, std::string(what) + ": root " + std::to_string(root) +
                                                    " is out of range for a group of " + std::to_string(opts_.size));
  }
  return Status::ok();
}

Status TcpCommunicator::allReduce(void* buf, size_t count, DataType dt, RedOp op, const Deadline& dl) {
  return collective(OpKind::kAllReduce, dt, op, dl, [&](const AlgoContext& c) {
    size_t bytes = count * dataTypeSize(dt);
    if (model_.choose(OpKind::kAllReduce, bytes, c.size) == Algo::kRing && count >= static_cast<size_t>(c.size)) {
      return ringAllReduce(c, buf, count, dt, op);
    }
    return rdAllReduce(c, buf, count, dt, op);
  });
}

Status TcpCommunicator::broadcast(void* buf, size_t count, DataType dt, int root, const Deadline& dl) {
  RC_RETURN_IF_ERROR(checkRoot(root, "broadcast"));
  return collective(OpKind::kBroadcast, dt, RedOp::kSum, dl, [&](const AlgoContext& c) {
    size_t bytes = count * dataTypeSize(dt);
    if (model_.choose(OpKind::kBroadcast, bytes, c.size) == Algo::kRing) {
      return chainBroadcast(c, buf, bytes, root);
    }
    return binomialBroadcast(c, buf, bytes, root);
  });
}

Status TcpCommunicator::reduce(void* buf, size_t count, DataType dt, RedOp op, int root, const Deadline& dl) {
  RC_RETURN_IF_ERROR(checkRoot(root, "reduce"));
  return collective(OpKind::kReduce, dt, op, dl, [&](const AlgoContext& c) {
    size_t bytes = count * dataTypeSize(dt);
    void* acc = buf;
    if (c.rank != root) {  // keep non-root inputs unchanged
      acc = c.scratch.get(Scratch::kWork, bytes);
      if (bytes > 0) {
        std::memcpy(acc, buf, bytes);
      }
    }
    if (model_.choose(OpKind::kReduce, bytes, c.size) == Algo::kRing && count >= static_cast<size_t>(c.size)) {
      return ringReduce(c, acc, count, dt, op, root);
    }
    return binomialReduce(c, acc, count, dt, op, root);
  });
}

Status TcpCommunicator::allGather(const void* send, void* recv, size_t count, DataType dt, const Deadline& dl) {
  return collective(OpKind::kAllGather, dt, RedOp::kSum, dl, [&](const AlgoContext& c) {
    size_t bytes = count * dataTypeSize(dt);
    char* out = static_cast<char*>(recv);
    if (bytes > 0 && out + c.rank * bytes != send) {
      std::memmove(out + c.rank * bytes, send, bytes);
    }
    if (model_.choose(OpKind::kAllGather, bytes * c.size, c.size) == Algo::kRing) {
      return ringAllGather(c, recv, count, dt);
    }
    return directAllGather(c, recv, count, dt);
  });
}

Status TcpCommunicator::reduceScatter(const void* send, void* recv, size_t count, DataType dt, RedOp op,
                                      const Deadline& dl) {
  return collective(OpKind::kReduceScatter, dt, op, dl, [&](const AlgoContext& c) {
    size_t bytes = count * dataTypeSize(dt);
    size_t total = bytes * c.size;
    char* work = c.scratch.get(Scratch::kWork, total);
    if (total > 0) {
      std::memcpy(work, send, total);
    }
    Status st;
    if (model_.choose(OpKind::kReduceScatter, total, c.size) == Algo::kRing) {
      st = ringReduceScatterInPlace(c, work, count, dt, op);
    } else {
      st = rdAllReduce(c, work, count * c.size, dt, op);
    }
    if (st.isOk() && bytes > 0) {
      std::memcpy(recv, work + c.rank * bytes, bytes);
    }
    return st;
  });
}

Status TcpCommunicator::allToAll(const void* send, const std::vector<size_t>& sendCounts,
                                 const std::vector<size_t>& sendDispls, void* recv,
                                 const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                                 DataType dt, const Deadline& dl) {
  const size_t n = static_cast<size_t>(opts_.size);
  if (sendCounts.size() != n || sendDispls.size() != n || recvCounts.size() != n || recvDispls.size() != n) {
    return Status(StatusCode::kInvalidArgument, "all_to_all: counts and displacements need one entry per rank (" +
                                                    std::to_string(n) + ")");
  }
  return collective(OpKind::kAllToAll, dt, RedOp::kSum, dl, [&](const AlgoContext& c) {
    size_t es = dataTypeSize(dt);
    std::vector<size_t> sb(n), so(n), rb(n), ro(n);
    for (size_t i = 0; i < n; ++i) {
      sb[i] = sendCounts[i] * es;
      so[i] = sendDispls[i] * es;
      rb[i] = recvCounts[i] * es;
      ro[i] = recvDispls[i] * es;
    }
    return directAllToAll(c, static_cast<const char*>(send), sb, so, static_cast<char*>(recv), rb, ro);
  });
}

Status TcpCommunicator::gather(const void* send, void* recv, size_t count, DataType dt, int root,
                               const Deadline& dl) {
  RC_RETURN_IF_ERROR(checkRoot(root, "gather"));
  return collective(OpKind::kGather, dt, RedOp::kSum, dl, [&](const AlgoContext& c) {
    return directGather(c, send, recv, count * dataTypeSize(dt), root);
  });
}

Status TcpCommunicator::scatter(const void* send, void* recv, size_t count, DataType dt, int root,
                                const Deadline& dl) {
  RC_RETURN_IF_ERROR(checkRoot(root, "scatter"));
  return collective(OpKind::kScatter, dt, RedOp::kSum, dl, [&](const AlgoContext& c) {
    return directScatter(c, send, recv, count * dataTypeSize(dt), root);
  });
}

Status TcpCommunicator::barrier(const Deadline& dl) {
  return collective(OpKind::kBarrier, DataType::kUInt8, RedOp::kMax, dl, [&](const AlgoContext& c) {
    uint8_t token = 1;
    return rdAllReduce(c, &token, 1, DataType::kUInt8, RedOp::kMax);
  });
}

Status TcpCommunicator::sendRecv(const std::vector<P2POp>& ops, const Deadline& dl) {
  for (const P2POp& op : ops) {
    if (op.peer < 0 || op.peer >= opts_.size || op.peer == opts_.rank) {
      return Status(StatusCode::kInvalidArgument, "send/recv: peer " + std::to_string(op.peer) +
                                                      " is not another rank of a group of " +
                                                      std::to_string(opts_.size));
    }
  }
  // Point-to-point ops do not take a collective sequence number: only the two ranks involved
  // call them. Each direction of each pair counts its own messages instead.
  const std::string where = "send/recv on group '" + opts_.name + "' rank " + std::to_string(opts_.rank);
  RC_RETURN_IF_ERROR(ready(dl));
  Transfer x(peers_, opts_.rank, MsgMeta{OpKind::kSendRecv, DataType::kUInt8, RedOp::kSum, 0, 0}, dl, abort_);
  for (const P2POp& op : ops) {
    if (op.kind == P2POp::Kind::kSend) {
      x.sendP2P(op.peer, op.buf, op.bytes, sendSeq_[op.peer]++, op.tag);
    } else {
      x.recvP2P(op.peer, op.buf, op.bytes, recvSeq_[op.peer]++, op.tag);
    }
  }
  return fail(x.run(), where);
}

Result<std::shared_ptr<Communicator>> TcpCommunicator::shrink(const std::vector<int>&, bool, const Deadline&) {
  return Status(StatusCode::kNotSupported, "TcpCommunicator::shrink is not implemented yet");
}

Result<std::shared_ptr<Communicator>> TcpCommunicator::split(int, int, const Deadline&) {
  return Status(StatusCode::kNotSupported, "TcpCommunicator::split is not implemented yet");
}

Result<std::shared_ptr<Communicator>> TcpCommunicator::grow(int, const std::string&, const Deadline&) {
  return Status(StatusCode::kNotSupported, "TcpCommunicator::grow is not implemented yet");
}

}  // namespace resilient_comm::tcp
