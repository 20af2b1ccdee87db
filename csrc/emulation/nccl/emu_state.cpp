#include "emulation/nccl/emu_state.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <thread>

#include "common/logging.h"

namespace resilient_comm::nccl {

using emu::EmuComm;

namespace emu {

namespace {
thread_local std::string tlsLastError;
}  // namespace

ncclResult_t failWith(ncclResult_t r, std::string why) {
  tlsLastError = std::move(why);
  return r;
}

ncclResult_t fromStatus(const Status& st) {
  switch (st.code()) {
    case StatusCode::kOk:
      return ncclSuccess;
    case StatusCode::kPeerFailure:
    case StatusCode::kMismatch:
      return ncclRemoteError;
    case StatusCode::kInvalidArgument:
      return ncclInvalidArgument;
    default:
      return ncclSystemError;
  }
}

void attachNet(EmuComm* c, std::shared_ptr<tcp::TcpCommunicator> net) {
  bool aborted = false;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->net = net;
    aborted = c->abortFlag.load();
  }
  if (aborted) {
    net->abort("ncclCommAbort");
  }
}

struct Launcher::Queue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<Clock::time_point, std::function<void()>>> jobs;
  bool closing = false;

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      // Launches come in bursts (a step's ops back to back): stay awake a moment for the next
      // one rather than pay a thread wake-up per launch (tens of us on a small VM).
      const auto spinUntil = Clock::now() + std::chrono::microseconds(300);
      while (jobs.empty() && !closing && Clock::now() < spinUntil) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
      }
      cv.wait(lock, [&] { return !jobs.empty() || closing; });
      if (jobs.empty()) {
        return;
      }
      // A timed wait costs the timer's slack (50 us by default), more than a short launch delay:
      // short delays are waited out by yielding.
      while (!closing && Clock::now() < jobs.front().first &&
             jobs.front().first - Clock::now() < std::chrono::microseconds(200)) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
      }
      if (jobs.front().first > Clock::now() && cv.wait_until(lock, jobs.front().first, [&] { return closing; })) {
        return;
      }
      std::function<void()> fn = std::move(jobs.front().second);
      jobs.pop_front();
      lock.unlock();
      fn();
      fn = nullptr;
      lock.lock();
    }
  }
};

Launcher::Launcher() : q_(std::make_shared<Queue>()) {
  std::thread([q = q_] { q->run(); }).detach();
}

Launcher::~Launcher() {
  std::lock_guard<std::mutex> lock(q_->mu);
  q_->closing = true;
  q_->cv.notify_all();
}

void Launcher::post(Clock::time_point due, std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(q_->mu);
  q_->jobs.emplace_back(due, std::move(fn));
  q_->cv.notify_all();
}

}  // namespace emu

EmuComm* NcclEmulator::State::newComm(int rank, int nranks, bool blocking, int device) {
  static std::atomic<int> made{0};
  auto* c = new EmuComm();  // never freed: see EmuComm
  c->rank = rank;
  c->nranks = nranks;
  c->blocking = blocking;
  c->device = device;
  c->name = "nccl-emu#" + std::to_string(made++);
  return c;
}

EmuComm* NcclEmulator::State::live(ncclComm_t h, const char* call) {
  auto* c = reinterpret_cast<EmuComm*>(h);
  if (c != nullptr && c->magic.load() == emu::kLiveMagic) {
    return c;
  }
  ++stats->misuse;
  RC_LOG(kError, "NCCL emulator: " << call << " on a communicator that was aborted, destroyed or never made "
                                   << "(undefined behaviour with the real NCCL)");
  emu::failWith(ncclInvalidArgument, std::string(call) + ": invalid communicator");
  return nullptr;
}

ncclResult_t NcclEmulator::State::ensureReady(EmuComm* c, const char* call) {
  ncclResult_t r = c->asyncError();
  if (r == ncclInProgress) {
    return emu::failWith(ncclInvalidArgument, std::string(call) +
                                                  ": attempt to use communicator before the previous operation "
                                                  "returned ncclSuccess");
  }
  return r;
}

ncclResult_t NcclEmulator::State::markFailed(EmuComm* c, ncclResult_t r) {
  if (!c->blocking) {
    c->result = r;
  }
  return r;
}

void NcclEmulator::State::startJob(EmuComm* c, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(c->mu);
    ++c->jobs;
  }
  std::thread([c, fn = std::move(fn), self = shared_from_this()] {
    fn();
    std::lock_guard<std::mutex> lock(c->mu);
    --c->jobs;
    c->cv.notify_all();
  }).detach();
}

void NcclEmulator::State::settle(EmuComm* c, const Status& s) {
  std::lock_guard<std::mutex> lock(c->mu);
  if (!s.isOk()) {
    c->lastError = s.message();
  }
  c->result = emu::fromStatus(s);
  c->cv.notify_all();
}

ncclResult_t NcclEmulator::State::waitSettled(EmuComm* c) {
  std::unique_lock<std::mutex> lock(c->mu);
  c->cv.wait(lock, [&] { return c->result.load() != ncclInProgress; });
  return c->asyncError();
}

Status NcclEmulator::State::untilAborted(EmuComm* c) {
  std::unique_lock<std::mutex> lock(c->mu);
  c->cv.wait(lock, [&] { return c->abortFlag.load(); });
  return Status(StatusCode::kAborted, "init aborted");
}

void NcclEmulator::State::raiseAbort(EmuComm* c, const std::string& why) {
  std::shared_ptr<tcp::TcpCommunicator> net;
  std::vector<EmuComm*> children;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->abortFlag = true;
    net = c->net;
    children = c->childrenInInit;
    c->cv.notify_all();
  }
  c->initAbort.abort(why);
  if (net) {
    net->abort(why);
  }
  for (EmuComm* child : children) {
    raiseAbort(child, why + " (of the parent, during the child's init)");
  }
}

void NcclEmulator::State::stopKernels(EmuComm* c, const std::string& why) {
  std::shared_ptr<tcp::TcpCommunicator> inOp;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->abortFlag = true;
    if (c->inNet > 0) {
      inOp = c->net;  // a kernel waits on the network: only interrupting it frees it
    }
    c->cv.notify_all();
  }
  if (inOp) {
    inOp->abort(why);
  }
  drain(c, /*jobsToo=*/false);
  c->abortFlag = false;
}

void NcclEmulator::State::drain(EmuComm* c, bool jobsToo) {
  std::unique_lock<std::mutex> lock(c->mu);
  c->cv.wait(lock, [&] { return c->kernels == 0 && (!jobsToo || c->jobs == 0); });
}

void NcclEmulator::State::checkNoGrowInInit(EmuComm* c, const char* call) {
  int grows = 0;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    grows = c->growsInInit;
  }
  if (grows > 0) {
    ++stats->misuse;
    RC_LOG(kError, "NCCL emulator: " << call << " of " << c->name << " while " << grows
                                     << " ncclCommGrow child(ren) still bootstrap over it (undefined behaviour with "
                                     << "the real NCCL: destroy the parent once the grow completed)");
  }
}

void NcclEmulator::State::free(EmuComm* c) {
  std::shared_ptr<tcp::TcpCommunicator> net;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->magic = emu::kDeadMagic;
    net = std::move(c->net);
  }
  if (net) {
    net->abort("communicator freed");
  }
}

void NcclEmulator::State::finishChild(EmuComm* p, Result<std::shared_ptr<Communicator>> child, ncclComm_t* out,
                                      bool blocking) {
  Status s = child.status();
  EmuComm* made = nullptr;
  if (s.isOk() && child.value()) {
    auto net = std::static_pointer_cast<tcp::TcpCommunicator>(child.value());
    made = newComm(net->rank(), net->size(), blocking, p->device);
    made->result = ncclInProgress;
    bool aborted = false;
    {
      std::lock_guard<std::mutex> lock(p->mu);
      p->childrenInInit.push_back(made);
      aborted = p->abortFlag.load();
    }
    emu::attachNet(made, net);
    if (aborted) {
      raiseAbort(made, "the parent was aborted during the child's init");
    }
    s = net->waitReady(Deadline::never());
    {
      std::lock_guard<std::mutex> lock(p->mu);
      p->childrenInInit.erase(std::remove(p->childrenInInit.begin(), p->childrenInInit.end(), made),
                              p->childrenInInit.end());
    }
    settle(made, s);
  }
  __atomic_store_n(out, reinterpret_cast<ncclComm_t>(made), __ATOMIC_RELEASE);
  settle(p, s);
}

const char* NcclEmulator::State::lastError(ncclComm_t comm) {
  thread_local std::string text;
  auto* c = reinterpret_cast<EmuComm*>(comm);
  text.clear();
  if (c != nullptr && (c->magic.load() == emu::kLiveMagic || c->magic.load() == emu::kDeadMagic)) {
    std::lock_guard<std::mutex> lock(c->mu);
    text = c->lastError;
  }
  if (text.empty()) {
    text = emu::tlsLastError;
  }
  return text.c_str();
}

void NcclEmulator::State::release() {
  std::lock_guard<std::mutex> lock(releaseMu_);
  released_ = true;
  releaseCv_.notify_all();
}

void NcclEmulator::State::waitReleased() {
  std::unique_lock<std::mutex> lock(releaseMu_);
  releaseCv_.wait(lock, [&] { return released_; });
}

}  // namespace resilient_comm::nccl
