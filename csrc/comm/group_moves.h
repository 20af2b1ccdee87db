// The bookkeeping of shrink and split that every transport shares: checking an exclude list
// and renumbering the survivors, and agreeing through the store on who is in a split's color.
//
// Threads: any; agreeOnMembers blocks up to the deadline (an abort ends it at once).
#pragma once

#include <algorithm>
#include <charconv>
#include <string>
#include <utility>
#include <vector>

#include "comm/store_util.h"
#include "common/check.h"

namespace resilient_comm {

struct ShrinkPlan {
  int newRank = 0;
  int newSize = 0;
  std::vector<int> survivors;  // old ranks, in order: survivors[newRank] == the caller's old rank
  // "0,1,3," : names the survivor set in store keys.
  std::string survivorList() const {
    std::string s;
    for (int r : survivors) {
      s += std::to_string(r) + ",";
    }
    return s;
  }
};

// Survivors are renumbered contiguously in their old order. The caller (`rank` of `size`) must
// survive; an exclude list with a rank out of range, repeated, or the caller's is refused.
inline Result<ShrinkPlan> planShrink(const std::vector<int>& exclude, int rank, int size) {
  std::vector<bool> out(size, false);
  for (int r : exclude) {
    if (r < 0 || r >= size || out[r] || r == rank) {
      return Status(StatusCode::kInvalidArgument, "shrink: bad exclude list (rank " + std::to_string(r) +
                                                      "): out of range, repeated, or this rank");
    }
    out[r] = true;
  }
  if (static_cast<int>(exclude.size()) >= size) {
    return Status(StatusCode::kInvalidArgument, "shrink: excluding everyone leaves nobody");
  }
  ShrinkPlan p;
  for (int r = 0; r < size; ++r) {
    if (!out[r]) {
      if (r == rank) {
        p.newRank = static_cast<int>(p.survivors.size());
      }
      p.survivors.push_back(r);
    }
  }
  p.newSize = static_cast<int>(p.survivors.size());
  return p;
}

// Every member (`rank` of `size`) publishes "color,key" under keyPrefix + rank; returns the
// members of `color` ordered by key, then by rank (as ncclCommSplit numbers them), or nobody
// for a negative color.
inline Result<std::vector<int>> agreeOnMembers(const StorePtr& store, const std::string& keyPrefix, int rank,
                                               int size, int color, int key, const Deadline& dl, AbortToken& abort) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    keys.push_back(keyPrefix + std::to_string(r));
  }
  RC_RETURN_IF_ERROR(storeSet(store, keys[rank], std::to_string(color) + "," + std::to_string(key)));
  std::vector<std::string> all;
  RC_ASSIGN_OR_RETURN(all, storeFetch(store, keys, dl, abort));
  std::vector<std::pair<int, int>> byKey;
  for (int r = 0; r < size; ++r) {
    const std::string& v = all[r];
    size_t comma = v.find(',');
    int c = 0;
    int k = 0;
    if (comma == std::string::npos || std::from_chars(v.data(), v.data() + comma, c).ec != std::errc() ||
        std::from_chars(v.data() + comma + 1, v.data() + v.size(), k).ec != std::errc()) {
      return Status(StatusCode::kInternal, "split: rank " + std::to_string(r) + " published '" + v +
                                               "' under " + keys[r] + ", not 'color,key'");
    }
    if (color >= 0 && c == color) {
      byKey.push_back({k, r});
    }
  }
  std::sort(byKey.begin(), byKey.end());
  std::vector<int> members;
  for (const auto& kr : byKey) {
    members.push_back(kr.second);
  }
  return members;
}

}  // namespace resilient_comm
