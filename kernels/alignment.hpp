#pragma once
// Whether a tensor's data starts on a 16-byte boundary: the condition of the CUDA kernels'
// 16-byte vector loads and stores (kernels/logprobs.cu, kernels/swiglu.cu).
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {
inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0; }
}  // namespace kiln::kernels
