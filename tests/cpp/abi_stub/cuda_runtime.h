// The few CUDA runtime declarations the real nccl.h needs, for tests/cpp/test_nccl_abi.cpp only:
// it compiles our NCCL declarations against the real header on a machine without CUDA.
#pragma once
#include <stddef.h>
#define CUDART_VERSION 12080
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
