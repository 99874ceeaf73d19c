#pragma once
// Each row of a matrix times its own fp32 factor, the product rounded once to the output's dtype:
//
//   out[n, d] = round_out(float(x[n, d]) * a[n])      (fp32 product, round to nearest even)
//
// Legend: N rows, D columns. The bits of ATen's mixed-dtype `at::mul_out(out, x, a.unsqueeze(1))`
// (TensorIterator computes in the promoted dtype, fp32, then casts to out's dtype); the reference
// below is that call. Why a kernel: the log-prob head's backward scales [N, D] rows twice a chunk
// (kernels/lm_head.cpp: the hidden rows by -g/S before the weight's gradient, the input
// gradient's fp32 GEMM result by the same factors), and ATen's mixed-dtype path runs them on its
// casting element-wise kernel: 75 us each at 8192 x 2048 on the H100, about 3x their bytes at the
// copy rate (docs/benchmarks.md).
// CUDA kernel: x bf16, fp16 or fp32 and out bf16, fp16 or fp32, both contiguous [N, D] on 16-byte
// boundaries with D a multiple of 8; a fp32 [N] contiguous; one device. Elsewhere the reference
// (floating dtypes). out may be x itself (in place), not a partial overlap of it, nor overlap a.
// Throws c10::Error naming the shapes, dtypes or devices that do not fit, and on such overlaps.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

/// out [N, D] (written) = x [N, D] * a [N] per row; out's dtype chosen by the caller.
void scale_rows_out(at::Tensor& out_ND, const at::Tensor& x_ND, const at::Tensor& a_N);
/// The reference: at::mul_out(out, x, a.unsqueeze(1)), any device, floating dtypes.
void scale_rows_out_ref(at::Tensor& out_ND, const at::Tensor& x_ND, const at::Tensor& a_N);
/// True when scale_rows_out runs the kernel for these tensors (the CUDA conditions above).
bool scale_rows_uses_kernel(const at::Tensor& out_ND, const at::Tensor& x_ND, const at::Tensor& a_N);

}  // namespace kiln::kernels
