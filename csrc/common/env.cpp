#include "common/env.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace resilient_comm::env {

const std::vector<KnobInfo>& allKnobs() {
  static const std::vector<KnobInfo> knobs = {
#define RC_KNOB_INFO(id, name, dflt, doc) {name, dflt, doc},
      RC_KNOBS(RC_KNOB_INFO)
#undef RC_KNOB_INFO
  };
  return knobs;
}

const KnobInfo& info(Knob knob) {
  return allKnobs().at(static_cast<size_t>(knob));
}

std::string getString(Knob knob) {
  const KnobInfo& k = info(knob);
  const char* v = std::getenv(k.name);
  return (v != nullptr && *v != '\0') ? std::string(v) : std::string(k.defaultValue);
}

namespace {
template <typename T, typename Parse>
T parseOr(Knob knob, Parse parse) {
  const KnobInfo& k = info(knob);
  std::string v = getString(knob);
  try {
    size_t used = 0;
    T out = parse(v, &used);
    if (used == v.size()) {
      return out;
    }
  } catch (const std::exception&) {
  }
  std::fprintf(stderr, "[resilient_comm] ignoring %s=%s: not a number; using %s\n", k.name, v.c_str(),
               k.defaultValue);
  return parse(std::string(k.defaultValue), nullptr);
}
}  // namespace

int64_t getInt(Knob knob) {
  return parseOr<int64_t>(knob, [](const std::string& s, size_t* used) { return std::stoll(s, used); });
}

double getDouble(Knob knob) {
  return parseOr<double>(knob, [](const std::string& s, size_t* used) { return std::stod(s, used); });
}

}  // namespace resilient_comm::env
