// The collectives of ResilientBackend: argument checks (tensor_args.h), then one queued Body
// per op that runs it on the communicator for the tensors' device. The queue, the worker and
// the group's lifecycle are in resilient_backend.cpp.
#include <c10/util/Exception.h>

#include "backend/resilient_backend.h"
#include "backend/tensor_args.h"

namespace resilient_comm {

namespace {

using c10d::OpType;

void* ptr(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : t.data_ptr();
}

// A flat buffer of `n` elements like `like`.
at::Tensor flat(const at::Tensor& like, int64_t n) {
  return at::empty({n}, like.options());
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ResilientBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "broadcast"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, opts.rootRank, size_, "root");
  auto comm = commFor(tensors, site.op);
  at::Tensor t = tensors[0];
  DataType dt = toDataType(site, t.scalar_type());
  int root = static_cast<int>(opts.rootRank);
  return enqueue(comm, OpType::BROADCAST, site.op, tensors, opts.timeout, !opts.asyncOp, [t, dt, root](Communicator& c, const Deadline& dl) {
    return c.broadcast(ptr(t), t.numel(), dt, root, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_reduce"};
  checkSingle(site, tensors, "tensors");
  auto comm = commFor(tensors, site.op);
  at::Tensor t = tensors[0];
  DataType dt = toDataType(site, t.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, t.scalar_type());
  return enqueue(comm, OpType::ALLREDUCE, site.op, tensors, opts.timeout, !opts.asyncOp, [t, dt, op](Communicator& c, const Deadline& dl) {
    return c.allReduce(ptr(t), t.numel(), dt, op, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_reduce_coalesced"};
  checkTensors(site, tensors, "tensors");
  auto comm = commFor(tensors, site.op);
  DataType dt = toDataType(site, tensors[0].scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, tensors[0].scalar_type());
  std::vector<at::Tensor> ts = tensors;
  return enqueue(comm, OpType::ALLREDUCE_COALESCED, site.op, tensors, opts.timeout, !opts.asyncOp, [ts, dt, op](Communicator& c, const Deadline& dl) {
    std::vector<at::Tensor> views;
    for (const at::Tensor& t : ts) {
      views.push_back(t.reshape({-1}));
    }
    at::Tensor buf = at::cat(views);
    Status st = c.allReduce(ptr(buf), buf.numel(), dt, op, dl);
    if (st.isOk()) {
      int64_t off = 0;
      for (const at::Tensor& t : ts) {
        t.view({-1}).copy_(buf.narrow(0, off, t.numel()));
        off += t.numel();
      }
    }
    return st;
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "reduce"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, opts.rootRank, size_, "root");
  auto comm = commFor(tensors, site.op);
  at::Tensor t = tensors[0];
  DataType dt = toDataType(site, t.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, t.scalar_type());
  int root = static_cast<int>(opts.rootRank);
  return enqueue(comm, OpType::REDUCE, site.op, tensors, opts.timeout, !opts.asyncOp, [t, dt, op, root](Communicator& c, const Deadline& dl) {
    return c.reduce(ptr(t), t.numel(), dt, op, root, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_gather"};
  checkSingle(site, inputs, "input");
  if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "output must be a list of " + std::to_string(size_) +
                                    " tensors (one per rank)");
  }
  checkSameShape(site, outputs[0], "output");
  checkSameDtype(site, outputs[0][0], inputs[0], "output", "input");
  if (outputs[0][0].numel() != inputs[0].numel()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "output tensors have " + std::to_string(outputs[0][0].numel()) +
                                    " elements but the input has " + std::to_string(inputs[0].numel()));
  }
  auto comm = commFor(inputs, site.op);
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = outputs[0];
  DataType dt = toDataType(site, in.scalar_type());
  int n = size_;
  return enqueue(comm, OpType::ALLGATHER, site.op, outs, opts.timeout, !opts.asyncOp, [in, outs, dt, n](Communicator& c, const Deadline& dl) {
    at::Tensor buf = flat(in, in.numel() * n);
    Status st = c.allGather(ptr(in), ptr(buf), in.numel(), dt, dl);
    if (st.isOk()) {
      for (int i = 0; i < n; ++i) {
        outs[i].view({-1}).copy_(buf.narrow(0, i * in.numel(), in.numel()));
      }
    }
    return st;
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_gather_into_tensor"};
  checkSingle(site, {input}, "input");
  checkSingle(site, {output}, "output");
  checkSameDtype(site, output, input, "output", "input");
  if (output.numel() != input.numel() * size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "output has " + std::to_string(output.numel()) +
                                    " elements; expected world size (" + std::to_string(size_) + ") x input (" +
                                    std::to_string(input.numel()) + ")");
  }
  auto comm = commFor({input}, site.op);
  at::Tensor in = input;
  at::Tensor out = output;
  DataType dt = toDataType(site, in.scalar_type());
  return enqueue(comm, OpType::_ALLGATHER_BASE, site.op, {out}, opts.timeout, !opts.asyncOp, [in, out, dt](Communicator& c, const Deadline& dl) {
    return c.allGather(ptr(in), ptr(out), in.numel(), dt, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                 std::vector<at::Tensor>& inputs,
                                                                                 const c10d::AllgatherOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_gather_into_tensor_coalesced"};
  checkTensors(site, inputs, "inputs");
  checkTensors(site, outputs, "outputs");
  if (inputs.size() != outputs.size()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "got " + std::to_string(inputs.size()) + " inputs but " +
                                    std::to_string(outputs.size()) + " outputs");
  }
  std::vector<DataType> dts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameDtype(site, outputs[i], inputs[i], "output", "input");
    if (outputs[i].numel() != inputs[i].numel() * size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "outputs[" + std::to_string(i) + "] must have world size x " +
                                      "inputs[" + std::to_string(i) + "] elements");
    }
    dts.push_back(toDataType(site, inputs[i].scalar_type()));
  }
  auto comm = commFor(inputs, site.op);
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return enqueue(comm, OpType::COALESCED, site.op, outs, opts.timeout, !opts.asyncOp, [ins, outs, dts](Communicator& c, const Deadline& dl) {
    for (size_t i = 0; i < ins.size(); ++i) {
      Status st = c.allGather(ptr(ins[i]), ptr(outs[i]), ins[i].numel(), dts[i], dl);
      if (!st.isOk()) {
        return st;
      }
    }
    return Status::ok();
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "gather"};
  checkSingle(site, inputs, "input");
  checkRank(site, opts.rootRank, size_, "root");
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "the root needs a gather_list of " + std::to_string(size_) +
                                      " tensors");
    }
    checkSameShape(site, outputs[0], "gather_list");
    checkSameDtype(site, outputs[0][0], inputs[0], "gather_list", "input");
    if (outputs[0][0].numel() != inputs[0].numel()) {
      C10_THROW_ERROR(ValueError, site.prefix() + "gather_list tensors must have as many elements as the input");
    }
    outs = outputs[0];
  } else if (!outputs.empty() && !outputs[0].empty()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "only the root (rank " + std::to_string(root) +
                                    ") may pass a gather_list");
  }
  auto comm = commFor(inputs, site.op);
  at::Tensor in = inputs[0];
  DataType dt = toDataType(site, in.scalar_type());
  int n = size_;
  return enqueue(comm, OpType::GATHER, site.op, outs, opts.timeout, !opts.asyncOp, [in, outs, dt, root, n](Communicator& c, const Deadline& dl) {
    at::Tensor buf = outs.empty() ? at::Tensor() : flat(in, in.numel() * n);
    Status st = c.gather(ptr(in), buf.defined() ? ptr(buf) : nullptr, in.numel(), dt, root, dl);
    if (st.isOk()) {
      for (size_t i = 0; i < outs.size(); ++i) {
        outs[i].view({-1}).copy_(buf.narrow(0, static_cast<int64_t>(i) * in.numel(), in.numel()));
      }
    }
    return st;
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "scatter"};
  checkSingle(site, outputs, "output");
  checkRank(site, opts.rootRank, size_, "root");
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "the root needs a scatter_list of " + std::to_string(size_) +
                                      " tensors");
    }
    checkSameShape(site, inputs[0], "scatter_list");
    checkSameDtype(site, inputs[0][0], outputs[0], "scatter_list", "output");
    if (inputs[0][0].numel() != outputs[0].numel()) {
      C10_THROW_ERROR(ValueError, site.prefix() + "scatter_list tensors must have as many elements as the output");
    }
    ins = inputs[0];
  } else if (!inputs.empty() && !inputs[0].empty()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "only the root (rank " + std::to_string(root) +
                                    ") may pass a scatter_list");
  }
  auto comm = commFor(outputs, site.op);
  at::Tensor out = outputs[0];
  DataType dt = toDataType(site, out.scalar_type());
  return enqueue(comm, OpType::SCATTER, site.op, {out}, opts.timeout, !opts.asyncOp, [ins, out, dt, root](Communicator& c, const Deadline& dl) {
    at::Tensor buf;
    if (!ins.empty()) {
      std::vector<at::Tensor> views;
      for (const at::Tensor& t : ins) {
        views.push_back(t.reshape({-1}));
      }
      buf = at::cat(views);
    }
    return c.scatter(buf.defined() ? ptr(buf) : nullptr, ptr(out), out.numel(), dt, root, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "reduce_scatter"};
  checkSingle(site, outputs, "output");
  if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "input must be a list of " + std::to_string(size_) +
                                    " tensors (one per rank)");
  }
  checkSameShape(site, inputs[0], "input");
  checkSameDtype(site, outputs[0], inputs[0][0], "output", "input");
  if (inputs[0][0].numel() != outputs[0].numel()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "input tensors must have as many elements as the output");
  }
  auto comm = commFor(outputs, site.op);
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins = inputs[0];
  DataType dt = toDataType(site, out.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, out.scalar_type());
  return enqueue(comm, OpType::REDUCE_SCATTER, site.op, {out}, opts.timeout, !opts.asyncOp, [ins, out, dt, op](Communicator& c, const Deadline& dl) {
    std::vector<at::Tensor> views;
    for (const at::Tensor& t : ins) {
      views.push_back(t.reshape({-1}));
    }
    at::Tensor buf = at::cat(views);
    return c.reduceScatter(ptr(buf), ptr(out), out.numel(), dt, op, dl);
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "reduce_scatter_tensor"};
  checkSingle(site, {input}, "input");
  checkSingle(site, {output}, "output");
  checkSameDtype(site, output, input, "output", "input");
  if (input.numel() != output.numel() * size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "input has " + std::to_string(input.numel()) +
                                    " elements; expected world size (" + std::to_string(size_) + ") x output (" +
                                    std::to_string(output.numel()) + ")");
  }
  auto comm = commFor({input}, site.op);
  at::Tensor in = input;
  at::Tensor out = output;
  DataType dt = toDataType(site, in.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, in.scalar_type());
  return enqueue(comm, OpType::_REDUCE_SCATTER_BASE, site.op, {out}, opts.timeout, !opts.asyncOp,
                 [in, out, dt, op](Communicator& c, const Deadline& dl) {
                   return c.reduceScatter(ptr(in), ptr(out), out.numel(), dt, op, dl);
                 });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "reduce_scatter_tensor_coalesced"};
  checkTensors(site, inputs, "inputs");
  checkTensors(site, outputs, "outputs");
  if (inputs.size() != outputs.size()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "got " + std::to_string(inputs.size()) + " inputs but " +
                                    std::to_string(outputs.size()) + " outputs");
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameDtype(site, outputs[i], inputs[i], "output", "input");
    if (inputs[i].numel() != outputs[i].numel() * size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "inputs[" + std::to_string(i) + "] must have world size x " +
                                      "outputs[" + std::to_string(i) + "] elements");
    }
  }
  auto comm = commFor(inputs, site.op);
  DataType dt = toDataType(site, inputs[0].scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, inputs[0].scalar_type());
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return enqueue(comm, OpType::COALESCED, site.op, outs, opts.timeout, !opts.asyncOp, [ins, outs, dt, op](Communicator& c, const Deadline& dl) {
    for (size_t i = 0; i < ins.size(); ++i) {
      Status st = c.reduceScatter(ptr(ins[i]), ptr(outs[i]), outs[i].numel(), dt, op, dl);
      if (!st.isOk()) {
        return st;
      }
    }
    return Status::ok();
  });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& outputSplitSizes,
                                                               std::vector<int64_t>& inputSplitSizes,
                                                               const c10d::AllToAllOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_to_all_single"};
  checkSingle(site, {input}, "input");
  checkSingle(site, {output}, "output");
  checkSameDtype(site, output, input, "output", "input");
  auto layout = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what,
                    std::vector<size_t>* counts, std::vector<size_t>* displs) {
    int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
    std::vector<int64_t> s = splits;
    if (s.empty()) {
      if (rows % size_ != 0) {
        C10_THROW_ERROR(ValueError, site.prefix() + what + " has " + std::to_string(rows) +
                                        " rows, which the world size (" + std::to_string(size_) +
                                        ") does not divide; pass split sizes");
      }
      s.assign(size_, rows / size_);
    }
    if (static_cast<int>(s.size()) != size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + what + " split sizes need " + std::to_string(size_) +
                                      " entries, got " + std::to_string(s.size()));
    }
    int64_t sum = 0;
    for (int64_t v : s) {
      if (v < 0) {
        C10_THROW_ERROR(ValueError, site.prefix() + what + " split sizes must not be negative");
      }
      displs->push_back(static_cast<size_t>(sum * rowElems));
      counts->push_back(static_cast<size_t>(v * rowElems));
      sum += v;
    }
    if (sum != rows) {
      C10_THROW_ERROR(ValueError, site.prefix() + what + " split sizes add up to " + std::to_string(sum) +
                                      " but its first dimension is " + std::to_string(rows));
    }
  };
  std::vector<size_t> sc, sd, rc, rd;
  layout(input, inputSplitSizes, "input", &sc, &sd);
  layout(output, outputSplitSizes, "output", &rc, &rd);
  auto comm = commFor({input}, site.op);
  at::Tensor in = input;
  at::Tensor out = output;
  DataType dt = toDataType(site, in.scalar_type());
  return enqueue(comm, OpType::ALLTOALL_BASE, site.op, {out}, opts.timeout, !opts.asyncOp,
                 [in, out, dt, sc, sd, rc, rd](Communicator& c, const Deadline& dl) {
                   return c.allToAll(ptr(in), sc, sd, ptr(out), rc, rd, dt, dl);
                 });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_to_all"};
  checkTensors(site, inputs, "input");
  checkTensors(site, outputs, "output");
  if (static_cast<int>(inputs.size()) != size_ || static_cast<int>(outputs.size()) != size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "input and output must be lists of " + std::to_string(size_) +
                                    " tensors (one per rank)");
  }
  checkSameDtype(site, outputs[0], inputs[0], "output", "input");
  auto comm = commFor(inputs, site.op);
  std::vector<size_t> sc, sd, rc, rd;
  size_t so = 0;
  size_t ro = 0;
  for (int i = 0; i < size_; ++i) {
    sc.push_back(inputs[i].numel());
    sd.push_back(so);
    so += inputs[i].numel();
    rc.push_back(outputs[i].numel());
    rd.push_back(ro);
    ro += outputs[i].numel();
  }
  DataType dt = toDataType(site, inputs[0].scalar_type());
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  int64_t total = static_cast<int64_t>(ro);
  return enqueue(comm, OpType::ALLTOALL, site.op, outs, opts.timeout, !opts.asyncOp,
                 [ins, outs, dt, sc, sd, rc, rd, total](Communicator& c, const Deadline& dl) {
                   std::vector<at::Tensor> views;
                   for (const at::Tensor& t : ins) {
                     views.push_back(t.reshape({-1}));
                   }
                   at::Tensor sendBuf = at::cat(views);
                   at::Tensor recvBuf = flat(outs[0], total);
                   Status st = c.allToAll(ptr(sendBuf), sc, sd, ptr(recvBuf), rc, rd, dt, dl);
                   if (st.isOk()) {
                     for (size_t i = 0; i < outs.size(); ++i) {
                       outs[i].view({-1}).copy_(recvBuf.narrow(0, rd[i], rc[i]));
                     }
                   }
                   return st;
                 });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "send"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, dstRank, size_, "destination rank");
  if (dstRank == rank_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "cannot send to itself");
  }
  auto comm = commFor(tensors, site.op);
  toDataType(site, tensors[0].scalar_type());
  const at::Tensor& t = tensors[0];
  return enqueueP2P(comm, OpType::SEND, site.op, t, P2POp{P2POp::Kind::kSend, dstRank, ptr(t), t.nbytes(), static_cast<uint64_t>(tag)});
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "recv"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, srcRank, size_, "source rank");
  if (srcRank == rank_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "cannot receive from itself");
  }
  auto comm = commFor(tensors, site.op);
  toDataType(site, tensors[0].scalar_type());
  const at::Tensor& t = tensors[0];
  return enqueueP2P(comm, OpType::RECV, site.op, t, P2POp{P2POp::Kind::kRecv, srcRank, ptr(t), t.nbytes(), static_cast<uint64_t>(tag)});
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "recv"};
  C10_THROW_ERROR(ValueError, site.prefix() + "receiving from any source is not supported; pass src");
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(cpu_, OpType::BARRIER, "barrier", {}, opts.timeout, !opts.asyncOp,
                 [](Communicator& c, const Deadline& dl) { return c.barrier(dl); });
}

}  // namespace resilient_comm
