#include "comm/communicator.h"

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

}  // namespace resilient_comm
