#include "scenarios.h"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "common/check.h"
#include "transport/tcp/tcp_communicator.h"

namespace resilient_comm::bench {

using Clock = std::chrono::steady_clock;
using tcp::TcpCommunicator;
using tcp::TcpOptions;

namespace {

// allReduce rounds every member completes on C2 before the victim dies, so that the
// survivors are inside their allReduce loop when it does.
constexpr int kVictimRounds = 10;
// A survivor that completes this many rounds concludes the victim never died.
constexpr int kMaxSurvivorRounds = 100000;

double msBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::vector<uint8_t> bytesOf(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// Every rank contributes rank + 1; the sum proves that every member took part.
Status checkedAllReduce(Communicator& c, const Deadline& dl) {
  float x = static_cast<float>(c.rank() + 1);
  RC_RETURN_IF_ERROR(c.allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, dl));
  const float want = static_cast<float>(c.size()) * static_cast<float>(c.size() + 1) / 2;
  if (x != want) {
    return Status(StatusCode::kInternal, "allReduce on rank " + std::to_string(c.rank()) + " of " +
                                             std::to_string(c.size()) + " returned " + std::to_string(x) +
                                             ", expected " + std::to_string(want));
  }
  return Status::ok();
}

// True while thread `tid` of this process sleeps in the kernel (state S in its stat line).
bool sleepingInKernel(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(f, line);
  size_t p = line.rfind(')');
  return p != std::string::npos && p + 2 < line.size() && line[p + 2] == 'S';
}

struct AbortTiming {
  double ms = 0;    // abort() called -> the pending op returned
  Status opStatus;  // what the pending op returned
};

// Runs `op` on a second thread and, once that thread is blocked in the kernel (so the op is
// really pending, not about to start), aborts `comm` from this thread.
Result<AbortTiming> abortWhilePending(Communicator& comm, const std::function<Status()>& op, const Deadline& dl) {
  std::atomic<pid_t> tid{0};
  std::atomic<bool> done{false};
  AbortTiming out;
  Clock::time_point returned;
  std::thread t([&] {
    tid.store(static_cast<pid_t>(::syscall(SYS_gettid)));
    out.opStatus = op();
    returned = Clock::now();
    done.store(true);
  });
  // Polls an observable condition (not a sleep): the thread's scheduler state.
  bool pending = false;
  while (!done.load() && !dl.passed()) {
    pid_t id = tid.load();
    if (id != 0 && sleepingInKernel(id)) {
      pending = true;
      break;
    }
    std::this_thread::yield();
  }
  const Clock::time_point aborted = Clock::now();
  comm.abort("benchmark: abort while an op is pending");
  t.join();  // bounded: the op's own deadline is `dl`
  if (!pending) {
    return Status(StatusCode::kInternal, "the op never blocked before the abort; it returned " +
                                             out.opStatus.toString());
  }
  out.ms = msBetween(aborted, returned);
  return out;
}

class RankRun {
 public:
  RankRun(const RepPlan& plan, int index, c10::intrusive_ptr<c10d::Store> store)
      : plan_(plan),
        index_(index),
        n_(plan.worldSize),
        store_(std::move(store)),
        prefix_("w" + std::to_string(plan.worldSize) + "/r" + std::to_string(plan.rep) + "/") {}

  Status run() {
    RC_RETURN_IF_ERROR(barrier("start", n_ + 1));
    if (index_ == n_) {
      RC_RETURN_IF_ERROR(joinGrow().withContext("grow (joiner)"));
      return publish();
    }
    RC_RETURN_IF_ERROR(init().withContext("init"));
    RC_RETURN_IF_ERROR(splitThenIdleAbort().withContext("split / abort_idle"));
    RC_RETURN_IF_ERROR(grow().withContext("grow"));
    RC_RETURN_IF_ERROR(abortMidInit().withContext("abort_init"));
    RC_RETURN_IF_ERROR(abortMidCollective().withContext("abort_coll"));
    RC_RETURN_IF_ERROR(failThenRecover().withContext("detect / shrink / reinit"));
    return publish();
  }

 private:
  Deadline dl() const {
    return Deadline::after(plan_.opTimeout);
  }

  void record(const char* key, double ms) {
    results_ += std::string(key) + "=" + std::to_string(ms) + ";";
  }
  void record(const char* key, Clock::time_point from, Clock::time_point to) {
    record(key, msBetween(from, to));
  }
  // Also the two instants on the host's steady clock, for the "<key>_sync" metric (report.h).
  void recordSpan(const char* key, Clock::time_point from, Clock::time_point to) {
    record(key, from, to);
    record((std::string(key) + "_call_at").c_str(), msBetween(Clock::time_point(), from));
    record((std::string(key) + "_done_at").c_str(), msBetween(Clock::time_point(), to));
  }

  Status publish() {
    return storeCall("set", [&] { store_->set(resultKey(index_), bytesOf(results_)); });
  }

  // Everyone of `count` processes arrives before anyone leaves. The last arrival opens
  // the gate; the others block in the store's wait, bounded by the op timeout.
  Status barrier(const std::string& name, int count) {
    const std::string key = prefix_ + "barrier/" + name;
    int64_t arrived = 0;
    RC_RETURN_IF_ERROR(storeCall("add " + key, [&] { arrived = store_->add(key, 1); }));
    if (arrived == count) {
      return storeCall("set " + key, [&] { store_->set(key + "/go", bytesOf("1")); });
    }
    return storeCall("wait " + key, [&] { store_->wait({key + "/go"}, plan_.opTimeout); });
  }

  std::shared_ptr<TcpCommunicator> create(const std::string& scope, int rank, int size) {
    TcpOptions o;
    o.name = "bench/" + scope;
    o.store = store_;
    o.prefix = prefix_ + scope;
    o.rank = rank;
    o.size = size;
    return TcpCommunicator::create(std::move(o), dl());
  }

  Status init() {
    const Clock::time_point t0 = Clock::now();
    c1_ = create("init/", index_, n_);
    RC_RETURN_IF_ERROR(c1_->waitReady(dl()));
    const Clock::time_point t1 = Clock::now();
    RC_RETURN_IF_ERROR(checkedAllReduce(*c1_, dl()));
    const Clock::time_point t2 = Clock::now();
    record("init_ready", t0, t1);
    record("init_first", t0, t2);
    return Status::ok();
  }

  Status splitThenIdleAbort() {
    RC_RETURN_IF_ERROR(barrier("split", n_));
    const Clock::time_point t0 = Clock::now();
    std::shared_ptr<Communicator> child;
    RC_ASSIGN_OR_RETURN(child, c1_->split(index_ % 2, index_, dl()));
    RC_RETURN_IF_ERROR(checkedAllReduce(*child, dl()));
    record("split", t0, Clock::now());

    // Nobody aborts the child while a peer may still be reading its last message.
    RC_RETURN_IF_ERROR(barrier("split_done", n_));
    const Clock::time_point a0 = Clock::now();
    child->abort("benchmark: idle abort");
    const Clock::time_point a1 = Clock::now();
    if (child->state() != CommState::kAborted) {
      return Status(StatusCode::kInternal, std::string("after abort() the child is ") + commStateName(child->state()));
    }
    record("abort_idle", a0, a1);
    return Status::ok();
  }

  Status grow() {
    RC_RETURN_IF_ERROR(barrier("grow", n_ + 1));
    const Clock::time_point t0 = Clock::now();
    std::shared_ptr<Communicator> grown;
    RC_ASSIGN_OR_RETURN(grown, c1_->grow(n_ + 1, store_, prefix_ + "grow/", dl()));
    RC_RETURN_IF_ERROR(checkedAllReduce(*grown, dl()));
    record("grow", t0, Clock::now());
    return barrier("grow_done", n_ + 1);
  }

  Status joinGrow() {
    RC_RETURN_IF_ERROR(barrier("grow", n_ + 1));
    const Clock::time_point t0 = Clock::now();
    TcpOptions o;
    o.name = "bench/grow/";
    o.store = store_;
    o.prefix = prefix_ + "grow/";
    o.rank = n_;
    o.size = n_ + 1;
    std::shared_ptr<TcpCommunicator> joined = TcpCommunicator::join(std::move(o), n_, dl());
    RC_RETURN_IF_ERROR(checkedAllReduce(*joined, dl()));
    record("grow", t0, Clock::now());
    return barrier("grow_done", n_ + 1);
  }

  // A communicator of n_ ranks under a prefix only this process uses: its init can only wait.
  Status abortMidInit() {
    RC_RETURN_IF_ERROR(barrier("abort_init", n_));
    std::shared_ptr<TcpCommunicator> lonely = create("abort_init/" + std::to_string(index_) + "/", index_, n_);
    const Deadline opDl = dl();
    RC_ASSIGN_OR_RETURN(AbortTiming t, abortWhilePending(*lonely, [&] { return lonely->waitReady(opDl); }, opDl));
    if (t.opStatus.code() != StatusCode::kAborted) {
      return Status(StatusCode::kInternal, "waitReady returned " + t.opStatus.toString() + " instead of Aborted");
    }
    record("abort_init", t.ms);
    return Status::ok();
  }

  // Only `stalled` calls allReduce on C1, so it stays pending until the abort.
  Status abortMidCollective() {
    RC_RETURN_IF_ERROR(barrier("abort_coll", n_));
    if (index_ == plan_.stalled) {
      float x = 1;
      const Deadline opDl = dl();
      RC_ASSIGN_OR_RETURN(AbortTiming t,
                          abortWhilePending(
                              *c1_, [&] { return c1_->allReduce(&x, 1, DataType::kFloat32, RedOp::kSum, opDl); },
                              opDl));
      if (t.opStatus.code() != StatusCode::kAborted) {
        return Status(StatusCode::kInternal, "allReduce returned " + t.opStatus.toString() + " instead of Aborted");
      }
      record("abort_coll", t.ms);
    }
    RC_RETURN_IF_ERROR(barrier("abort_coll_done", n_));
    c1_->abort("benchmark: done with C1");
    c1_.reset();  // a failed communicator is dropped, as an application would
    return Status::ok();
  }

  Status failThenRecover() {
    RC_RETURN_IF_ERROR(barrier("c2", n_));
    std::shared_ptr<TcpCommunicator> c2 = create("c2/", index_, n_);
    RC_RETURN_IF_ERROR(checkedAllReduce(*c2, dl()));
    RC_RETURN_IF_ERROR(barrier("kill", n_));
    const std::string killKey = prefix_ + "killed_at_ns";
    const int victim = plan_.victim;
    if (index_ == victim) {
      for (int i = 0; i < kVictimRounds; ++i) {
        RC_RETURN_IF_ERROR(checkedAllReduce(*c2, dl()));
      }
      RC_RETURN_IF_ERROR(publish());
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
      // check() is a round trip: the key is on the server before this process dies.
      RC_RETURN_IF_ERROR(storeCall("set " + killKey, [&] {
        store_->set(killKey, bytesOf(std::to_string(ns)));
        (void)store_->check({killKey});
      }));
      ::raise(SIGKILL);
      return Status(StatusCode::kInternal, "survived its own SIGKILL");
    }

    Status st;
    for (int i = 0; st.isOk(); ++i) {
      if (i == kMaxSurvivorRounds) {
        return Status(StatusCode::kInternal, std::to_string(i) + " allReduce rounds succeeded: the victim never died");
      }
      st = checkedAllReduce(*c2, dl());
    }
    const Clock::time_point failed = Clock::now();
    if (st.code() != StatusCode::kPeerFailure) {
      return Status(StatusCode::kInternal, "the survivors' allReduce failed with " + st.toString() +
                                               " instead of PeerFailure");
    }

    const int survivors = n_ - 1;
    const int newRank = index_ < victim ? index_ : index_ - 1;
    std::shared_ptr<Communicator> shrunk;
    std::shared_ptr<TcpCommunicator> fresh;
    auto doShrink = [&]() -> Status {
      const Clock::time_point t0 = Clock::now();
      RC_ASSIGN_OR_RETURN(shrunk, c2->shrink({victim}, /*afterError=*/true, dl()));
      RC_RETURN_IF_ERROR(checkedAllReduce(*shrunk, dl()).withContext("first allReduce after shrink"));
      recordSpan("shrink", t0, Clock::now());
      return Status::ok();
    };
    auto doReinit = [&]() -> Status {
      const Clock::time_point t0 = Clock::now();
      fresh = create("reinit/", newRank, survivors);
      RC_RETURN_IF_ERROR(checkedAllReduce(*fresh, dl()).withContext("first allReduce after re-init"));
      recordSpan("reinit", t0, Clock::now());
      return Status::ok();
    };
    RC_RETURN_IF_ERROR(plan_.shrinkFirst ? doShrink() : doReinit());
    RC_RETURN_IF_ERROR(barrier("recovered_once", survivors));
    RC_RETURN_IF_ERROR(plan_.shrinkFirst ? doReinit() : doShrink());
    // The floor: a plain allReduce on the shrunk communicator, started the same way (after a
    // barrier of the survivors). No recovery that ends in an allReduce can beat it.
    RC_RETURN_IF_ERROR(barrier("floor", survivors));
    const Clock::time_point f0 = Clock::now();
    RC_RETURN_IF_ERROR(checkedAllReduce(*shrunk, dl()).withContext("allReduce on the shrunk communicator"));
    recordSpan("floor", f0, Clock::now());

    std::vector<uint8_t> killedAt;
    RC_RETURN_IF_ERROR(storeCall("get " + killKey, [&] {
      store_->wait({killKey}, plan_.opTimeout);
      killedAt = store_->get(killKey);
    }));
    const Clock::time_point killed{std::chrono::nanoseconds(std::stoll(std::string(killedAt.begin(), killedAt.end())))};
    record("detect", killed, failed);
    return Status::ok();
  }

  const RepPlan plan_;
  const int index_;
  const int n_;
  c10::intrusive_ptr<c10d::Store> store_;
  const std::string prefix_;
  std::string results_;  // "key=ms;..."
  std::shared_ptr<TcpCommunicator> c1_;
};

}  // namespace

const std::vector<Metric>& metrics() {
  static const std::vector<Metric> kMetrics = {
      {"init_ready", "init: create -> Ready", "members"},
      {"init_first", "init: create -> 1st allReduce", "members"},
      {"abort_idle", "abort: idle (the abort() call)", "members"},
      {"abort_coll", "abort: mid-allReduce -> op returns", "1 stalled"},
      {"abort_init", "abort: mid-init -> waitReady returns", "members"},
      {"detect", "SIGKILL -> survivors' allReduce fails", "survivors"},
      {"shrink", "shrink(afterError) -> 1st allReduce", "survivors"},
      {"reinit", "full re-init -> 1st allReduce", "survivors"},
      {"shrink_sync", "shrink, from the last survivor's call", "last->last"},
      {"reinit_sync", "re-init, from the last survivor's call", "last->last"},
      {"shrink_spread", "shrink: spread of the survivors' calls", "1st->last"},
      {"floor", "floor: allReduce alone, after a barrier", "survivors"},
      {"floor_sync", "floor, from the last survivor's call", "last->last"},
      {"split", "split(rank%2) -> 1st allReduce", "members"},
      {"grow", "grow N->N+1, join -> 1st allReduce", "all N+1"},
  };
  return kMetrics;
}

RepPlan planRep(int worldSize, int rep, std::chrono::milliseconds opTimeout) {
  RepPlan p;
  p.worldSize = worldSize;
  p.rep = rep;
  p.victim = rep % worldSize;
  p.stalled = (rep + worldSize / 2) % worldSize;
  p.shrinkFirst = rep % 2 == 0;
  p.opTimeout = opTimeout;
  return p;
}

int runRank(const RepPlan& plan, int index, uint16_t port) {
  c10::intrusive_ptr<c10d::Store> store;
  Status st = storeCall("connect", [&] {
    c10d::TCPStoreOptions o;
    o.port = port;
    o.isServer = false;
    o.timeout = plan.opTimeout;
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
  });
  if (st.isOk()) {
    RankRun run(plan, index, store);
    st = run.run();
  }
  if (st.isOk()) {
    return 0;
  }
  const std::string msg = "world size " + std::to_string(plan.worldSize) + ", repetition " +
                          std::to_string(plan.rep) + ", process " + std::to_string(index) + ": " + st.toString();
  std::fprintf(stderr, "rc_bench_primitives: %s\n", msg.c_str());
  if (store) {
    (void)storeCall("set", [&] { store->set(errorKey(index), bytesOf(msg)); });
  }
  return 1;
}

std::string resultKey(int index) {
  return "result/" + std::to_string(index);
}

std::string errorKey(int index) {
  return "error/" + std::to_string(index);
}

std::map<std::string, double> decodeResults(const std::string& text) {
  std::map<std::string, double> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(';', pos);
    if (end == std::string::npos) {
      end = text.size();
    }
    size_t eq = text.find('=', pos);
    if (eq != std::string::npos && eq < end) {
      out[text.substr(pos, eq - pos)] = std::strtod(text.substr(eq + 1, end - eq - 1).c_str(), nullptr);
    }
    pos = end + 1;
  }
  return out;
}

}  // namespace resilient_comm::bench
