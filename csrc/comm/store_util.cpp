#include "comm/store_util.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>

#include "common/check.h"

namespace resilient_comm {

namespace {

template <typename Fn>
Status guarded(const char* what, Fn&& fn) {
  try {
    fn();
    return Status::ok();
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, std::string("store ") + what + " failed: " + e.what());
  }
}

}  // namespace

Status storeSet(const StorePtr& store, const std::string& key, const std::string& value) {
  return guarded("set", [&] { store->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
}

Status storeAppend(const StorePtr& store, const std::string& key, const std::string& value) {
  return guarded("append", [&] { store->append(key, std::vector<uint8_t>(value.begin(), value.end())); });
}

Result<int64_t> storeAdd(const StorePtr& store, const std::string& key, int64_t delta) {
  int64_t out = 0;
  RC_RETURN_IF_ERROR(guarded("add", [&] { out = store->add(key, delta); }));
  return out;
}

Result<bool> storeCheck(const StorePtr& store, const std::string& key) {
  bool present = false;
  RC_RETURN_IF_ERROR(guarded("check", [&] { present = store->check({key}); }));
  return present;
}

Result<std::vector<std::string>> storeFetch(const StorePtr& store, const std::vector<std::string>& keys,
                                            const Deadline& dl, AbortToken& abort) {
  // check() is one round trip and never blocks; back off between checks (waking at once on
  // abort) rather than blocking in store->wait(), which cannot be interrupted.
  std::chrono::microseconds backoff(200);
  for (;;) {
    bool present = false;
    RC_RETURN_IF_ERROR(guarded("check", [&] { present = store->check(keys); }));
    if (present) {
      break;
    }
    if (abort.aborted()) {
      return Status(StatusCode::kAborted, abort.reason());
    }
    if (dl.passed()) {
      std::string missing;
      for (const std::string& k : keys) {
        bool has = false;
        (void)guarded("check", [&] { has = store->check({k}); });
        if (!has) {
          missing += (missing.empty() ? "" : ", ") + k;
        }
      }
      return Status(StatusCode::kTimeout, "these store keys never appeared before the deadline: " + missing +
                                              " (is every rank taking part?)");
    }
    abort.waitFor(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(5000));
  }
  std::vector<std::vector<uint8_t>> values;
  RC_RETURN_IF_ERROR(guarded("multiGet", [&] { values = store->multiGet(keys); }));
  std::vector<std::string> out;
  for (const auto& v : values) {
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

}  // namespace resilient_comm
