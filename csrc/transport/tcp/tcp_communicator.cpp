#include "transport/tcp/tcp_communicator.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/store_util.h"
#include "common/backstop.h"
#include "common/check.h"
#include "common/logging.h"
#include "transport/tcp/reduce.h"
#include "transport/tcp/mesh.h"
#include "transport/tcp/resync.h"
#include "transport/tcp/socket.h"

namespace resilient_comm::tcp {

namespace {

// How long a build waits for a thread that needs it before the backstop starts one for it.
constexpr std::chrono::milliseconds kBuildClaimGrace{2};

std::string joinList(const std::vector<int>& v) {
  std::string s;
  for (int x : v) {
    s += std::to_string(x) + ",";
  }
  return s;
}

}  // namespace

TcpCommunicator::TcpCommunicator(TcpOptions opts)
    : CommLifecycle(opts.name, opts.rank, opts.size),
      opts_(std::move(opts)),
      model_(CostModel::fromEnv()),
      peers_(opts_.size),
      sendSeq_(opts_.size, 0),
      recvSeq_(opts_.size, 0) {}

std::shared_ptr<TcpCommunicator> TcpCommunicator::create(TcpOptions opts, const Deadline& initDeadline) {
  std::shared_ptr<TcpCommunicator> comm(new TcpCommunicator(std::move(opts)));
  comm->start([](TcpCommunicator& c, const Deadline& dl) { return c.initFromStore(dl); }, initDeadline);
  return comm;
}

std::shared_ptr<TcpCommunicator> TcpCommunicator::join(TcpOptions opts, int existingSize, const Deadline& dl) {
  std::shared_ptr<TcpCommunicator> comm(new TcpCommunicator(std::move(opts)));
  comm->start([existingSize](TcpCommunicator& c, const Deadline& d) { return c.joinFromStore(existingSize, d); },
              dl);
  return comm;
}

std::shared_ptr<TcpCommunicator> TcpCommunicator::fromAddressBook(TcpOptions opts, std::shared_ptr<Listener> listener,
                                                                 std::vector<std::string> addrs, std::string epoch,
                                                                 const Deadline& initDeadline) {
  std::shared_ptr<TcpCommunicator> comm(new TcpCommunicator(std::move(opts)));
  comm->listener_ = std::move(listener);
  comm->addrs_ = std::move(addrs);
  comm->epoch_ = std::move(epoch);
  comm->start([](TcpCommunicator& c, const Deadline& dl) { return c.buildMesh(dl, /*derived=*/false); }, initDeadline);
  return comm;
}

TcpCommunicator::~TcpCommunicator() {
  endLinks();
}

int TcpCommunicator::connections() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const Peer& p : peers_) {
    n += p.sock.valid() ? 1 : 0;
  }
  return n;
}

std::vector<int> TcpCommunicator::shmPeers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (peers_[i].shm != nullptr && peers_[i].sock.valid()) {
      out.push_back(static_cast<int>(i));
    }
  }
  return out;
}

std::vector<std::pair<int, std::vector<uint32_t>>> TcpCommunicator::receiveRates() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<int, std::vector<uint32_t>>> out;
  for (size_t i = 0; i < peers_.size(); ++i) {
    std::vector<uint32_t> counts(kRateBuckets);
    bool any = false;
    for (int b = 0; b < kRateBuckets; ++b) {
      counts[b] = peers_[i].rxRates.count(b);
      any = any || counts[b] != 0;
    }
    if (any) {
      out.emplace_back(static_cast<int>(i), std::move(counts));
    }
  }
  return out;
}

void TcpCommunicator::endLinks() {
  if (listener_) {
    listener_->ended(meshHash());
  }
}

Caps TcpCommunicator::transportCaps() {
  Caps c;
  c.nonBlockingInit = true;
  c.abort = true;
  c.split = true;
  c.shrink = true;
  c.grow = true;
  c.multiRankPerDevice = true;
  return c;
}

void TcpCommunicator::start(std::function<Status(TcpCommunicator&, const Deadline&)> plan, const Deadline& dl) {
  plan_ = std::move(plan);
  buildDl_ = dl;
  if (listener_) {
    listener_->started(meshHash(), opts_.size, opts_.rank);  // its members may dial already
  }
  // The first op (or waitReady) usually runs the build on its own thread; the backstop makes
  // sure it starts anyway. See [Note: a build runs on the first thread that needs it].
  std::shared_ptr<TcpCommunicator> self = shared_from_this();
  Backstop::schedule(
      Backstop::Clock::now() + kBuildClaimGrace, [self] { return self->buildClaimed_.load(); },
      [self] { self->runBuild(self->buildDl_); });
}

void TcpCommunicator::runBuild(const Deadline& dl) {
  bool unclaimed = false;
  if (!buildClaimed_.compare_exchange_strong(unclaimed, true)) {
    return;  // the other candidate runs it
  }
  if (state() != CommState::kInitializing) {
    return;  // aborted before it began
  }
  Status st = opts_.size == 1 ? Status::ok() : plan_(*this, dl);
  if (!st.isOk()) {
    endLinks();
  } else if (listener_ && static_cast<int>(addrs_.size()) == opts_.size) {
    builtOk_.store(true);
  }
  // mu_ across the transition and the shutdown: a derive() that adopts sockets sees either a
  // build still running or every socket already shut.
  std::lock_guard<std::mutex> lock(mu_);
  if (!finishInit(st) || st.isOk()) {
    return;  // Ready, or aborted meanwhile (abort() recorded the reason)
  }
  socketsShut_.store(true);
  for (Peer& p : peers_) {
    p.sock.shutdownBoth();
  }
}

Status TcpCommunicator::publishListener(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key) {
  int port = 0;
  Result<Socket> listener = listenPublished(&port);
  RC_RETURN_IF_ERROR(listener.status());
  listener_ = std::make_shared<Listener>(listener.take());
  return storeSet(store, key, publishedHost() + ":" + std::to_string(port));
}

uint64_t TcpCommunicator::meshHash() const {
  return fnv1a(epoch_) ^ static_cast<uint64_t>(opts_.size);
}

Status TcpCommunicator::buildMesh(const Deadline& dl, bool derived) {
  listener_->started(meshHash(), opts_.size, opts_.rank);  // once: a derived build started at start()
  MeshSpec spec{opts_.rank, opts_.size, addrs_, meshHash(), derived, parent_, fullMeshFromEnv()};
  links_ = std::make_unique<Links>(std::move(spec), listener_, peers_, mu_, abort_);
  int reused = 0;
  RC_RETURN_IF_ERROR(links_->build(dl, &reused));
  reused_.store(reused);
  return Status::ok();
}

Status TcpCommunicator::initFromStore(const Deadline& dl) {
  const int rank = opts_.rank;
  int64_t incarnation = 0;
  RC_ASSIGN_OR_RETURN(incarnation, storeAdd(opts_.store, opts_.prefix + "incarnation/" + std::to_string(rank), 1));
  epoch_ = opts_.prefix + "e" + std::to_string(incarnation) + "/";
  auto addrKey = [&](int r) { return epoch_ + "addr/" + std::to_string(r); };
  RC_RETURN_IF_ERROR(publishListener(opts_.store, addrKey(rank)));
  std::vector<std::string> keys;
  for (int j = 0; j < opts_.size; ++j) {
    keys.push_back(addrKey(j));
  }
  RC_ASSIGN_OR_RETURN(addrs_, storeFetch(opts_.store, keys, dl, abort_));
  return buildMesh(dl, /*derived=*/false);
}

Status TcpCommunicator::joinFromStore(int existingSize, const Deadline& dl) {
  epoch_ = opts_.prefix;
  RC_RETURN_IF_ERROR(publishListener(opts_.store, opts_.prefix + "addr/" + std::to_string(opts_.rank)));
  std::vector<std::string> keys{opts_.prefix + "book"};
  for (int j = existingSize; j < opts_.size; ++j) {
    keys.push_back(opts_.prefix + "addr/" + std::to_string(j));
  }
  std::vector<std::string> values;
  RC_ASSIGN_OR_RETURN(values, storeFetch(opts_.store, keys, dl, abort_));
  addrs_.clear();
  std::string book = values[0];
  for (size_t pos = 0; pos < book.size();) {
    size_t end = book.find(';', pos);
    addrs_.push_back(book.substr(pos, end - pos));
    pos = end == std::string::npos ? book.size() : end + 1;
  }
  if (static_cast<int>(addrs_.size()) != existingSize) {
    return Status(StatusCode::kMismatch, "the group being grown has " + std::to_string(addrs_.size()) +
                                             " members but this joiner was told " + std::to_string(existingSize));
  }
  addrs_.insert(addrs_.end(), values.begin() + 1, values.end());
  return buildMesh(dl, /*derived=*/false);
}

std::shared_ptr<TcpCommunicator> TcpCommunicator::derive(const std::vector<int>& members, const std::string& tag,
                                                         const Deadline& dl, bool adopt) {
  TcpOptions o = opts_;
  o.size = static_cast<int>(members.size());
  o.rank = static_cast<int>(std::find(members.begin(), members.end(), opts_.rank) - members.begin());
  std::shared_ptr<TcpCommunicator> child(new TcpCommunicator(std::move(o)));
  child->listener_ = listener_;
  for (int m : members) {
    child->addrs_.push_back(addrs_[m]);
  }
  child->epoch_ = epoch_ + std::to_string(derived_++) + tag + joinList(members) + "/";
  if (adopt) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!socketsShut_.load()) {
      for (size_t i = 0; i < members.size(); ++i) {
        Peer& p = peers_[members[i]];
        if (p.sock.valid() && !p.dirty && !p.hangupSeen && p.fenceGot == 0) {
          child->peers_[i].sock = std::move(p.sock);
          child->peers_[i].shm = std::move(p.shm);
          child->peers_[i].ended = p.ended;
        }
      }
    }
    child->parent_ = meshHash();
    // The rest (excluded ranks, broken streams) goes down now: a peer still waiting on one
    // of them learns at once that it is not part of this communicator.
    socketsShut_.store(true);
    for (Peer& p : peers_) {
      p.sock.shutdownBoth();
    }
  }
  child->start([](TcpCommunicator& c, const Deadline& d) { return c.buildMesh(d, /*derived=*/true); }, dl);
  return child;
}

void TcpCommunicator::retire(const std::string& reason) {
  const bool wasReady = markRetired(reason);
  abort_.abort(reason);
  if (wasReady) {
    sendErrorFrames(peers_, opts_.rank, Status(StatusCode::kAborted, reason), seq_, meshHash());
    shutdownDirty();
    endLinks();
  }
}

Result<std::shared_ptr<Communicator>> TcpCommunicator::shrink(const std::vector<int>& exclude, bool afterError,
                                                              const Deadline& dl) {
  const int n = opts_.size;
  std::vector<bool> out(n, false);
  for (int r : exclude) {
    if (r < 0 || r >= n) {
      return Status(StatusCode::kInvalidArgument, "shrink: rank " + std::to_string(r) +
                                                      " to exclude is out of range for a group of " + std::to_string(n));
    }
    if (out[r]) {
      return Status(StatusCode::kInvalidArgument, "shrink: rank " + std::to_string(r) + " is excluded twice");
    }
    if (r == opts_.rank) {
      return Status(StatusCode::kInvalidArgument, "shrink: rank " + std::to_string(r) +
                                                      " excludes itself; only survivors call shrink");
    }
    out[r] = true;
  }
  if (static_cast<int>(exclude.size()) >= n) {
    return Status(StatusCode::kInvalidArgument, "shrink: excluding all " + std::to_string(n) + " ranks leaves nobody");
  }
  RC_RETURN_IF_ERROR(built(dl));
  if (afterError) {
    retire("shrunk after an error");
  }
  std::vector<int> members;
  for (int r = 0; r < n; ++r) {
    if (!out[r]) {
      members.push_back(r);
    }
  }
  return std::shared_ptr<Communicator>(derive(members, "shrink:", dl, /*adopt=*/afterError));
}

Result<std::shared_ptr<Communicator>> TcpCommunicator::split(int color, int key, const Deadline& dl) {
  const int n = opts_.size;
  std::vector<int64_t> mine{color, key};
  std::vector<int64_t> all(2 * static_cast<size_t>(n));
  RC_RETURN_IF_ERROR(allGather(mine.data(), all.data(), 2, DataType::kInt64, dl));
  if (color < 0) {
    ++derived_;  // keep every member's count alike
    return std::shared_ptr<Communicator>();
  }
  std::vector<int> members;
  for (int r = 0; r < n; ++r) {
    if (all[2 * r] == color) {
      members.push_back(r);
    }
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  return std::shared_ptr<Communicator>(derive(members, "split" + std::to_string(color) + ":", dl, /*adopt=*/false));
}

Result<std::shared_ptr<Communicator>> TcpCommunicator::grow(int newSize, const c10::intrusive_ptr<c10d::Store>& store,
                                                            const std::string& joinKey, const Deadline& dl) {
  const int n = opts_.size;
  if (newSize <= n) {
    return Status(StatusCode::kInvalidArgument, "grow: the new size " + std::to_string(newSize) +
                                                    " must exceed the current size " + std::to_string(n));
  }
  RC_RETURN_IF_ERROR(built(dl));
  if (opts_.rank == 0) {
    std::string book;
    for (int r = 0; r < n; ++r) {
      book += (r ? ";" : "") + addrs_.at(r);
    }
    RC_RETURN_IF_ERROR(storeSet(store, joinKey + "book", book));
  }
  TcpOptions o = opts_;
  o.size = newSize;
  o.store = store;
  o.prefix = joinKey;
  std::shared_ptr<TcpCommunicator> child(new TcpCommunicator(std::move(o)));
  child->listener_ = listener_;
  child->addrs_ = addrs_;
  child->epoch_ = joinKey;
  ++derived_;
  child->start(
      [n](TcpCommunicator& c, const Deadline& d) -> Status {
        std::vector<std::string> keys;
        for (int j = n; j < c.opts_.size; ++j) {
          keys.push_back(c.opts_.prefix + "addr/" + std::to_string(j));
        }
        std::vector<std::string> joiners;
        RC_ASSIGN_OR_RETURN(joiners, storeFetch(c.opts_.store, keys, d, c.abort_));
        c.addrs_.insert(c.addrs_.end(), joiners.begin(), joiners.end());
        return c.buildMesh(d, /*derived=*/false);
      },
      dl);
  return std::shared_ptr<Communicator>(child);
}

Status TcpCommunicator::waitReady(const Deadline& deadline) {
  RC_RETURN_IF_ERROR(awaitBuild(deadline));
  return awaitFences(deadline);
}

Status TcpCommunicator::awaitFences(const Deadline& deadline) {
  bool pending = false;
  for (const Peer& p : peers_) {
    pending = pending || p.fence != 0;
  }
  if (!pending) {
    return Status::ok();
  }
  Status st = tcp::awaitFences(peers_, opts_.rank, deadline, abort_);
  if (st.isOk() || st.code() == StatusCode::kTimeout) {
    return st;  // a waiter's own deadline: the communicator stays as it is
  }
  if (st.code() != StatusCode::kAborted) {
    for (Peer& p : peers_) {
      p.dirty = p.dirty || p.fenceGot != 0;
    }
    sendErrorFrames(peers_, opts_.rank, st, seq_, meshHash());
  }
  return fail(st, "joining the shrunk group '" + opts_.name + "' on rank " + std::to_string(opts_.rank));
}

Status TcpCommunicator::awaitBuild(const Deadline& deadline) {
  if (state() == CommState::kInitializing && !buildClaimed_.load()) {
    if (deadline.at() >= buildDl_.at()) {
      runBuild(buildDl_);  // this thread will wait for all of it anyway
    } else {
      // This waiter may leave first; the build must go on without it.
      std::shared_ptr<TcpCommunicator> self = shared_from_this();
      std::thread([self] { self->runBuild(self->buildDl_); }).detach();
    }
  }
  return CommLifecycle::waitReady(deadline);
}

void TcpCommunicator::abort(const std::string& reason) {
  // Only a Ready communicator's listener and hash are settled; a build that is still running
  // ends its links itself when the abort stops it.
  const bool wasReady = state() == CommState::kReady;
  const bool live = markAborted(reason);
  abort_.abort(reason);
  if (live) {  // else already failed: no op is in flight, and the peers were told
    shutdownSockets();
  }
  if (wasReady) {
    endLinks();
  }
}

void TcpCommunicator::shutdownSockets() {
  std::lock_guard<std::mutex> lock(mu_);
  socketsShut_.store(true);
  for (Peer& p : peers_) {
    p.sock.shutdownBoth();
  }
}

void TcpCommunicator::shutdownDirty() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Peer& p : peers_) {
    if (p.dirty) {
      p.sock.shutdownBoth();
    }
  }
}

Status TcpCommunicator::fail(const Status& st, const std::string& where) {
  if (st.isOk() || st.code() == StatusCode::kInvalidArgument) {
    return st;  // a local argument error leaves the communicator usable
  }
  const bool first = markFailed(st.withContext(where));
  abort_.abort(st.message());
  shutdownDirty();  // the clean ones carried a kError frame (transfer.h)
  endLinks();
  // The op that broke the communicator reports its own cause; an op that merely ran into an
  // abort from another thread reports that abort (the first error wins).
  return first ? st : error();
}

// Ok once this communicator's own build finished with an address book, even if it failed or
// was aborted since: shrink and grow need only the book and the listener.
bool TcpCommunicator::everBuilt() const {
  return builtOk_.load();
}

Status TcpCommunicator::built(const Deadline& dl) {
  Status st = ready(dl);
  if (st.isOk()) {
    return st;
  }
  if (state() == CommState::kInitializing || !listener_ || static_cast<int>(addrs_.size()) != opts_.size) {
    return Status(StatusCode::kInvalidArgument,
                  "group '" + opts_.name + "' never finished building, so it cannot be shrunk or grown: " + st.message());
  }
  return Status::ok();
}

// Ok if the communicator can run an op (waiting for a pending init, bounded by `dl`).
Status TcpCommunicator::ready(const Deadline& dl) {
  CommState s = state();
  if (s == CommState::kInitializing) {
    RC_RETURN_IF_ERROR(awaitBuild(dl));
    s = state();
  }
  return s == CommState::kReady ? Status::ok() : error();
}

template <typename Fn>
Status TcpCommunicator::collective(OpKind op, DataType dt, RedOp redop, const Deadline& dl, Fn&& body, int root) {
  const uint64_t seq = seq_++;
  const std::string where = std::string(opKindName(op)) + " #" + std::to_string(seq) + " on group '" + opts_.name +
                            "' rank " + std::to_string(opts_.rank);
  RC_RETURN_IF_ERROR(ready(dl));
  if (redop == RedOp::kAvg && !isFloatingPoint(dt)) {
    return Status(StatusCode::kInvalidArgument, std::string("avg needs a floating-point dtype, got ") + dataTypeName(dt));
  }
  AlgoContext ctx{peers_, opts_.rank, opts_.size, MsgMeta{op, dt, redop, seq, rootTag(root), meshHash()}, dl, abort_, scratch_,
                  model_.chunkBytes, links_.get()};
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
  }, root);
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
  }, root);
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
  }, root);
}

Status TcpCommunicator::scatter(const void* send, void* recv, size_t count, DataType dt, int root,
                                const Deadline& dl) {
  RC_RETURN_IF_ERROR(checkRoot(root, "scatter"));
  return collective(OpKind::kScatter, dt, RedOp::kSum, dl, [&](const AlgoContext& c) {
    return directScatter(c, send, recv, count * dataTypeSize(dt), root);
  }, root);
}

Status TcpCommunicator::barrier(const Deadline& dl) {
  return collective(OpKind::kBarrier, DataType::kUInt8, RedOp::kMax, dl, [&](const AlgoContext& c) {
    uint8_t token = 1;
    return rdAllReduce(c, &token, 1, DataType::kUInt8, RedOp::kMax);
  });
}

Status TcpCommunicator::sendRecv(const std::vector<P2POp>& ops, const Deadline& dl, const P2PFeed* feed) {
  auto badPeer = [&](const std::vector<P2POp>& list) -> Status {
    for (const P2POp& op : list) {
      if (op.peer < 0 || op.peer >= opts_.size || op.peer == opts_.rank) {
        return Status(StatusCode::kInvalidArgument, "send/recv: peer " + std::to_string(op.peer) +
                                                        " is not another rank of a group of " +
                                                        std::to_string(opts_.size));
      }
    }
    return Status::ok();
  };
  RC_RETURN_IF_ERROR(badPeer(ops));
  // Point-to-point ops do not take a collective sequence number: only the two ranks involved
  // call them. Each direction of each pair counts its own messages instead.
  const std::string where = "send/recv on group '" + opts_.name + "' rank " + std::to_string(opts_.rank);
  RC_RETURN_IF_ERROR(ready(dl));
  Transfer x(peers_, opts_.rank, MsgMeta{OpKind::kSendRecv, DataType::kUInt8, RedOp::kSum, 0, 0, meshHash()}, dl, abort_,
             links_.get());
  auto post = [&](const std::vector<P2POp>& list) {
    for (const P2POp& op : list) {
      if (op.kind == P2POp::Kind::kSend) {
        x.sendP2P(op.peer, op.buf, op.bytes, sendSeq_[op.peer]++, op.tag);
      } else {
        x.recvP2P(op.peer, op.buf, op.bytes, recvSeq_[op.peer]++, op.tag);
      }
    }
  };
  post(ops);
  if (feed != nullptr) {
    x.onWake(feed->wakeFd, [&]() -> Status {
      std::vector<P2POp> more = feed->take();
      RC_RETURN_IF_ERROR(badPeer(more));
      post(more);
      return Status::ok();
    });
  }
  return fail(x.run(), where);
}

Status TcpCommunicator::recvAny(void* buf, size_t bytes, uint64_t tag, const Deadline& dl, int* source) {
  const std::string where = "recv from any source on group '" + opts_.name + "' rank " + std::to_string(opts_.rank);
  if (opts_.size < 2) {
    return Status(StatusCode::kInvalidArgument, "receiving from any source: the group has no other rank");
  }
  RC_RETURN_IF_ERROR(ready(dl));
  if (links_ != nullptr && links_->onDemand()) {
    // A lower rank waits for us to dial it (mesh.h, [Note: lazy connections]); dialling every
    // one for a message that may come from another could wait on each for the deadline.
    std::string missing;
    for (int p = 0; p < opts_.rank; ++p) {
      if (!peers_[p].sock.valid()) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(p);
      }
    }
    if (!missing.empty()) {
      return Status(StatusCode::kNotSupported,
                    "receiving from any source: in a group above RESILIENT_COMM_TCP_FULL_MESH ranks a rank "
                    "hears only the ranks it is connected to, and lower rank(s) " + missing +
                        " are not yet; pass src, or raise RESILIENT_COMM_TCP_FULL_MESH");
    }
  }
  Transfer x(peers_, opts_.rank, MsgMeta{OpKind::kSendRecv, DataType::kUInt8, RedOp::kSum, 0, 0, meshHash()}, dl, abort_,
             links_.get());
  x.recvAny(buf, bytes, tag, recvSeq_, source);
  return fail(x.run(), where);
}

}  // namespace resilient_comm::tcp
