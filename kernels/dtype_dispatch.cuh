#pragma once
// Host side of the .cu files: calls f with a value of the CUDA storage type for a floating dtype
// (float, __nv_bfloat16, __half), so a kernel template is instantiated once per dtype. Throws
// c10::Error naming `op` and the dtype for any other.
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kiln::kernels::cuda {

template <class F>
void dispatch_floating(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    case at::kHalf: f(__half{}); break;
    default: TORCH_CHECK(false, op, ": dtype ", t, " not supported on CUDA (fp32, bf16, fp16)");
  }
}

}  // namespace kiln::kernels::cuda
