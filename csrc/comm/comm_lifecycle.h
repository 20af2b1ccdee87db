// CommLifecycle: the part of the Communicator contract every transport shares: the group's
// identity, the state machine and the first error (communicator.h, "States").
//
// A transport derives from it and keeps every transport-specific action (shutting sockets,
// ncclCommAbort, releasing an HcclComm) to itself: each transition below answers whether this
// call made it, and the transport acts on that answer after the call returns.
//
// Threads: state() is lock-free; error() and the transitions take an internal mutex, which is
// never held while the transport acts, so a transport may call them while holding its own
// locks (never the other way round). Transitions notify the StateSignal that waitReady()
// sleeps on. The first error or abort reason wins: once the state left Ready (or
// Initializing), later transitions answer false and change nothing.
#pragma once

#include <atomic>
#include <initializer_list>
#include <mutex>
#include <string>
#include <utility>

#include "common/abort_token.h"
#include "comm/communicator.h"

namespace resilient_comm {

class CommLifecycle : public Communicator {
 public:
  const std::string& name() const override {
    return name_;
  }
  int rank() const override {
    return rank_;
  }
  int size() const override {
    return size_;
  }
  CommState state() const override {
    return state_.load();
  }
  Status error() const override;
  // kInProgress while Initializing, Ok when Ready, else the recorded error.
  Status poll() override;
  Status waitReady(const Deadline& deadline) override;

 protected:
  CommLifecycle(std::string name, int rank, int size) : name_(std::move(name)), rank_(rank), size_(size) {}

  // Initializing -> Ready when `built` is Ok, else -> Error with `built` (in the context
  // "building group '<name>' on rank <rank>"). False if the state had moved on (aborted).
  bool finishInit(const Status& built);
  // Initializing -> `to` with `st` as the error, as given. False if the state had moved on.
  bool leaveInit(CommState to, const Status& st);
  // Initializing or Ready -> Aborted with `reason`. True if this call ended a live
  // communicator (it was not already failed or aborted).
  bool markAborted(const std::string& reason);
  // Ready -> Aborted with `reason` (an Initializing communicator is left as it is).
  bool markRetired(const std::string& reason);
  // Ready -> Error with `st`: true if `st` is the first error, the one error() now answers.
  bool markFailed(const Status& st);

 private:
  // `from` -> `to` with `st`, if the state is one of `from`.
  bool transition(std::initializer_list<CommState> from, CommState to, const Status& st);
  Status abortedStatus(const std::string& reason) const;

  const std::string name_;
  const int rank_;
  const int size_;
  std::atomic<CommState> state_{CommState::kInitializing};
  StateSignal stateSignal_;  // notified after every change of state_
  mutable std::mutex mu_;    // guards error_ and makes each transition one step
  Status error_;
};

}  // namespace resilient_comm
