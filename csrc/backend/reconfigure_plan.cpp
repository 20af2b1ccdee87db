#include "backend/reconfigure_plan.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <tuple>

#include "common/check.h"
#include "transport/tcp/mesh.h"

namespace resilient_comm {

namespace {

constexpr const char* kMagic = "resilient1";
constexpr size_t kMaxHandle = 512;

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

bool parseHex64(const std::string& s, uint64_t* out) {
  if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return false;
  }
  *out = std::strtoull(s.c_str(), nullptr, 16);
  return true;
}

bool parseInt(const std::string& s, int* out) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  *out = std::atoi(s.c_str());
  return true;
}

std::string body(const std::string& addr, uint64_t identity, int rank, int size) {
  return std::string(kMagic) + "|" + addr + "|" + hex64(identity) + "|" + std::to_string(rank) + "|" +
         std::to_string(size);
}

// For messages: a handle as it was given, cut and with control bytes escaped.
std::string shown(const std::string& text) {
  std::string out;
  for (char c : text.substr(0, 96)) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return "'" + out + (text.size() > 96 ? "...'" : "'");
}

Status bad(const std::string& text, const std::string& why) {
  return Status(StatusCode::kInvalidArgument, "reconfigure handle " + shown(text) + " " + why);
}

}  // namespace

std::string formatReconfigureHandle(const std::string& addr, uint64_t identity, int rank, int size,
                                    const tcp::JobKey& key) {
  std::string b = body(addr, identity, rank, size);
  return b + "|" + hex64(key.mac(b.data(), b.size()));
}

Result<ReconfigureHandle> parseReconfigureHandle(const std::string& text, const tcp::JobKey& key) {
  if (text.size() > kMaxHandle) {
    return bad(text, "is " + std::to_string(text.size()) + " bytes long: not a handle of this backend");
  }
  std::vector<std::string> f;
  for (size_t pos = 0;;) {
    size_t bar = text.find('|', pos);
    f.push_back(text.substr(pos, bar == std::string::npos ? std::string::npos : bar - pos));
    if (bar == std::string::npos) {
      break;
    }
    pos = bar + 1;
  }
  if (f.size() != 6 || f[0] != kMagic) {
    return bad(text, "is not a handle of this backend (expected 'resilient1|host:port|...', as "
                     "get_reconfigure_handle() returns on a resilient_comm group)");
  }
  ReconfigureHandle h;
  h.text = text;
  h.addr = f[1];
  const size_t colon = h.addr.rfind(':');
  int port = 0;
  uint64_t mac = 0;
  if (colon == std::string::npos || colon == 0 || !parseInt(h.addr.substr(colon + 1), &port) || port < 1 ||
      port > 65535) {
    return bad(text, "has no valid host:port");
  }
  if (!parseHex64(f[2], &h.identity) || !parseInt(f[3], &h.rank) || !parseInt(f[4], &h.size) || h.size < 1 ||
      h.rank >= h.size || !parseHex64(f[5], &mac)) {
    return bad(text, "is malformed (identity, rank, size or MAC)");
  }
  std::string b = body(h.addr, h.identity, h.rank, h.size);
  if (b + "|" + f[5] != text) {
    return bad(text, "is not in canonical form");
  }
  if (mac != key.mac(b.data(), b.size())) {
    return bad(text, key.set() ? "is not signed with this job's token (RESILIENT_COMM_TOKEN): a handle of another job"
                               : "is signed with a job token, and this process has none (RESILIENT_COMM_TOKEN)");
  }
  return h;
}

const char* planKindName(ReconfigurePlan::Kind kind) {
  return kind == ReconfigurePlan::Kind::kShrink ? "shrink" : kind == ReconfigurePlan::Kind::kGrow ? "grow" : "fresh";
}

Result<ReconfigurePlan> planReconfigure(const std::vector<std::string>& handles, bool ordered, const std::string& self,
                                        int64_t uuid, const std::map<uint64_t, std::set<std::string>>& replaced,
                                        const tcp::JobKey& key) {
  if (handles.empty()) {
    return Status(StatusCode::kInvalidArgument, "reconfigure needs at least one handle");
  }
  ReconfigurePlan plan;
  std::map<std::string, std::string> byAddr;
  for (const std::string& text : handles) {
    ReconfigureHandle h;
    RC_ASSIGN_OR_RETURN(h, parseReconfigureHandle(text, key));
    auto [it, fresh] = byAddr.emplace(h.addr, text);
    if (!fresh) {
      return bad(text, it->second == text ? "is given twice"
                                          : "names the same endpoint as " + shown(it->second) +
                                                ": one of them is stale (call get_reconfigure_handle() again)");
    }
    auto since = h.identity != 0 ? replaced.find(h.identity) : replaced.end();
    if (since != replaced.end() && since->second.count(h.addr) != 0) {
      return bad(text, "is stale: it names a communicator that a later reconfigure replaced, and its process took "
                       "part in that one (each process must call get_reconfigure_handle() again after every "
                       "reconfigure)");
    }
    plan.members.push_back(std::move(h));
  }
  if (!ordered) {
    std::sort(plan.members.begin(), plan.members.end(), [](const ReconfigureHandle& a, const ReconfigureHandle& b) {
      return std::make_tuple(a.identity == 0, a.identity, a.rank, a.addr) <
             std::make_tuple(b.identity == 0, b.identity, b.rank, b.addr);
    });
  }
  for (size_t i = 0; i < plan.members.size(); ++i) {
    if (plan.members[i].text == self) {
      plan.rank = static_cast<int>(i);
    }
  }
  if (plan.rank < 0) {
    auto parsed = parseReconfigureHandle(self, key);
    if (parsed.isOk() && byAddr.count(parsed.value().addr) != 0) {
      return bad(byAddr[parsed.value().addr], "is stale: it is this process's former handle, and its current one is " +
                                                  shown(self) +
                                                  " (call get_reconfigure_handle() again after every reconfigure)");
    }
    return Status(StatusCode::kInvalidArgument, "this process's handle " + shown(self) + " is not among the " +
                                                    std::to_string(handles.size()) +
                                                    " handles: only the new communicator's members call reconfigure");
  }
  std::string book;
  for (const ReconfigureHandle& h : plan.members) {
    book += h.addr + ";";
  }
  plan.epoch = "reconfigure/" + std::to_string(uuid) + "/" + hex64(tcp::fnv1a(book)) + "/";
  // A shrink: every member of one communicator, in its rank order (see the note).
  const ReconfigureHandle& first = plan.members.front();
  bool shrink = first.identity != 0;
  for (size_t i = 0; shrink && i < plan.members.size(); ++i) {
    const ReconfigureHandle& h = plan.members[i];
    shrink = h.identity == first.identity && h.size == first.size && (i == 0 || h.rank > plan.members[i - 1].rank);
  }
  if (shrink) {
    plan.kind = ReconfigurePlan::Kind::kShrink;
    std::vector<bool> kept(first.size, false);
    for (const ReconfigureHandle& h : plan.members) {
      kept[h.rank] = true;
    }
    for (int r = 0; r < first.size; ++r) {
      if (!kept[r]) {
        plan.exclude.push_back(r);
      }
    }
    return plan;
  }
  // A grow: every member of one communicator, in its rank order (ranks 0..size-1), then
  // processes that never built one.
  const size_t had = first.identity != 0 ? static_cast<size_t>(first.size) : 0;
  bool grow = had > 0 && had < plan.members.size();
  for (size_t i = 0; grow && i < plan.members.size(); ++i) {
    const ReconfigureHandle& h = plan.members[i];
    grow = i < had ? h.identity == first.identity && h.size == first.size && h.rank == static_cast<int>(i)
                   : h.identity == 0;
  }
  if (grow) {
    plan.kind = ReconfigurePlan::Kind::kGrow;
    plan.grownFrom = static_cast<int>(had);
    return plan;
  }
  plan.kind = ReconfigurePlan::Kind::kFresh;
  return plan;
}

}  // namespace resilient_comm
