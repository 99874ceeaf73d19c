#pragma once
// Whether a tensor's data starts on a 16-byte boundary: the condition of the CUDA kernels'
// 16-byte vector loads and stores (kernels/logprobs.cu, swiglu.cu, rms_norm.cu, mla_rope.cu).
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {
inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0; }
/// t contiguous from a 16-byte boundary: t itself when it is, else a fresh copy (the caching
/// allocator's blocks start on 512-byte boundaries).
inline at::Tensor aligned_contiguous(const at::Tensor& t) {
  auto c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}
}  // namespace kiln::kernels
