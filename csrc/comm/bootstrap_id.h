// Bootstrap ids (ncclUniqueId, HcclRootInfo): opaque bytes that rank 0 of a new communicator
// makes and every member reads back through the c10d Store, as hex text.
//
// Threads: any; exchangeId blocks up to the deadline (an abort ends it at once).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "comm/store_util.h"
#include "common/check.h"

namespace resilient_comm {

inline std::string hexEncode(const void* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  const auto* bytes = static_cast<const unsigned char*>(data);
  std::string s;
  s.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    s += digits[bytes[i] >> 4];
    s += digits[bytes[i] & 15];
  }
  return s;
}

// Fills out[0, n) from 2n lowercase hex digits; anything else is an error.
inline Status hexDecode(const std::string& s, void* out, size_t n) {
  auto val = [](char c) { return c >= '0' && c <= '9' ? c - '0' : (c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1); };
  if (s.size() != 2 * n) {
    return Status(StatusCode::kInternal, "a bootstrap id of " + std::to_string(s.size()) + " hex digits; expected " +
                                             std::to_string(2 * n));
  }
  auto* bytes = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < n; ++i) {
    int hi = val(s[2 * i]);
    int lo = val(s[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return Status(StatusCode::kInternal, "a bootstrap id that is not hex text");
    }
    bytes[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return Status::ok();
}

// The root calls make(out) and publishes the n bytes under `key`; every member (the root too)
// then reads them back into out.
inline Status exchangeId(const StorePtr& store, const std::string& key, bool isRoot,
                         const std::function<Status(void*)>& make, void* out, size_t n, const Deadline& dl,
                         AbortToken& abort) {
  if (isRoot) {
    RC_RETURN_IF_ERROR(make(out));
    RC_RETURN_IF_ERROR(storeSet(store, key, hexEncode(out, n)));
  }
  std::vector<std::string> id;
  RC_ASSIGN_OR_RETURN(id, storeFetch(store, {key}, dl, abort));
  return hexDecode(id[0], out, n);
}

}  // namespace resilient_comm
