#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "common/env.h"

namespace resilient_comm::bench {

namespace {

std::string fmt(const char* format, double a, double b = 0) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, a, b);
  return buf;
}

std::string pad(const std::string& s, size_t width, bool left) {
  if (s.size() >= width) {
    return s;
  }
  std::string fill(width - s.size(), ' ');
  return left ? s + fill : fill + s;
}

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string jsonNumber(double v) {
  if (!std::isfinite(v)) {
    return "null";
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// Median of reinit / median of shrink (or of their "_sync" forms); 0 when either is missing.
double reinitOverShrink(const WorldResult& w, const std::string& suffix = "") {
  Stats s = summarize(w.samples("shrink" + suffix));
  Stats r = summarize(w.samples("reinit" + suffix));
  return s.n && r.n && s.median > 0 ? r.median / s.median : 0;
}

// What the per-survivor ratio could reach if a shrink cost nothing beyond its first
// allReduce: the median re-init over the median, per repetition, of the survivors' start
// spread plus the floor allReduce counted from the last call.
double perSurvivorCeiling(const WorldResult& w) {
  std::vector<double> best;
  for (const RepOutcome& o : w.reps) {
    double spread = 0, floor = 0;
    if (o.ok && o.value("shrink_spread", &spread) && o.value("floor_sync", &floor)) {
      best.push_back(spread + floor);
    }
  }
  Stats b = summarize(best);
  Stats r = summarize(w.samples("reinit"));
  return b.n && r.n && b.median > 0 ? r.median / b.median : 0;
}

// Per repetition reinit / shrink, then the median.
double medianRatio(const WorldResult& w) {
  std::vector<double> ratios;
  for (const RepOutcome& o : w.reps) {
    double s = 0, r = 0;
    if (o.ok && o.value("shrink", &s) && o.value("reinit", &r) && s > 0) {
      ratios.push_back(r / s);
    }
  }
  return summarize(ratios).median;
}

constexpr size_t kLabelWidth = 40;
constexpr size_t kWhoWidth = 10;
constexpr size_t kCellWidth = 19;

}  // namespace

bool RepOutcome::value(const std::string& key, double* out) const {
  auto endsWith = [&](const std::string& suffix) {
    return key.size() > suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (endsWith("_sync")) {
    const std::string base = key.substr(0, key.size() - 5);
    double call = 0, done = 0;
    if (!maxOver(base + "_call_at", &call) || !maxOver(base + "_done_at", &done)) {
      return false;
    }
    *out = done - call;
    return true;
  }
  if (endsWith("_spread")) {
    const std::string base = key.substr(0, key.size() - 7);
    double first = 0, last = 0;
    if (!minOver(base + "_call_at", &first) || !maxOver(base + "_call_at", &last)) {
      return false;
    }
    *out = last - first;
    return true;
  }
  return maxOver(key, out);
}

bool RepOutcome::minOver(const std::string& key, double* out) const {
  return extremeOver(key, out, [](double a, double b) { return std::min(a, b); });
}

bool RepOutcome::maxOver(const std::string& key, double* out) const {
  return extremeOver(key, out, [](double a, double b) { return std::max(a, b); });
}

bool RepOutcome::extremeOver(const std::string& key, double* out, double (*pick)(double, double)) const {
  bool found = false;
  for (const auto& m : perProcess) {
    auto it = m.find(key);
    if (it != m.end()) {
      *out = found ? pick(*out, it->second) : it->second;
      found = true;
    }
  }
  return found;
}

std::vector<double> WorldResult::samples(const std::string& key, bool (*keep)(const RepOutcome&)) const {
  std::vector<double> v;
  for (const RepOutcome& o : reps) {
    double x = 0;
    if (o.ok && (keep == nullptr || keep(o)) && o.value(key, &x)) {
      v.push_back(x);
    }
  }
  return v;
}

int WorldResult::repsOk() const {
  return static_cast<int>(std::count_if(reps.begin(), reps.end(), [](const RepOutcome& o) { return o.ok; }));
}

Stats summarize(std::vector<double> v) {
  Stats s;
  s.n = v.size();
  if (v.empty()) {
    return s;
  }
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(n)));
  s.p99 = v[std::max<size_t>(rank, 1) - 1];
  s.min = v.front();
  s.max = v.back();
  return s;
}

std::string formatTable(const std::vector<WorldResult>& results) {
  std::ostringstream os;
  std::string head = pad("metric (ms: median / p99 over reps)", kLabelWidth, true) + pad("max over", kWhoWidth, true);
  for (const WorldResult& w : results) {
    head += pad("N=" + std::to_string(w.worldSize), kCellWidth, false);
  }
  os << head << "\n" << std::string(head.size(), '-') << "\n";
  for (const Metric& m : metrics()) {
    std::string line = pad(m.label, kLabelWidth, true) + pad(m.who, kWhoWidth, true);
    for (const WorldResult& w : results) {
      Stats s = summarize(w.samples(m.key));
      line += pad(s.n ? fmt("%7.2f / %7.2f", s.median, s.p99) : std::string("-"), kCellWidth, false);
    }
    os << line << "\n";
  }
  std::string ratio = pad("re-init / shrink (ratio of medians)", kLabelWidth + kWhoWidth, true);
  std::string perRep = pad("re-init / shrink (median of ratios)", kLabelWidth + kWhoWidth, true);
  std::string ratioSync = pad("re-init / shrink, from the last call", kLabelWidth + kWhoWidth, true);
  std::string ceiling = pad("re-init / shrink, per-survivor ceiling", kLabelWidth + kWhoWidth, true);
  std::string ok = pad("repetitions ok", kLabelWidth + kWhoWidth, true);
  for (const WorldResult& w : results) {
    double r = reinitOverShrink(w);
    ratio += pad(r > 0 ? fmt("%.1fx", r) : std::string("-"), kCellWidth, false);
    double rs = reinitOverShrink(w, "_sync");
    ratioSync += pad(rs > 0 ? fmt("%.1fx", rs) : std::string("-"), kCellWidth, false);
    double c = perSurvivorCeiling(w);
    ceiling += pad(c > 0 ? fmt("%.1fx", c) : std::string("-"), kCellWidth, false);
    double pr = medianRatio(w);
    perRep += pad(pr > 0 ? fmt("%.1fx", pr) : std::string("-"), kCellWidth, false);
    ok += pad(std::to_string(w.repsOk()) + "/" + std::to_string(w.reps.size()), kCellWidth, false);
  }
  os << ratio << "\n" << perRep << "\n" << ceiling << "\n" << ratioSync << "\n" << ok << "\n";
  return os.str();
}

std::string toJson(const RunInfo& info, const std::vector<WorldResult>& results) {
  std::ostringstream os;
  os << "{\n \"benchmark\": \"primitives\",\n \"transport\": \"tcp\",\n";
  os << " \"date_utc\": " << jsonString(info.startedUtc) << ",\n";
  os << " \"elapsed_s\": " << jsonNumber(info.elapsedS) << ",\n";
  os << " \"config\": {\"world_sizes\": [";
  for (size_t i = 0; i < info.worldSizes.size(); ++i) {
    os << (i ? ", " : "") << info.worldSizes[i];
  }
  os << "], \"reps\": " << info.reps << ", \"op_timeout_ms\": " << info.opTimeoutMs
     << ", \"rep_timeout_s\": " << info.repTimeoutS
     << ", \"aggregation\": \"per repetition: max over the processes named in max_over; over repetitions: "
        "median and p99 (nearest rank)\"},\n";
  os << " \"knobs\": {";
  bool first = true;
  for (const env::KnobInfo& k : env::allKnobs()) {
    const char* v = std::getenv(k.name);
    os << (first ? "" : ", ") << jsonString(k.name) << ": " << jsonString(v && *v ? v : k.defaultValue);
    first = false;
  }
  os << "},\n \"metrics\": [";
  for (size_t i = 0; i < metrics().size(); ++i) {
    const Metric& m = metrics()[i];
    os << (i ? ",\n  " : "\n  ") << "{\"key\": " << jsonString(m.key) << ", \"label\": " << jsonString(m.label)
       << ", \"max_over\": " << jsonString(m.who) << "}";
  }
  os << "\n ],\n \"results\": [";
  for (size_t wi = 0; wi < results.size(); ++wi) {
    const WorldResult& w = results[wi];
    os << (wi ? ",\n  {" : "\n  {") << "\"world_size\": " << w.worldSize << ", \"reps_ok\": " << w.repsOk()
       << ", \"reps_failed\": " << (w.reps.size() - w.repsOk())
       << ",\n   \"reinit_over_shrink\": {\"ratio_of_medians\": " << jsonNumber(reinitOverShrink(w))
       << ", \"median_of_ratios\": " << jsonNumber(medianRatio(w))
       << ", \"ratio_of_medians_from_last_call\": " << jsonNumber(reinitOverShrink(w, "_sync"))
       << ", \"per_survivor_ceiling\": " << jsonNumber(perSurvivorCeiling(w))
       << "},\n   \"recovery_by_position_median_ms\": {";
    // shrink and reinit alternate which runs first after the failure (see scenarios.h)
    auto first = [](const RepOutcome& o) { return o.plan.shrinkFirst; };
    auto second = [](const RepOutcome& o) { return !o.plan.shrinkFirst; };
    os << "\"shrink_first\": " << jsonNumber(summarize(w.samples("shrink", first)).median)
       << ", \"shrink_second\": " << jsonNumber(summarize(w.samples("shrink", second)).median)
       << ", \"reinit_first\": " << jsonNumber(summarize(w.samples("reinit", second)).median)
       << ", \"reinit_second\": " << jsonNumber(summarize(w.samples("reinit", first)).median)
       << "},\n   \"summary\": {";
    for (size_t i = 0; i < metrics().size(); ++i) {
      const Metric& m = metrics()[i];
      std::vector<double> v = w.samples(m.key);
      Stats s = summarize(v);
      os << (i ? ",\n    " : "\n    ") << jsonString(m.key) << ": {\"n\": " << s.n
         << ", \"median_ms\": " << jsonNumber(s.median) << ", \"p99_ms\": " << jsonNumber(s.p99)
         << ", \"min_ms\": " << jsonNumber(s.min) << ", \"max_ms\": " << jsonNumber(s.max) << ", \"samples_ms\": [";
      for (size_t j = 0; j < v.size(); ++j) {
        os << (j ? ", " : "") << jsonNumber(v[j]);
      }
      os << "]}";
    }
    os << "},\n   \"reps\": [";
    for (size_t ri = 0; ri < w.reps.size(); ++ri) {
      const RepOutcome& o = w.reps[ri];
      os << (ri ? ",\n    {" : "\n    {") << "\"rep\": " << o.plan.rep << ", \"ok\": " << (o.ok ? "true" : "false")
         << ", \"error\": " << jsonString(o.error) << ", \"victim\": " << o.plan.victim
         << ", \"stalled\": " << o.plan.stalled << ", \"shrink_first\": " << (o.plan.shrinkFirst ? "true" : "false")
         << ", \"wall_ms\": " << jsonNumber(o.wallMs) << ", \"per_process_ms\": {";
      bool firstMetric = true;
      for (const Metric& m : metrics()) {
        std::string row;
        bool any = false;
        for (size_t p = 0; p < o.perProcess.size(); ++p) {
          auto it = o.perProcess[p].find(m.key);
          any = any || it != o.perProcess[p].end();
          row += (p ? ", " : "") + (it == o.perProcess[p].end() ? std::string("null") : jsonNumber(it->second));
        }
        if (any) {
          os << (firstMetric ? "" : ", ") << jsonString(m.key) << ": [" << row << "]";
          firstMetric = false;
        }
      }
      os << "}}";
    }
    os << "\n   ]}";
  }
  os << "\n ]\n}\n";
  return os.str();
}

}  // namespace resilient_comm::bench
