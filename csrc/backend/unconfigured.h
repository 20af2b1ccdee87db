// The host communicator of a group made with enable_reconfigure=True until its first
// reconfigure: it connects nothing, and every op on it is refused (the backend refuses them
// first, with the advice to reconfigure; this is the backstop). abort() ends it like any other.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace resilient_comm {

std::shared_ptr<Communicator> unconfiguredCommunicator(const std::string& name, int rank, int size);

// The message of an op refused on such a group.
std::string unconfiguredMessage(const std::string& group);

}  // namespace resilient_comm
