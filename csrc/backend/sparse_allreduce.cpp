// all_reduce of a sparse COO tensor (SUM), as ProcessGroupGloo does it, on host communicators:
// every rank's coalesced indices and values are all-gathered (padded to the largest nnz), then
// concatenated in rank order and coalesced, which sums the duplicates. Every rank computes the
// same result from the same bytes, so the results are bitwise identical; it is written back
// into the input (copy_ resizes a sparse tensor), as gloo writes it.
//
// Ranks whose tensors disagree in shape or sparse/dense split fail alike with an error naming
// both shapes (every rank checks every rank's description before moving any data).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "backend/resilient_backend.h"
#include "backend/tensor_args.h"
#include "common/check.h"

namespace resilient_comm {

namespace {

// One rank's description: nnz, sparse_dim, dense_dim, ndim, then the sizes.
constexpr int64_t kMaxDims = 24;
constexpr int64_t kMeta = 4 + kMaxDims;

std::string shapeOf(const int64_t* m) {
  std::string s = "[";
  for (int64_t d = 0; d < m[3]; ++d) {
    s += (d == 0 ? "" : ", ") + std::to_string(m[4 + d]);
  }
  return s + "] (sparse_dim " + std::to_string(m[1]) + ")";
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ResilientBackend::allreduceSparse(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceOptions& opts) {
  OpSite site{opts_.backendName, opts_.groupName, rank_, "all_reduce"};
  if (tensors.size() != 1 || !tensors[0].defined()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "expects exactly one defined tensor");
  }
  at::Tensor t = tensors[0];
  if (t.layout() != at::kSparse) {
    C10_THROW_ERROR(ValueError, site.prefix() + "tensors[0] has layout " + c10::str(t.layout()) +
                                    "; sparse all_reduce takes COO tensors (to_sparse())");
  }
  if (opts.reduceOp != c10d::ReduceOp::SUM) {
    C10_THROW_ERROR(ValueError, site.prefix() + "sparse tensors reduce with SUM only, as on gloo");
  }
  if (t.dim() > kMaxDims) {
    C10_THROW_ERROR(ValueError, site.prefix() + "a sparse tensor of " + std::to_string(t.dim()) +
                                    " dimensions; at most " + std::to_string(kMaxDims));
  }
  auto comm = commFor({t._values()}, site.op);
  if (comm->streamOrdered()) {
    C10_THROW_ERROR(ValueError, site.prefix() + "sparse all_reduce runs on host (CPU) tensors only");
  }
  const DataType dt = toDataType(site, t.scalar_type());
  return enqueue(comm, c10d::OpType::ALLREDUCE, site.op, tensors, opts.timeout, !opts.asyncOp,
                 [t, dt](Communicator& c, const Deadline& dl) mutable -> Status {
                   const int64_t n = c.size();
                   at::Tensor in = t.coalesce();
                   const int64_t nnz = in._nnz();
                   const int64_t sparseDim = in.sparse_dim();
                   at::Tensor meta = at::zeros({kMeta}, at::kLong);
                   int64_t* m = meta.data_ptr<int64_t>();
                   m[0] = nnz;
                   m[1] = sparseDim;
                   m[2] = in.dense_dim();
                   m[3] = in.dim();
                   for (int64_t d = 0; d < in.dim(); ++d) {
                     m[4 + d] = in.size(d);
                   }
                   at::Tensor metas = at::empty({n, kMeta}, at::kLong);
                   RC_RETURN_IF_ERROR(c.allGather(m, metas.data_ptr(), kMeta, DataType::kInt64, dl));
                   const int64_t* all = metas.data_ptr<int64_t>();
                   int64_t maxNnz = 0;
                   for (int64_t r = 0; r < n; ++r) {
                     const int64_t* o = all + r * kMeta;
                     if (!std::equal(o + 1, o + kMeta, m + 1)) {
                       return Status(StatusCode::kInvalidArgument,
                                     "sparse all_reduce: rank " + std::to_string(r) + "'s tensor is " + shapeOf(o) +
                                         ", rank " + std::to_string(c.rank()) + "'s " + shapeOf(m) +
                                         "; every rank must pass the same shape");
                     }
                     maxNnz = std::max(maxNnz, o[0]);
                   }
                   at::Tensor idx = at::zeros({sparseDim, maxNnz}, at::kLong);
                   idx.narrow(1, 0, nnz).copy_(in._indices());
                   at::Tensor allIdx = at::empty({n, sparseDim, maxNnz}, at::kLong);
                   RC_RETURN_IF_ERROR(
                       c.allGather(idx.data_ptr(), allIdx.data_ptr(), idx.numel(), DataType::kInt64, dl));
                   std::vector<int64_t> valShape = in._values().sizes().vec();
                   valShape[0] = maxNnz;
                   at::Tensor val = at::zeros(valShape, in._values().options());
                   val.narrow(0, 0, nnz).copy_(in._values());
                   valShape.insert(valShape.begin(), n);
                   at::Tensor allVal = at::empty(valShape, val.options());
                   RC_RETURN_IF_ERROR(c.allGather(val.numel() == 0 ? nullptr : val.data_ptr(),
                                                  allVal.numel() == 0 ? nullptr : allVal.data_ptr(), val.numel(), dt,
                                                  dl));
                   std::vector<at::Tensor> idxs;
                   std::vector<at::Tensor> vals;
                   for (int64_t r = 0; r < n; ++r) {
                     const int64_t k = all[r * kMeta];
                     idxs.push_back(allIdx[r].narrow(1, 0, k));
                     vals.push_back(allVal[r].narrow(0, 0, k));
                   }
                   at::Tensor out =
                       at::sparse_coo_tensor(at::cat(idxs, 1), at::cat(vals, 0), in.sizes(), in.options()).coalesce();
                   t.copy_(out);
                   return Status::ok();
                 });
}

c10::intrusive_ptr<c10d::Work> ResilientBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceOptions& opts) {
  return allreduceSparse(tensors, opts);
}

}  // namespace resilient_comm
