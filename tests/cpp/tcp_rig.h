// Helpers for the C++ tests that build a TCP communicator on one thread while the test plays
// the other side: a guard that aborts and joins the build thread when a CHECK throws, and the
// listener address a rank published.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transport/tcp/tcp_communicator.h"

namespace rc_test {

// Aborts the communicator and joins its build thread if the test leaves early.
struct BuildJoiner {
  std::thread& t;
  std::shared_ptr<resilient_comm::tcp::TcpCommunicator>& c;
  ~BuildJoiner() {
    if (t.joinable()) {
      c->abort("test failed");
      t.join();
    }
  }
};

// Rank `rank` of a 2-rank TCP group `name` meeting under `prefix` of `store`.
inline std::shared_ptr<resilient_comm::tcp::TcpCommunicator> twoRankComm(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& name, const std::string& prefix, int rank,
    std::chrono::milliseconds within) {
  resilient_comm::tcp::TcpOptions o;
  o.name = name;
  o.store = store;
  o.prefix = prefix;
  o.rank = rank;
  o.size = 2;
  return resilient_comm::tcp::TcpCommunicator::create(std::move(o), resilient_comm::Deadline::after(within));
}

// (host, port) of the listener published under `key`, once it is there.
inline std::pair<std::string, int> publishedAddress(c10d::Store& store, const std::string& key) {
  store.wait({key}, std::chrono::milliseconds(5000));
  std::vector<uint8_t> v = store.get(key);
  const std::string addr(v.begin(), v.end());
  const auto colon = addr.rfind(':');
  return {addr.substr(0, colon), std::stoi(addr.substr(colon + 1))};
}

}  // namespace rc_test
