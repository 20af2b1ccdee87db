// The script one process runs in one repetition of the primitives benchmark.
//
// A repetition has worldSize members (process indices 0..worldSize-1) and one spare (index
// worldSize), the joiner of the grow scenario. Every process connects to the parent's
// TCPStore as a client and runs, in order (every scenario under its own store prefix, each
// started from a store barrier so that its ranks start together):
//
//   init        members create a communicator C1 through the store; time to Ready and to
//               the first allReduce (per rank, from its own create() call)
//   split       C1.split(rank % 2, rank) -> first allReduce on the child
//   abort_idle  abort() on that (idle, Ready) child: the call itself
//   grow        members C1.grow(worldSize + 1), the spare join()s -> first allReduce
//   abort_init  every member creates a communicator no peer ever joins; one thread waits in
//               waitReady(), another aborts: abort() -> waitReady() returns
//   abort_coll  one member (`stalled`) calls allReduce on C1 while the others do not; once
//               that thread is blocked in the kernel, another thread aborts: abort() -> the
//               allReduce returns
//   detect      members create C2; all loop allReduce on it; after a few rounds the `victim`
//               SIGKILLs itself: its death -> the survivors' allReduce fails
//   shrink      survivors: C2.shrink({victim}, afterError=true) -> first allReduce
//   reinit      survivors: a fresh communicator through the store (new prefix) -> first
//               allReduce. shrink and reinit alternate which goes first across repetitions
//               (right after the failure); the other follows a barrier of the survivors.
//               Each also gets a "from the last call" figure: the last survivor's return
//               minus the last survivor's call (all processes share the host's steady
//               clock), which leaves out how far apart the survivors started (the detection
//               or the barrier's wake-ups), a skew that the per-rank figure includes.
//
// Each process writes its measurements (milliseconds) to the store under resultKey(index)
// before it exits (the victim before it dies); a failure is written under errorKey(index)
// and the process exits non-zero.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "common/status.h"

namespace resilient_comm::bench {

// Runs a c10d store call; an exception becomes an Internal status (without c10's backtrace).
template <typename Fn>
Status storeCall(const std::string& what, Fn&& fn) {
  try {
    fn();
    return Status::ok();
  } catch (const c10::Error& e) {
    return Status(StatusCode::kInternal, "store " + what + " failed: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, "store " + what + " failed: " + e.what());
  }
}

// One measured quantity: its key in the result map and how the table labels it.
struct Metric {
  const char* key;
  const char* label;
  const char* who;  // whose values are maxed per repetition
};
// In table order.
const std::vector<Metric>& metrics();

struct RepPlan {
  int worldSize = 0;
  int rep = 0;
  int victim = 0;            // SIGKILLs itself in the shrink scenario
  int stalled = 0;           // the member left pending in abort_coll
  bool shrinkFirst = true;   // shrink before reinit (else after)
  std::chrono::milliseconds opTimeout{20000};  // bound of every single wait
};
RepPlan planRep(int worldSize, int rep, std::chrono::milliseconds opTimeout);

// Process `index`'s part of the repetition; returns its exit code (the victim does not
// return). `port` is the parent's TCPStore on 127.0.0.1.
int runRank(const RepPlan& plan, int index, uint16_t port);

std::string resultKey(int index);
std::string errorKey(int index);
// "key=value;..." as written under resultKey().
std::map<std::string, double> decodeResults(const std::string& text);

}  // namespace resilient_comm::bench
