#include "backend/unconfigured.h"

#include "comm/comm_lifecycle.h"

namespace resilient_comm {

namespace {

class Unconfigured final : public CommLifecycle {
 public:
  Unconfigured(const std::string& name, int rank, int size) : CommLifecycle(name, rank, size) {}

  Caps caps() const override {
    return Caps{};
  }
  uint64_t nextSeq() const override {
    return 0;
  }
  Status waitReady(const Deadline& deadline) override {
    return refused();
  }
  void abort(const std::string& reason) override {
    markAborted(reason);
  }
  Status allReduce(void*, size_t, DataType, RedOp, const Deadline&) override {
    return refused();
  }
  Status broadcast(void*, size_t, DataType, int, const Deadline&) override {
    return refused();
  }
  Status reduce(void*, size_t, DataType, RedOp, int, const Deadline&) override {
    return refused();
  }
  Status allGather(const void*, void*, size_t, DataType, const Deadline&) override {
    return refused();
  }
  Status reduceScatter(const void*, void*, size_t, DataType, RedOp, const Deadline&) override {
    return refused();
  }
  Status allToAll(const void*, const std::vector<size_t>&, const std::vector<size_t>&, void*,
                  const std::vector<size_t>&, const std::vector<size_t>&, DataType, const Deadline&) override {
    return refused();
  }
  Status gather(const void*, void*, size_t, DataType, int, const Deadline&) override {
    return refused();
  }
  Status scatter(const void*, void*, size_t, DataType, int, const Deadline&) override {
    return refused();
  }
  Status barrier(const Deadline&) override {
    return refused();
  }
  Status sendRecv(const std::vector<P2POp>&, const Deadline&, const P2PFeed*) override {
    return refused();
  }
  Result<std::shared_ptr<Communicator>> shrink(const std::vector<int>&, bool, const Deadline&) override {
    return refused();
  }
  Result<std::shared_ptr<Communicator>> split(int, int, const Deadline&) override {
    return refused();
  }
  Result<std::shared_ptr<Communicator>> grow(int, const c10::intrusive_ptr<c10d::Store>&, const std::string&,
                                             const Deadline&) override {
    return refused();
  }

 private:
  Status refused() const {
    return Status(StatusCode::kInvalidArgument, unconfiguredMessage(name()));
  }
};

}  // namespace

std::string unconfiguredMessage(const std::string& group) {
  return "group '" + group + "' was made with enable_reconfigure=True and has not been configured yet: call "
         "torch.distributed._reconfigure(uuid, handles, group) before issuing collectives";
}

std::shared_ptr<Communicator> unconfiguredCommunicator(const std::string& name, int rank, int size) {
  return std::make_shared<Unconfigured>(name, rank, size);
}

}  // namespace resilient_comm
