#pragma once
// fp32 <-> storage dtype conversions shared by the .cu files: to_f widens a float, bf16 or fp16
// value exactly; from_f rounds an fp32 value to the storage dtype, to nearest even (the
// rounding of LibTorch's casts). Device code only; include from .cu files.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kiln::kernels::cuda {

template <class T>
__device__ __forceinline__ float to_f(T v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_f(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f(__half v) {
  return __half2float(v);
}
template <class T>
__device__ __forceinline__ T from_f(float v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f(float v) {
  return __float2half_rn(v);
}

}  // namespace kiln::kernels::cuda
