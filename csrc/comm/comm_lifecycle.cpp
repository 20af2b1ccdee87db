#include "comm/comm_lifecycle.h"

#include <algorithm>

namespace resilient_comm {

Status CommLifecycle::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

Status CommLifecycle::poll() {
  return pollState(state_.load(), name_, [this] { return error(); });
}

Status CommLifecycle::waitReady(const Deadline& deadline) {
  return waitUntilReady(*this, stateSignal_, deadline);
}

bool CommLifecycle::finishInit(const Status& built) {
  if (built.isOk()) {
    return leaveInit(CommState::kReady, built);
  }
  return leaveInit(CommState::kError,
                   built.withContext("building group '" + name_ + "' on rank " + std::to_string(rank_)));
}

bool CommLifecycle::leaveInit(CommState to, const Status& st) {
  return transition({CommState::kInitializing}, to, st);
}

bool CommLifecycle::markAborted(const std::string& reason) {
  return transition({CommState::kInitializing, CommState::kReady}, CommState::kAborted, abortedStatus(reason));
}

bool CommLifecycle::markRetired(const std::string& reason) {
  return transition({CommState::kReady}, CommState::kAborted, abortedStatus(reason));
}

bool CommLifecycle::markFailed(const Status& st) {
  return transition({CommState::kReady}, CommState::kError, st);
}

bool CommLifecycle::transition(std::initializer_list<CommState> from, CommState to, const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (std::find(from.begin(), from.end(), state_.load()) == from.end()) {
    return false;
  }
  error_ = st;
  state_.store(to);
  stateSignal_.notify();
  return true;
}

Status CommLifecycle::abortedStatus(const std::string& reason) const {
  return Status(StatusCode::kAborted, "communicator of group '" + name_ + "' was aborted: " + reason);
}

}  // namespace resilient_comm
