// Store access for communicator bootstrap: every call bounded by a Deadline and an
// AbortToken, and store exceptions turned into Status.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <string>
#include <vector>

#include "common/abort_token.h"
#include "common/deadline.h"
#include "common/status.h"

namespace c10d {
class Store;
}

namespace resilient_comm {

using StorePtr = c10::intrusive_ptr<c10d::Store>;

Status storeSet(const StorePtr& store, const std::string& key, const std::string& value);
// Appends to `key`'s value (made if missing): several writers, one key.
Status storeAppend(const StorePtr& store, const std::string& key, const std::string& value);
Result<int64_t> storeAdd(const StorePtr& store, const std::string& key, int64_t delta);
// Whether `key` exists, without waiting.
Result<bool> storeCheck(const StorePtr& store, const std::string& key);
// Waits (polling with back-off, waking at once on abort) until every key exists, then reads
// them all. A timeout names the keys that never appeared.
Result<std::vector<std::string>> storeFetch(const StorePtr& store, const std::vector<std::string>& keys,
                                            const Deadline& dl, AbortToken& abort);

}  // namespace resilient_comm
