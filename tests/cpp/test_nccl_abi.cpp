// ABI conformance: our own NCCL declarations (transport/nccl/nccl_types.h, the signatures of
// nccl_api.h) against the real nccl.h of the nvidia-nccl wheel, compiled with stub CUDA headers
// (tests/cpp/abi_stub). Everything is checked at compile time: a mismatch does not build. CMake
// compiles this file only where it finds the wheel's header; tests/unit/test_cpp.py requires that it
// ran.
#include <nccl.h>

#include <cstddef>
#include <type_traits>

#include "check.h"
#include "transport/nccl/nccl_api.h"

namespace ours = resilient_comm::nccl;

namespace {

// Our type for each of the real header's.
template <typename T>
struct Real {
  using type = T;
};
template <>
struct Real<ours::ncclResult_t> {
  using type = ::ncclResult_t;
};
template <>
struct Real<ours::ncclDataType_t> {
  using type = ::ncclDataType_t;
};
template <>
struct Real<ours::ncclRedOp_t> {
  using type = ::ncclRedOp_t;
};
template <>
struct Real<ours::ncclUniqueId> {
  using type = ::ncclUniqueId;
};
template <>
struct Real<ours::ncclConfig_t> {
  using type = ::ncclConfig_t;  // ours is its leading fields, checked below
};
template <>
struct Real<ours::ncclComm> {
  using type = ::ncclComm;
};
template <>
struct Real<ours::CUstream_st> {
  using type = ::CUstream_st;
};
template <typename T>
struct Real<T*> {
  using type = typename Real<T>::type*;
};
template <typename T>
struct Real<const T> {
  using type = const typename Real<T>::type;
};
template <typename R, typename... A>
struct Real<R(A...)> {
  using type = typename Real<R>::type(typename Real<A>::type...);
};

// Every function of the API table has the real signature.
#define RC_NCCL_ABI(symbol, method, required, params, args)                                   \
  static_assert(std::is_same_v<Real<ours::sig::symbol>::type, decltype(::symbol)>,            \
                #symbol ": our signature differs from nccl.h's");
RC_NCCL_API(RC_NCCL_ABI)
#undef RC_NCCL_ABI
static_assert(std::is_same_v<Real<ours::sig::ncclGetVersion>::type, decltype(::ncclGetVersion)>);
static_assert(std::is_same_v<Real<ours::sig::ncclGetErrorString>::type, decltype(::ncclGetErrorString)>);
static_assert(std::is_same_v<Real<ours::sig::ncclGetLastError>::type, decltype(::ncclGetLastError)>);

// Sizes.
static_assert(sizeof(ours::ncclResult_t) == sizeof(::ncclResult_t));
static_assert(sizeof(ours::ncclDataType_t) == sizeof(::ncclDataType_t));
static_assert(sizeof(ours::ncclRedOp_t) == sizeof(::ncclRedOp_t));
static_assert(sizeof(ours::ncclUniqueId) == sizeof(::ncclUniqueId) && sizeof(::ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(ours::ncclComm_t) == sizeof(::ncclComm_t));
static_assert(sizeof(ours::cudaStream_t) == sizeof(::cudaStream_t));

// Every result code, and no more than NCCL has.
#define RC_EQ(a, b) (static_cast<int>(a) == static_cast<int>(b))
static_assert(RC_EQ(ours::ncclSuccess, ::ncclSuccess) && RC_EQ(ours::ncclUnhandledCudaError, ::ncclUnhandledCudaError) &&
              RC_EQ(ours::ncclSystemError, ::ncclSystemError) && RC_EQ(ours::ncclInternalError, ::ncclInternalError) &&
              RC_EQ(ours::ncclInvalidArgument, ::ncclInvalidArgument) && RC_EQ(ours::ncclInvalidUsage, ::ncclInvalidUsage) &&
              RC_EQ(ours::ncclRemoteError, ::ncclRemoteError) && RC_EQ(ours::ncclInProgress, ::ncclInProgress) &&
              RC_EQ(ours::ncclTimeout, ::ncclTimeout));
static_assert(static_cast<int>(ours::ncclTimeout) + 1 == static_cast<int>(::ncclNumResults), "a result code of nccl.h is missing from ours");

// Every data type.
static_assert(RC_EQ(ours::ncclInt8, ::ncclInt8) && RC_EQ(ours::ncclUint8, ::ncclUint8) && RC_EQ(ours::ncclInt32, ::ncclInt32) &&
              RC_EQ(ours::ncclUint32, ::ncclUint32) && RC_EQ(ours::ncclInt64, ::ncclInt64) && RC_EQ(ours::ncclUint64, ::ncclUint64) &&
              RC_EQ(ours::ncclFloat16, ::ncclFloat16) && RC_EQ(ours::ncclFloat32, ::ncclFloat32) &&
              RC_EQ(ours::ncclFloat64, ::ncclFloat64) && RC_EQ(ours::ncclBfloat16, ::ncclBfloat16) &&
              RC_EQ(ours::ncclFloat8e4m3, ::ncclFloat8e4m3) && RC_EQ(ours::ncclFloat8e5m2, ::ncclFloat8e5m2));
static_assert(static_cast<int>(ours::ncclFloat8e5m2) + 1 == static_cast<int>(::ncclNumTypes), "a data type of nccl.h is missing from ours");

// Every reduction op.
static_assert(RC_EQ(ours::ncclSum, ::ncclSum) && RC_EQ(ours::ncclProd, ::ncclProd) && RC_EQ(ours::ncclMax, ::ncclMax) &&
              RC_EQ(ours::ncclMin, ::ncclMin) && RC_EQ(ours::ncclAvg, ::ncclAvg) && RC_EQ(ours::ncclNumOps, ::ncclNumOps));

// Constants.
static_assert(ours::kNcclApiMagic == NCCL_API_MAGIC);
static_assert(ours::kNcclConfigUndefInt == NCCL_CONFIG_UNDEF_INT);
static_assert(ours::kNcclSplitNoColor == NCCL_SPLIT_NOCOLOR);
static_assert(ours::kNcclShrinkDefault == NCCL_SHRINK_DEFAULT && ours::kNcclShrinkAbort == NCCL_SHRINK_ABORT);
static_assert(ours::kNcclRevokeDefault == NCCL_REVOKE_DEFAULT);
static_assert(ours::ncclVersionCode(2, 8, 4) == NCCL_VERSION(2, 8, 4) &&
              ours::ncclVersionCode(2, 30, 0) == NCCL_VERSION(2, 30, 0) &&
              ours::ncclVersionCode(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH) == NCCL_VERSION_CODE);

// Our config is exactly the real one's leading fields (NCCL reads `size` bytes of it).
#define RC_SAME_FIELD(f)                                                                                   \
  static_assert(offsetof(ours::ncclConfig_t, f) == offsetof(::ncclConfig_t, f), "ncclConfig_t." #f " moved"); \
  static_assert(sizeof(ours::ncclConfig_t::f) == sizeof(::ncclConfig_t::f), "ncclConfig_t." #f " resized");
RC_SAME_FIELD(size)
RC_SAME_FIELD(magic)
RC_SAME_FIELD(version)
RC_SAME_FIELD(blocking)
RC_SAME_FIELD(cgaClusterSize)
RC_SAME_FIELD(minCTAs)
RC_SAME_FIELD(maxCTAs)
RC_SAME_FIELD(netName)
RC_SAME_FIELD(splitShare)
#undef RC_SAME_FIELD
static_assert(offsetof(ours::ncclConfig_t, splitShare) + sizeof(int) == offsetof(::ncclConfig_t, trafficClass),
              "our config's last field must end where the real one's next field begins");

}  // namespace

TEST(nccl_abi_matches_the_real_nccl_h) {
  // The checks above are static; this records that they were compiled in, against NCCL
  // NCCL_MAJOR.NCCL_MINOR.NCCL_PATCH.
  ours::ncclConfig_t c = ours::nonBlockingConfig();
  CHECK(c.size == offsetof(::ncclConfig_t, trafficClass) && c.blocking == 0) << c.size;
  CHECK(NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)) << "an old nccl.h: " << NCCL_VERSION_CODE;
}
