#pragma once
// Host entry points of kernels/rms_norm.cu (CUDA builds only). x [R, D] may be row-strided (unit
// column stride; the warp kernels read rows on 16-byte boundaries in place, else x is copied);
// w, y, rstd, r, s, dy, dx and dres contiguous on 16-byte boundaries (kernels/rms_norm.cpp
// makes them so).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// r, s (both or neither; [R, D] like x): y = norm(s) with s = x + r (rounded to x's dtype, as
/// at::add) written by the same pass.
void rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y, at::Tensor& rstd,
                      const at::Tensor* r = nullptr, at::Tensor* s = nullptr);
/// dres ([R, D] like dy, or null): dx = (the norm's dx, rounded) + dres, rounded (autograd's sum).
void rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                       at::Tensor& dx, at::Tensor& dw_fp32, const at::Tensor* dres = nullptr);
}  // namespace kiln::kernels::cuda
