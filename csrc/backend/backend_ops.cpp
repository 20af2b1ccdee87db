// The collectives of ResilientBackend: argument checks (tensor_args.h), then one Body per op that
// runs it on the communicator for the tensors' device. The queue, the device launch, the worker
// and the group's lifecycle are in resilient_backend.cpp.
//
// [Note: one body for host and device transports]
// A body runs on the worker (TCP: each call returns when done) or inside a device
// communicator's launch() (NCCL: each call only enqueues; see communicator.h). So every touch of
// tensor data goes through c.onStream(): filling a flat buffer before the collective, copying
// results out after it. Temporaries are allocated on the calling thread (Temps) and held by the
// body, which a device op keeps until its end event has completed.
#include <c10/util/Exception.h>

#include <atomic>
#include <memory>

#include "backend/resilient_backend.h"
#include "backend/tensor_args.h"
#include "common/check.h"

namespace resilient_comm {

namespace {

using c10d::OpType;

void* ptr(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : t.data_ptr();
}

// An op's temporaries: held for as long as the body that made them (see the Note above).
class Temps {
 public:
  // A flat buffer of `n` elements like `like`.
  at::Tensor flat(const at::Tensor& like, int64_t n) {
    held_->push_back(at::empty({n}, like.options()));
    return held_->back();
  }

 private:
  std::shared_ptr<std::vector<at::Tensor>> held_ = std::make_shared<std::vector<at::Tensor>>();
};

std::vector<at::Tensor> flattened(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> views;
  for (const at::Tensor& t : ts) {
    views.push_back(t.reshape({-1}));
  }
  return views;
}

// On the op's stream: buf = the tensors, one after another.
Status packInto(Communicator& c, const at::Tensor& buf, const std::vector<at::Tensor>& ts) {
  return c.onStream([out = buf, views = flattened(ts)]() mutable { at::cat_out(out, views); });
}

// On the op's stream: each tensor = its slice of buf, back to back.
Status unpackFrom(Communicator& c, const at::Tensor& buf, const std::vector<at::Tensor>& ts) {
  return c.onStream([buf, ts] {
    int64_t off = 0;
    for (const at::Tensor& t : ts) {
      t.view({-1}).copy_(buf.narrow(0, off, t.numel()));
      off += t.numel();
    }
  });
}

// PREMUL_SUM: scales `t` in place on the op's stream, before the sum.
Status preScale(Communicator& c, const at::Tensor& t, const at::Tensor& factor) {
  if (!factor.defined()) {
    return Status::ok();
  }
  return c.onStream([t, factor] { t.mul_(factor); });
}

// PREMUL_SUM where the input must stay as it was (a reduce's non-root, a reduce_scatter's
// input): the scaled input in a temporary; `t` itself without a factor.
Result<at::Tensor> scaledInput(Communicator& c, Temps& temps, const at::Tensor& t, const at::Tensor& factor) {
  if (!factor.defined()) {
    return t;
  }
  at::Tensor buf = temps.flat(t, t.numel());
  RC_RETURN_IF_ERROR(c.onStream([buf, t, factor]() mutable { at::mul_out(buf, t.reshape({-1}), factor); }));
  return buf;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ResilientBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "broadcast"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, opts.rootRank, size_, "root");
  auto comm = commFor(tensors, site.op);
  at::Tensor t = tensors[0];
  Payload p = payload(t);
  int root = static_cast<int>(opts.rootRank);
  return enqueue(comm, OpType::BROADCAST, site.op, tensors, opts.timeout, !opts.asyncOp,
                 [t, p, root](Communicator& c, const Deadline& dl) { return c.broadcast(ptr(t), p.count, p.dt, root, dl); });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_reduce"};
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    return allreduceSparse(tensors, opts);  // as ProcessGroupGloo::allreduce does
  }
  checkSingle(site, tensors, "tensors");
  auto comm = commFor(tensors, site.op);
  at::Tensor t = tensors[0];
  DataType dt = toDataType(site, t.scalar_type());
  RedOp op = toRedOp(site, opts.reduceOp, t.scalar_type());
  at::Tensor factor = preMulFactor(opts.reduceOp, t);
  return enqueue(comm, OpType::ALLREDUCE, site.op, tensors, opts.timeout, !opts.asyncOp,
                 [t, dt, op, factor](Communicator& c, const Deadline& dl) -> Status {
                   RC_RETURN_IF_ERROR(preScale(c, t, factor));
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
  at::Tensor factor = preMulFactor(opts.reduceOp, tensors[0]);
  std::vector<at::Tensor> ts = tensors;
  Temps temps;
  return enqueue(comm, OpType::ALLREDUCE_COALESCED, site.op, tensors, opts.timeout, !opts.asyncOp,
                 [ts, dt, op, factor, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   int64_t total = 0;
                   for (const at::Tensor& t : ts) {
                     total += t.numel();
                   }
                   at::Tensor buf = temps.flat(ts[0], total);
                   RC_RETURN_IF_ERROR(packInto(c, buf, ts));
                   RC_RETURN_IF_ERROR(preScale(c, buf, factor));
                   RC_RETURN_IF_ERROR(c.allReduce(ptr(buf), buf.numel(), dt, op, dl));
                   return unpackFrom(c, buf, ts);
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
  at::Tensor factor = preMulFactor(opts.reduceOp, t);
  int root = static_cast<int>(opts.rootRank);
  Temps temps;
  return enqueue(comm, OpType::REDUCE, site.op, tensors, opts.timeout, !opts.asyncOp,
                 [t, dt, op, root, factor, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   at::Tensor src;
                   RC_ASSIGN_OR_RETURN(src, scaledInput(c, temps, t, factor));
                   RC_RETURN_IF_ERROR(c.reduce(ptr(src), t.numel(), dt, op, root, dl));
                   return factor.defined() && c.rank() == root ? unpackFrom(c, src, {t}) : Status::ok();
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
  Payload p = payload(in);
  int n = size_;
  Temps temps;
  return enqueue(comm, OpType::ALLGATHER, site.op, outs, opts.timeout, !opts.asyncOp,
                 [in, outs, p, n, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   at::Tensor buf = temps.flat(in, in.numel() * n);
                   RC_RETURN_IF_ERROR(c.allGather(ptr(in), ptr(buf), p.count, p.dt, dl));
                   return unpackFrom(c, buf, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions& opts) {
  // dist.all_gather_coalesced: inputs of any shapes (one dtype); outputs[r][i] receives rank r's
  // inputs[i]. One all_gather of the inputs packed back to back.
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_gather_coalesced"};
  checkTensors(site, inputs, "inputs");
  if (static_cast<int>(outputs.size()) != size_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "output must be a list of " + std::to_string(size_) +
                                    " lists of tensors (one per rank), got " + std::to_string(outputs.size()));
  }
  int64_t total = 0;
  for (const at::Tensor& t : inputs) {
    total += t.numel();
  }
  std::vector<at::Tensor> outs;
  for (size_t r = 0; r < outputs.size(); ++r) {
    checkTensors(site, outputs[r], "outputs");
    if (outputs[r].size() != inputs.size()) {
      C10_THROW_ERROR(ValueError, site.prefix() + "output list " + std::to_string(r) + " has " +
                                      std::to_string(outputs[r].size()) + " tensors, the input list " +
                                      std::to_string(inputs.size()));
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkSameDtype(site, outputs[r][i], inputs[i], "output", "input");
      if (outputs[r][i].numel() != inputs[i].numel()) {
        C10_THROW_ERROR(ValueError, site.prefix() + "output[" + std::to_string(r) + "][" + std::to_string(i) +
                                        "] has " + std::to_string(outputs[r][i].numel()) + " elements, input[" +
                                        std::to_string(i) + "] " + std::to_string(inputs[i].numel()));
      }
      outs.push_back(outputs[r][i]);
    }
  }
  auto comm = commFor(inputs, site.op);
  std::vector<at::Tensor> ins = inputs;
  const int n = size_;
  Temps temps;
  at::Tensor packed = temps.flat(ins[0], total);
  at::Tensor gathered = temps.flat(ins[0], total * n);
  Payload p = payload(packed);
  return enqueue(comm, OpType::ALLGATHER_COALESCED, site.op, outs, opts.timeout, !opts.asyncOp,
                 [ins, outs, packed, gathered, p, temps](Communicator& c, const Deadline& dl) -> Status {
                   RC_RETURN_IF_ERROR(packInto(c, packed, ins));
                   RC_RETURN_IF_ERROR(c.allGather(ptr(packed), ptr(gathered), p.count, p.dt, dl));
                   return unpackFrom(c, gathered, outs);
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
  Payload p = payload(in);
  return enqueue(comm, OpType::_ALLGATHER_BASE, site.op, {out}, opts.timeout, !opts.asyncOp,
                 [in, out, p](Communicator& c, const Deadline& dl) { return c.allGather(ptr(in), ptr(out), p.count, p.dt, dl); });
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
  std::vector<Payload> ps;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameDtype(site, outputs[i], inputs[i], "output", "input");
    if (outputs[i].numel() != inputs[i].numel() * size_) {
      C10_THROW_ERROR(ValueError, site.prefix() + "outputs[" + std::to_string(i) + "] must have world size x " +
                                      "inputs[" + std::to_string(i) + "] elements");
    }
    ps.push_back(payload(inputs[i]));
  }
  auto comm = commFor(inputs, site.op);
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return enqueue(comm, OpType::COALESCED, site.op, outs, opts.timeout, !opts.asyncOp,
                 [ins, outs, ps](Communicator& c, const Deadline& dl) -> Status {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     RC_RETURN_IF_ERROR(c.allGather(ptr(ins[i]), ptr(outs[i]), ps[i].count, ps[i].dt, dl));
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
  Payload p = payload(in);
  int n = size_;
  Temps temps;
  return enqueue(comm, OpType::GATHER, site.op, outs, opts.timeout, !opts.asyncOp,
                 [in, outs, p, root, n, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   at::Tensor buf = outs.empty() ? at::Tensor() : temps.flat(in, in.numel() * n);
                   RC_RETURN_IF_ERROR(c.gather(ptr(in), buf.defined() ? ptr(buf) : nullptr, p.count, p.dt, root, dl));
                   return outs.empty() ? Status::ok() : unpackFrom(c, buf, outs);
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
  Payload p = payload(out);
  int n = size_;
  Temps temps;
  return enqueue(comm, OpType::SCATTER, site.op, {out}, opts.timeout, !opts.asyncOp,
                 [ins, out, p, root, n, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   at::Tensor buf;
                   if (!ins.empty()) {
                     buf = temps.flat(out, out.numel() * n);
                     RC_RETURN_IF_ERROR(packInto(c, buf, ins));
                   }
                   return c.scatter(buf.defined() ? ptr(buf) : nullptr, ptr(out), p.count, p.dt, root, dl);
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
  at::Tensor factor = preMulFactor(opts.reduceOp, out);
  int n = size_;
  Temps temps;
  return enqueue(comm, OpType::REDUCE_SCATTER, site.op, {out}, opts.timeout, !opts.asyncOp,
                 [ins, out, dt, op, factor, n, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   at::Tensor buf = temps.flat(out, out.numel() * n);
                   RC_RETURN_IF_ERROR(packInto(c, buf, ins));
                   RC_RETURN_IF_ERROR(preScale(c, buf, factor));
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
  at::Tensor factor = preMulFactor(opts.reduceOp, in);
  Temps temps;
  return enqueue(comm, OpType::_REDUCE_SCATTER_BASE, site.op, {out}, opts.timeout, !opts.asyncOp,
                 [in, out, dt, op, factor, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   at::Tensor src;
                   RC_ASSIGN_OR_RETURN(src, scaledInput(c, temps, in, factor));
                   return c.reduceScatter(ptr(src), ptr(out), out.numel(), dt, op, dl);
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
  at::Tensor factor = preMulFactor(opts.reduceOp, inputs[0]);
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  Temps temps;
  return enqueue(comm, OpType::COALESCED, site.op, outs, opts.timeout, !opts.asyncOp,
                 [ins, outs, dt, op, factor, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   for (size_t i = 0; i < ins.size(); ++i) {
                     at::Tensor src;
                     RC_ASSIGN_OR_RETURN(src, scaledInput(c, temps, ins[i], factor));
                     RC_RETURN_IF_ERROR(c.reduceScatter(ptr(src), ptr(outs[i]), outs[i].numel(), dt, op, dl));
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
  // Counts and displacements in the payload's units (bytes for a dtype carried as bytes).
  const size_t unit = payload(input).perElement;
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
      displs->push_back(static_cast<size_t>(sum * rowElems) * unit);
      counts->push_back(static_cast<size_t>(v * rowElems) * unit);
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
  DataType dt = payload(in).dt;
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
  const size_t unit = payload(inputs[0]).perElement;
  std::vector<size_t> sc, sd, rc, rd;
  size_t so = 0;
  size_t ro = 0;
  for (int i = 0; i < size_; ++i) {
    sc.push_back(inputs[i].numel() * unit);
    sd.push_back(so * unit);
    so += inputs[i].numel();
    rc.push_back(outputs[i].numel() * unit);
    rd.push_back(ro * unit);
    ro += outputs[i].numel();
  }
  DataType dt = payload(inputs[0]).dt;
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  int64_t total = static_cast<int64_t>(ro);
  int64_t sent = static_cast<int64_t>(so);
  Temps temps;
  return enqueue(comm, OpType::ALLTOALL, site.op, outs, opts.timeout, !opts.asyncOp,
                 [ins, outs, dt, sc, sd, rc, rd, total, sent, temps](Communicator& c, const Deadline& dl) mutable -> Status {
                   at::Tensor sendBuf = temps.flat(ins[0], sent);
                   RC_RETURN_IF_ERROR(packInto(c, sendBuf, ins));
                   at::Tensor recvBuf = temps.flat(outs[0], total);
                   RC_RETURN_IF_ERROR(c.allToAll(ptr(sendBuf), sc, sd, ptr(recvBuf), rc, rd, dt, dl));
                   return unpackFrom(c, recvBuf, outs);
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
  const at::Tensor& t = tensors[0];
  return enqueueP2P(comm, OpType::SEND, site.op, t,
                    P2POp{P2POp::Kind::kSend, dstRank, ptr(t), t.nbytes(), static_cast<uint64_t>(tag)});
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "recv"};
  checkSingle(site, tensors, "tensors");
  checkRank(site, srcRank, size_, "source rank");
  if (srcRank == rank_) {
    C10_THROW_ERROR(ValueError, site.prefix() + "cannot receive from itself");
  }
  auto comm = commFor(tensors, site.op);
  const at::Tensor& t = tensors[0];
  return enqueueP2P(comm, OpType::RECV, site.op, t,
                    P2POp{P2POp::Kind::kRecv, srcRank, ptr(t), t.nbytes(), static_cast<uint64_t>(tag)});
}

// On the device communicator when the group has one (or emulates one), as ProcessGroupNCCL's
// barrier is a one-element all_reduce on the device; its wait() blocks the host.
c10::intrusive_ptr<c10d::Work> ResilientBackend::barrier(const c10d::BarrierOptions& opts) {
  auto body = [](Communicator& c, const Deadline& dl) { return c.barrier(dl); };
  std::shared_ptr<Communicator> device = emulate_ ? deviceCommFor(at::Device(at::kCPU), "barrier") : deviceComm();
  if (device) {
    return launchOnDevice(device, OpType::BARRIER, "barrier", {}, opts.timeout, body, /*hostWaits=*/true);
  }
  checkConfigured("barrier");
  return enqueue(cpuComm(), OpType::BARRIER, "barrier", {}, opts.timeout, !opts.asyncOp, body);
}

// Torch's recv with no src. On the TCP transport (host tensors); NCCL has no receive from any
// source (ProcessGroupNCCL refuses it too).
c10::intrusive_ptr<c10d::Work> ResilientBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "recv"};
  checkSingle(site, tensors, "tensors");
  auto comm = commFor(tensors, site.op);
  if (comm->streamOrdered()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "receiving from any source is not supported for " +
                                    tensors[0].device().str() + " tensors (NCCL has no such receive); pass src");
  }
  const at::Tensor& t = tensors[0];
  auto source = std::make_shared<std::atomic<int>>(-1);
  void* buf = ptr(t);
  size_t bytes = t.nbytes();
  auto work = enqueue(comm, OpType::RECVANYSOURCE, site.op, {t}, c10d::kUnsetTimeout, /*mayRunInline=*/false,
                      [buf, bytes, tag, source](Communicator& c, const Deadline& dl) {
                        int src = -1;
                        Status st = c.recvAny(buf, bytes, static_cast<uint64_t>(tag), dl, &src);
                        source->store(src);
                        return st;
                      });
  static_cast<ResilientWork*>(work.get())->setSourceRank(source);
  return work;
}

}  // namespace resilient_comm
