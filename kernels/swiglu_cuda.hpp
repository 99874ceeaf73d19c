#pragma once
// Host entry points of kernels/swiglu.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// gu [M, 2F] bf16 or fp16 contiguous, F % 8 == 0 -> out [M, F] (gu's dtype, contiguous).
void swiglu_packed_forward(const at::Tensor& gu, at::Tensor& out);
/// gu [M, 2F], dy [M, F] (gu's dtype, contiguous) -> dgu [M, 2F] (contiguous).
void swiglu_packed_backward(const at::Tensor& gu, const at::Tensor& dy, at::Tensor& dgu);
/// gate, up [M, F] (gate's dtype, contiguous rows, row strides and data on 16-byte boundaries),
/// F % 8 == 0 -> out [M, F] contiguous.
void swiglu_pair_forward(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out);
/// gate, up, dy [M, F] as above -> dgate, dup [M, F] contiguous; act (if given, [M, F]
/// contiguous): the forward's activation, swiglu_pair_forward's bits, in the same pass.
void swiglu_pair_backward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dy, at::Tensor& dgate,
                          at::Tensor& dup, at::Tensor* act = nullptr);
/// gu [M, 2F], h [M, F] (gu's dtype, contiguous), w_row [M] fp32 -> dgu [M, 2F], act_w [M, F],
/// dw_row [M] fp32 (kernels::swiglu_routed_backward).
void swiglu_routed_backward(const at::Tensor& gu, const at::Tensor& h, const at::Tensor& w_row, at::Tensor& dgu,
                            at::Tensor& act_w, at::Tensor& dw_row);
}  // namespace kiln::kernels::cuda
