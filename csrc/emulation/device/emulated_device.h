// An emulated device for the NCCL emulator (transport/nccl/nccl_emulator.h): streams whose
// "kernels" are host tasks that run in order, asynchronously, on a thread of each stream, and
// events that complete when their stream gets past them. It models what the transports rely on
// from CUDA: work on one stream runs in order and later than the call that enqueued it; a
// stream can wait for another's event; an event's query() says whether the work before it is
// done; an exception in a task is a sticky device error that every later query reports.
//
// The calling thread's current stream is the host unless a test makes an emulated stream
// current (setCurrentStream): host tensors are produced and consumed by host code, so waiting
// "on the current stream" for an op's end means a host wait there (DeviceEvent::
// blockCurrentStream answers false), while a current emulated stream is made to wait without
// blocking the host, as a CUDA stream would be.
//
// Threads: any thread may enqueue, query or wait; a stream's tasks run on its own thread. A
// stream whose last owner goes away finishes the tasks already queued, then its thread ends.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/status.h"
#include "device/stream_ops.h"

namespace resilient_comm::device::emu {

class Stream : public std::enable_shared_from_this<Stream> {
 public:
  static std::shared_ptr<Stream> create(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int device() const {
    return device_;
  }
  // Appends a task and returns its position on the stream (1, 2, ...).
  uint64_t enqueue(std::function<void()> task);
  // The position of the last task enqueued so far (0: none).
  uint64_t tail() const;
  // Every task up to `pos` has run.
  bool reached(uint64_t pos) const;
  // The first exception a task threw (a sticky device error), or Ok.
  Status error() const;
  // Blocks the calling thread (another stream's, in a cross-stream wait) until reached(pos).
  void waitReached(uint64_t pos) const;

 private:
  struct State;
  explicit Stream(int device);
  int device_;
  std::shared_ptr<State> state_;
};

// The calling thread's current emulated stream; null means the host.
std::shared_ptr<Stream> currentStream();
// Makes `s` (null: the host) current on the calling thread; returns the previous one.
std::shared_ptr<Stream> setCurrentStream(std::shared_ptr<Stream> s);
// The calling thread's current emulated device (0 until bound), as cudaGetDevice would answer.
int currentDevice();

// StreamOps over an emulated stream of device `index` (see stream_ops.h).
std::shared_ptr<StreamOps> makeEmulatedStreamOps(int index);

}  // namespace resilient_comm::device::emu
