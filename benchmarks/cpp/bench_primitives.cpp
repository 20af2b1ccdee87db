// rc_bench_primitives: latency of the fault-tolerance primitives of the TCP transport
// (init, abort, shrink after a SIGKILL against a full re-init, split, grow), with real
// processes on this host.
//
// Each repetition forks worldSize + 1 fresh processes from this (single-threaded) parent,
// then starts a TCPStore server on port 0 and hands the children its port; the children run
// the script of scenarios.h, write their measurements to the store and exit (one SIGKILLs
// itself). The parent waits for them with a deadline, reads the results and drops the store
// before the next repetition's fork. Method and runs: benchmarks/results/primitives.md;
// resilient_comm.tools.bench.primitives (`resilient-comm bench primitives`) builds and runs this.
//
//   rc_bench_primitives [--world-sizes 2,4,8,16] [--reps 20] [--json PATH]
//                       [--op-timeout-ms 20000] [--rep-timeout-s 120] [--quiet]
#include <sys/wait.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "harness.h"
#include "report.h"
#include "scenarios.h"

namespace resilient_comm::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<int> worldSizes{2, 4, 8, 16};
  int reps = 20;
  std::string json;
  int opTimeoutMs = 20000;
  int repTimeoutS = 120;
  bool quiet = false;
};

const char* kUsage =
    "usage: rc_bench_primitives [--world-sizes 2,4,8,16] [--reps 20] [--json PATH]\n"
    "                           [--op-timeout-ms 20000] [--rep-timeout-s 120] [--quiet]\n";

bool parseInt(const std::string& s, int lo, int* out) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < lo || v > 1 << 20) {
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

// False on bad arguments; sets *help for --help.
bool parseArgs(int argc, char** argv, Options* o, bool* help) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&](std::string* v) {
      if (i + 1 >= argc) {
        return false;
      }
      *v = argv[++i];
      return true;
    };
    std::string v;
    if (a == "--help" || a == "-h") {
      *help = true;
    } else if (a == "--quiet") {
      o->quiet = true;
    } else if (a == "--world-sizes" && next(&v)) {
      o->worldSizes.clear();
      size_t pos = 0;
      while (pos <= v.size()) {
        size_t end = v.find(',', pos);
        end = end == std::string::npos ? v.size() : end;
        int n = 0;
        if (!parseInt(v.substr(pos, end - pos), 2, &n)) {
          std::fprintf(stderr, "world sizes must be integers >= 2, got '%s'\n", v.c_str());
          return false;
        }
        o->worldSizes.push_back(n);
        pos = end + 1;
      }
    } else if (a == "--reps" && next(&v)) {
      if (!parseInt(v, 1, &o->reps)) {
        return false;
      }
    } else if (a == "--json" && next(&v)) {
      o->json = v;
    } else if (a == "--op-timeout-ms" && next(&v)) {
      if (!parseInt(v, 1, &o->opTimeoutMs)) {
        return false;
      }
    } else if (a == "--rep-timeout-s" && next(&v)) {
      if (!parseInt(v, 1, &o->repTimeoutS)) {
        return false;
      }
    } else {
      std::fprintf(stderr, "unknown or incomplete option '%s'\n", a.c_str());
      return false;
    }
  }
  return true;
}

RepOutcome runRep(const RepPlan& plan, std::chrono::seconds repTimeout) {
  RepOutcome out;
  out.plan = plan;
  const int count = plan.worldSize + 1;
  out.perProcess.resize(count);
  const Clock::time_point t0 = Clock::now();
  Result<Brood> spawned =
      Brood::spawn(count, [plan](int index, uint16_t port) { return runRank(plan, index, port); });
  if (!spawned.isOk()) {
    out.error = spawned.status().toString();
    return out;
  }
  Brood brood = spawned.take();
  // The store and its threads exist only between this repetition's fork and the next one.
  c10::intrusive_ptr<c10d::TCPStore> store;
  Status st = storeCall("server start", [&] {
    c10d::TCPStoreOptions o;
    o.port = 0;
    o.isServer = true;
    o.waitWorkers = false;
    o.timeout = plan.opTimeout;
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
  });
  if (!st.isOk()) {
    out.error = st.toString();
    return out;  // ~Brood closes the pipes: the children exit
  }
  st = brood.release(store->getPort());
  if (!st.isOk()) {
    out.error = st.toString();
    return out;
  }
  auto expected = [&](int index, int status) {
    return index == plan.victim ? WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL
                                : WIFEXITED(status) && WEXITSTATUS(status) == 0;
  };
  Brood::Outcome exit = brood.wait(Deadline::after(repTimeout), expected);
  out.wallMs = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  st = storeCall("read results", [&] {
    for (int i = 0; i < count; ++i) {
      if (store->check({resultKey(i)})) {
        std::vector<uint8_t> v = store->get(resultKey(i));
        out.perProcess[i] = decodeResults(std::string(v.begin(), v.end()));
      }
      if (out.error.empty() && store->check({errorKey(i)})) {
        std::vector<uint8_t> v = store->get(errorKey(i));
        out.error = std::string(v.begin(), v.end());
      }
    }
  });
  if (!st.isOk()) {
    out.error += std::string(out.error.empty() ? "" : "; ") + st.toString();
  }
  if (exit.timedOut) {
    out.error += std::string(out.error.empty() ? "" : "; ") + "timed out after " +
                 std::to_string(repTimeout.count()) + " s; the processes still running were killed";
  } else if (exit.firstUnexpected >= 0 && out.error.empty()) {
    out.error = "process " + std::to_string(exit.firstUnexpected) + " ended unexpectedly (" +
                describeExit(exit.status[exit.firstUnexpected]) + ")";
  }
  out.ok = out.error.empty() && exit.firstUnexpected < 0;
  return out;
}

std::string utcNow() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

int benchMain(int argc, char** argv) {
  Options opt;
  bool help = false;
  if (!parseArgs(argc, argv, &opt, &help) || help) {
    std::fputs(kUsage, help ? stdout : stderr);
    return help ? 0 : 2;
  }
  Status st = blockChildSignals();
  if (!st.isOk()) {
    std::fprintf(stderr, "rc_bench_primitives: %s\n", st.toString().c_str());
    return 1;
  }
  RunInfo info;
  info.worldSizes = opt.worldSizes;
  info.reps = opt.reps;
  info.opTimeoutMs = opt.opTimeoutMs;
  info.repTimeoutS = opt.repTimeoutS;
  info.startedUtc = utcNow();
  const Clock::time_point started = Clock::now();

  std::vector<WorldResult> results;
  for (int n : opt.worldSizes) {
    WorldResult w;
    w.worldSize = n;
    for (int rep = 0; rep < opt.reps; ++rep) {
      RepOutcome o =
          runRep(planRep(n, rep, std::chrono::milliseconds(opt.opTimeoutMs)), std::chrono::seconds(opt.repTimeoutS));
      if (!o.ok) {
        std::fprintf(stderr, "  N=%d rep %d FAILED: %s\n", n, rep, o.error.c_str());
      }
      w.reps.push_back(std::move(o));
    }
    if (!opt.quiet) {
      double wall = 0;
      for (const RepOutcome& o : w.reps) {
        wall += o.wallMs;
      }
      std::fprintf(stderr, "  N=%d: %d/%d repetitions ok (%.1f s)\n", n, w.repsOk(), opt.reps, wall / 1e3);
    }
    results.push_back(std::move(w));
  }
  info.elapsedS = std::chrono::duration<double>(Clock::now() - started).count();

  std::printf("\n%s", formatTable(results).c_str());
  std::fflush(stdout);
  if (!opt.json.empty()) {
    std::ofstream f(opt.json);
    f << toJson(info, results);
    if (!f) {
      std::fprintf(stderr, "rc_bench_primitives: could not write %s\n", opt.json.c_str());
      return 1;
    }
  }
  for (const WorldResult& w : results) {
    if (w.repsOk() < static_cast<int>(w.reps.size())) {
      return 3;  // measured, but not every repetition succeeded
    }
  }
  return 0;
}

}  // namespace
}  // namespace resilient_comm::bench

int main(int argc, char** argv) {
  return resilient_comm::bench::benchMain(argc, argv);
}
