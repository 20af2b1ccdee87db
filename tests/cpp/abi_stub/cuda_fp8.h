// See cuda_runtime.h: nothing of it is used by nccl.h.
#pragma once
