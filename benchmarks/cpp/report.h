// What one run of the primitives benchmark measured, and its two renderings: the aligned
// table (stdout) and the JSON document (--json) that resilient_comm.tools.bench.primitives reads.
//
// Per repetition a metric's value is the maximum over the processes that measured it (the
// slowest rank decides when the group can go on); over repetitions the table shows the
// median and the p99 (nearest rank: with 20 repetitions, the largest value). A "<key>_sync"
// metric is derived per repetition from two instants every process recorded: the maximum of
// "<key>_done_at" minus the maximum of "<key>_call_at" (last return minus last call).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "scenarios.h"

namespace resilient_comm::bench {

struct RepOutcome {
  RepPlan plan;
  bool ok = false;
  std::string error;  // why the repetition failed (empty when ok)
  double wallMs = 0;  // fork to the last child's exit
  // Per process index (worldSize + 1 of them): metric key -> milliseconds.
  std::vector<std::map<std::string, double>> perProcess;

  // Max over processes; for "<key>_sync" the last "<key>_done_at" minus the last
  // "<key>_call_at", for "<key>_spread" the last "<key>_call_at" minus the first. False if
  // no process measured it.
  bool value(const std::string& key, double* out) const;

 private:
  bool maxOver(const std::string& key, double* out) const;
  bool minOver(const std::string& key, double* out) const;
  bool extremeOver(const std::string& key, double* out, double (*pick)(double, double)) const;
};

struct WorldResult {
  int worldSize = 0;
  std::vector<RepOutcome> reps;

  // One value per successful repetition that measured `key` (and, if given, passes `keep`).
  std::vector<double> samples(const std::string& key, bool (*keep)(const RepOutcome&) = nullptr) const;
  int repsOk() const;
};

struct Stats {
  size_t n = 0;
  double median = 0, p99 = 0, min = 0, max = 0;
};
Stats summarize(std::vector<double> v);

struct RunInfo {
  std::vector<int> worldSizes;
  int reps = 0;
  int opTimeoutMs = 0;
  int repTimeoutS = 0;
  std::string startedUtc;
  double elapsedS = 0;
};

std::string formatTable(const std::vector<WorldResult>& results);
std::string toJson(const RunInfo& info, const std::vector<WorldResult>& results);

}  // namespace resilient_comm::bench
