#include "comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <exception>

namespace resilient_comm {

const char* commStateName(CommState s) {
  switch (s) {
    case CommState::kInitializing:
      return "Initializing";
    case CommState::kReady:
      return "Ready";
    case CommState::kError:
      return "Error";
    case CommState::kRevoked:
      return "Revoked";
    case CommState::kAborted:
      return "Aborted";
  }
  return "Unknown";
}

Status pollState(CommState state, const std::string& name, const std::function<Status()>& error) {
  switch (state) {
    case CommState::kInitializing:
      return Status(StatusCode::kInProgress, "init of group '" + name + "' in progress");
    case CommState::kReady:
      return Status::ok();
    default:
      return error();
  }
}

Status waitUntilReady(Communicator& comm, const StateSignal& signal, const Deadline& deadline) {
  for (;;) {
    const uint64_t seen = signal.generation();
    Status st = comm.poll();
    if (st.code() != StatusCode::kInProgress) {
      return st;
    }
    if (deadline.passed()) {
      Status t(StatusCode::kTimeout, "init of group '" + comm.name() + "' on rank " + std::to_string(comm.rank()) +
                                         " did not finish before its deadline; aborted");
      comm.abort(t.message());
      return t;
    }
    // Woken by the state change; the cap only bounds how late the deadline is noticed.
    signal.waitChange(seen, std::min<std::chrono::microseconds>(
                                std::chrono::microseconds(deadline.remainingMs(50) * 1000), std::chrono::milliseconds(50)));
  }
}

}  // namespace resilient_comm

namespace resilient_comm {

Result<std::shared_ptr<PendingOp>> Communicator::launch(const std::string& what, const Deadline&, std::shared_ptr<void>,
                                                        const std::function<Status()>&) {
  return Status(StatusCode::kNotSupported, what + ": this transport runs ops where they are called, not in flight");
}

Status Communicator::onStream(std::function<void()> fn) {
  try {
    fn();
    return Status::ok();
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, e.what());
  }
}

}  // namespace resilient_comm
