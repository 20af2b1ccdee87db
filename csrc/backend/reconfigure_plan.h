// torch's reconfigure API (c10d::Backend::reconfigure, torch >= 2.14) on our backends: the
// handles and the plan every member computes alike from them. Pure: no sockets, no torch.
//
// [Note: reconfigure handles]
// A handle names one process's endpoint for the next communicator and where it stands now:
//
//   resilient1|<host:port>|<identity>|<rank>|<size>|<mac>
//
// - host:port: the process's TCP listener (the one its current communicator's lineage uses,
//   or, in a group not configured yet, one of its own). Unique among live processes.
// - identity, rank, size: the communicator this process last built (its wire identity, the
//   same on every member) and its rank and size there; identity 0 for a process that has
//   built none (a group made with enable_reconfigure=True, before its first reconfigure), with
//   its init rank and size as the order it sorts in.
// - mac: SipHash of the rest under the job token (RESILIENT_COMM_TOKEN; 0 without one), so
//   that a handle from another job is refused rather than dialled.
//
// Because every handle says where its process stands, every member derives the same plan from
// the same handles, with no exchange of its own:
// - a set is ordered: the members of one communicator first, by identity then current rank
//   (survivors keep their relative order, so that a shrink is the fast path), then processes
//   that built none, by init rank and address;
// - the new list all of one communicator, in its rank order → a shrink of it (the current
//   connections resynchronised and reused: tcp_communicator.h, [Note: shrink reuses
//   connections]); the same members in the same order is a shrink that excludes nobody (after
//   an abort, say);
// - all of one communicator in its rank order, then processes that never built one → a grow:
//   the host communicator is built afresh over the handles' listeners (as below), and the
//   device communicator grows (ncclCommGrow) at its first use, the newcomers joining it;
// - anything else (a reorder, a merge of groups) → a fresh communicator over the handles'
//   listeners, named by the uuid and the member list.
// A handle naming a communicator this process has since replaced, from a process that took part
// in a later one (its address is a member's there), is stale: that process has a newer handle.
// Refused, like garbage, a foreign MAC, a duplicate, or a list without this process's own
// current handle. A process that sat out the later reconfigures still holds the handle of the
// communicator it last built: its handle is current, and the list (of several communicators)
// is a fresh communicator, as gloo accepts it.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "transport/tcp/auth.h"

namespace resilient_comm {

struct ReconfigureHandle {
  std::string text;  // as handed out
  std::string addr;  // host:port of the process's listener
  uint64_t identity = 0;
  int rank = 0;
  int size = 0;
};

// The handle this process hands out (see the note).
std::string formatReconfigureHandle(const std::string& addr, uint64_t identity, int rank, int size,
                                    const tcp::JobKey& key);
// A handle, or kInvalidArgument naming what is wrong with it.
Result<ReconfigureHandle> parseReconfigureHandle(const std::string& text, const tcp::JobKey& key);

struct ReconfigurePlan {
  enum class Kind { kShrink, kGrow, kFresh };
  Kind kind = Kind::kFresh;
  std::vector<ReconfigureHandle> members;  // in new rank order
  int rank = -1;                           // this process's new rank
  std::vector<int> exclude;                // kShrink: ranks of the shrunk communicator left out
  int grownFrom = 0;                       // kGrow: the current communicator's size (its ranks keep theirs)
  // A fresh communicator's name on the wire (kFresh, or a kShrink that fails on a member and
  // falls back to a fresh communicator).
  std::string epoch;
};

// The plan for `handles` (`ordered`: a list, ranks by position; else a set), this process
// being `self` (its current handle); `replaced`: identities of communicators this process has
// replaced -> the addresses of the members of every communicator it built since.
// kInvalidArgument for bad input (see the note), the group untouched.
Result<ReconfigurePlan> planReconfigure(const std::vector<std::string>& handles, bool ordered, const std::string& self,
                                        int64_t uuid, const std::map<uint64_t, std::set<std::string>>& replaced,
                                        const tcp::JobKey& key);

const char* planKindName(ReconfigurePlan::Kind kind);

}  // namespace resilient_comm
