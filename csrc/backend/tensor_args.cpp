#include "backend/tensor_args.h"

#include <c10/util/Exception.h>

#include <optional>

namespace resilient_comm {

std::string OpSite::prefix() const {
  return backend + " " + op + " on group '" + group + "' rank " + std::to_string(rank) + ": ";
}

namespace {

std::optional<DataType> knownType(at::ScalarType t) {
  switch (t) {
    case at::kChar:
      return DataType::kInt8;
    case at::kByte:
      return DataType::kUInt8;
    case at::kShort:
      return DataType::kInt16;
    case at::kInt:
      return DataType::kInt32;
    case at::kLong:
      return DataType::kInt64;
    case at::kHalf:
      return DataType::kFloat16;
    case at::kBFloat16:
      return DataType::kBFloat16;
    case at::kFloat:
      return DataType::kFloat32;
    case at::kDouble:
      return DataType::kFloat64;
    case at::kBool:
      return DataType::kBool;
    default:
      return std::nullopt;
  }
}

}  // namespace

DataType toDataType(const OpSite& site, at::ScalarType t) {
  std::optional<DataType> dt = knownType(t);
  if (!dt) {
    C10_THROW_ERROR(ValueError, site.prefix() + "unsupported dtype " + std::string(c10::toString(t)) +
                                    " for a reduction (supported: int8, uint8, int16, int32, int64, float16, "
                                    "bfloat16, float32, float64, bool; data movement takes any dtype)");
  }
  return *dt;
}

Payload payload(const at::Tensor& t) {
  std::optional<DataType> dt = knownType(t.scalar_type());
  if (dt) {
    return Payload{*dt, static_cast<size_t>(t.numel()), 1};
  }
  return Payload{DataType::kUInt8, t.nbytes(), static_cast<size_t>(t.element_size())};
}

at::Tensor preMulFactor(const c10d::ReduceOp& op, const at::Tensor& t) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM || !op.supplement_) {
    return at::Tensor();
  }
  const auto* s = static_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  if (s->tensor_factor.defined()) {
    return s->tensor_factor.to(t.device(), t.scalar_type()).reshape({});
  }
  return at::scalar_tensor(s->double_factor, t.options());
}

RedOp toRedOp(const OpSite& site, const c10d::ReduceOp& op, at::ScalarType t) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return RedOp::kSum;
    case c10d::ReduceOp::PRODUCT:
      return RedOp::kProd;
    case c10d::ReduceOp::MIN:
      return RedOp::kMin;
    case c10d::ReduceOp::MAX:
      return RedOp::kMax;
    case c10d::ReduceOp::AVG:
      if (!at::isFloatingType(t)) {
        C10_THROW_ERROR(ValueError, site.prefix() + "ReduceOp.AVG needs a floating-point tensor, got " +
                                        std::string(c10::toString(t)));
      }
      return RedOp::kAvg;
    case c10d::ReduceOp::PREMUL_SUM:
      if (!at::isFloatingType(t) || !op.supplement_) {
        C10_THROW_ERROR(ValueError, site.prefix() + "ReduceOp.PREMUL_SUM needs a floating-point tensor and a factor "
                                        "(torch.distributed._make_nccl_premul_sum), got " +
                                        std::string(c10::toString(t)));
      }
      return RedOp::kSum;
    default:
      C10_THROW_ERROR(ValueError,
                      site.prefix() + "unsupported reduce op (supported: SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM)");
  }
}

void checkTensors(const OpSite& site, const std::vector<at::Tensor>& ts, const char* what) {
  if (ts.empty()) {
    C10_THROW_ERROR(ValueError, site.prefix() + what + " is an empty tensor list");
  }
  const at::Tensor& first = ts.front();
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    std::string name = std::string(what) + "[" + std::to_string(i) + "]";
    if (!t.defined()) {
      C10_THROW_ERROR(ValueError, site.prefix() + name + " is undefined");
    }
    if (t.layout() != at::kStrided) {
      C10_THROW_ERROR(ValueError, site.prefix() + name + " is not a dense (strided) tensor");
    }
    if (!t.is_contiguous()) {
      C10_THROW_ERROR(ValueError, site.prefix() + name + " is not contiguous; call .contiguous() first");
    }
    if (t.device() != first.device()) {
      C10_THROW_ERROR(ValueError, site.prefix() + name + " is on " + t.device().str() + " but " + what +
                                      "[0] is on " + first.device().str());
    }
    if (t.scalar_type() != first.scalar_type()) {
      C10_THROW_ERROR(ValueError, site.prefix() + name + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                                      " but " + what + "[0] has " + std::string(c10::toString(first.scalar_type())));
    }
  }
}

void checkSameShape(const OpSite& site, const std::vector<at::Tensor>& ts, const char* what) {
  checkTensors(site, ts, what);
  for (size_t i = 1; i < ts.size(); ++i) {
    if (ts[i].sizes() != ts[0].sizes()) {
      C10_THROW_ERROR(ValueError, site.prefix() + what + "[" + std::to_string(i) + "] has shape " +
                                      c10::str(ts[i].sizes()) + " but " + what + "[0] has " + c10::str(ts[0].sizes()));
    }
  }
}

void checkSingle(const OpSite& site, const std::vector<at::Tensor>& ts, const char* what) {
  checkTensors(site, ts, what);
  if (ts.size() != 1) {
    C10_THROW_ERROR(ValueError, site.prefix() + "expects exactly one tensor in " + what + ", got " +
                                    std::to_string(ts.size()));
  }
}

void checkRank(const OpSite& site, int64_t r, int size, const char* what) {
  if (r < 0 || r >= size) {
    C10_THROW_ERROR(ValueError, site.prefix() + what + " " + std::to_string(r) + " is out of range for a group of " +
                                    std::to_string(size));
  }
}

void checkSameDtype(const OpSite& site, const at::Tensor& a, const at::Tensor& b, const char* aName,
                    const char* bName) {
  if (a.scalar_type() != b.scalar_type()) {
    C10_THROW_ERROR(ValueError, site.prefix() + aName + " has dtype " + std::string(c10::toString(a.scalar_type())) +
                                    " but " + bName + " has " + std::string(c10::toString(b.scalar_type())));
  }
  if (a.device() != b.device()) {
    C10_THROW_ERROR(ValueError, site.prefix() + aName + " is on " + a.device().str() + " but " + bName + " is on " +
                                    b.device().str());
  }
}

}  // namespace resilient_comm
