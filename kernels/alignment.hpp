#pragma once
// Whether a tensor's data starts on a 16-byte boundary: the condition of the CUDA kernels'
// 16-byte vector loads and stores (kernels/logprobs.cu, swiglu.cu, rms_norm.cu, mla_rope.cu).
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {
inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0; }
/// t [R, C] read as rows by the 16-byte vector kernels without a copy: t's start on a 16-byte
/// boundary, unit column stride (unless C <= 1), and a row stride of at least C whose byte size is
/// a multiple of 16 (unless R <= 1), so every row starts on a 16-byte boundary too.
inline bool rows_aligned16(const at::Tensor& t) {
  if (t.dim() != 2 || !aligned16(t)) return false;
  if (t.size(1) > 1 && t.stride(1) != 1) return false;
  return t.size(0) <= 1 || (t.stride(0) >= t.size(1) && (t.stride(0) * int64_t(t.element_size())) % 16 == 0);
}
/// t contiguous from a 16-byte boundary: t itself when it is, else a fresh copy (the caching
/// allocator's blocks start on 512-byte boundaries).
inline at::Tensor aligned_contiguous(const at::Tensor& t) {
  auto c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}
}  // namespace kiln::kernels
