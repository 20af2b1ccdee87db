#include "emulation/device/emulated_device.h"

#include "common/check.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace resilient_comm::device::emu {

// Shared by the stream, its thread and the events recorded on it: the thread and the events may
// outlive the Stream object.
struct Stream::State {
  mutable std::mutex mu;
  mutable std::condition_variable cv;  // a task was queued, a task finished, or the stream closed
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0;
  uint64_t completed = 0;
  bool closing = false;
  Status error;

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return !queue.empty() || closing; });
      if (queue.empty()) {
        return;
      }
      std::function<void()> task = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      Status failed;
      try {
        task();
      } catch (const std::exception& e) {
        failed = Status(StatusCode::kInternal, std::string("a task on an emulated stream failed: ") + e.what());
      }
      task = nullptr;  // release what it captured before the position counts as reached
      lock.lock();
      if (!failed.isOk() && error.isOk()) {
        error = failed;
      }
      ++completed;
      cv.notify_all();
    }
  }
};

std::shared_ptr<Stream> Stream::create(int device) {
  return std::shared_ptr<Stream>(new Stream(device));
}

Stream::Stream(int device) : device_(device), state_(std::make_shared<State>()) {
  std::thread([s = state_] { s->run(); }).detach();
}

Stream::~Stream() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->closing = true;
  state_->cv.notify_all();
}

uint64_t Stream::enqueue(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->queue.push_back(std::move(task));
  state_->cv.notify_all();
  return ++state_->enqueued;
}

uint64_t Stream::tail() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->enqueued;
}

bool Stream::reached(uint64_t pos) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->completed >= pos;
}

Status Stream::error() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->error;
}

void Stream::waitReached(uint64_t pos) const {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->completed >= pos; });
}

namespace {

thread_local std::shared_ptr<Stream> tlsStream;
thread_local int tlsDevice = 0;

class EmulatedEvent : public DeviceEvent {
 public:
  EmulatedEvent(std::shared_ptr<Stream> stream, uint64_t pos) : stream_(std::move(stream)), pos_(pos) {}

  Result<bool> query() override {
    RC_RETURN_IF_ERROR(stream_->error());
    return stream_->reached(pos_);
  }

  Result<bool> blockCurrentStream() override {
    std::shared_ptr<Stream> current = tlsStream;
    if (!current) {
      return false;  // the host consumes: it must wait on the host
    }
    if (current != stream_) {
      current->enqueue([s = stream_, pos = pos_] { s->waitReached(pos); });
    }
    return true;
  }

 private:
  std::shared_ptr<Stream> stream_;
  uint64_t pos_;
};

class EmulatedStreamOps : public StreamOps {
 public:
  explicit EmulatedStreamOps(int index) : index_(index), stream_(Stream::create(index)) {}

  Result<DeviceGuard> bind() override {
    int previous = tlsDevice;
    tlsDevice = index_;
    return DeviceGuard([previous] { tlsDevice = previous; });
  }

  void* nativeStream() override {
    return stream_.get();
  }

  Status followCurrent() override {
    std::shared_ptr<Stream> current = tlsStream;
    if (current && current != stream_) {
      stream_->enqueue([current, pos = current->tail()] { current->waitReached(pos); });
    }
    return Status::ok();
  }

  Status runOnStream(std::function<void()> fn) override {
    stream_->enqueue(std::move(fn));
    return Status::ok();
  }

  Result<std::shared_ptr<DeviceEvent>> record() override {
    return std::shared_ptr<DeviceEvent>(std::make_shared<EmulatedEvent>(stream_, stream_->tail()));
  }

  Result<void*> scratch(size_t bytes) override {
    if (scratch_.size() < bytes) {
      scratch_.resize(bytes);
    }
    return static_cast<void*>(scratch_.data());
  }

  Result<std::shared_ptr<StreamOps>> fork() override {
    return makeEmulatedStreamOps(index_);
  }

  std::string describe() const override {
    return "emulated:" + std::to_string(index_);
  }

 private:
  int index_;
  std::shared_ptr<Stream> stream_;
  std::vector<char> scratch_;
};

}  // namespace

std::shared_ptr<Stream> currentStream() {
  return tlsStream;
}

std::shared_ptr<Stream> setCurrentStream(std::shared_ptr<Stream> s) {
  std::shared_ptr<Stream> previous = std::move(tlsStream);
  tlsStream = std::move(s);
  return previous;
}

int currentDevice() {
  return tlsDevice;
}

std::shared_ptr<StreamOps> makeEmulatedStreamOps(int index) {
  return std::make_shared<EmulatedStreamOps>(index);
}

}  // namespace resilient_comm::device::emu
