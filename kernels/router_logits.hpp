#pragma once
// The MoE router's logits in fp32 from bf16 operands: y = x w^T with every output summed over K
// in order, one fp32 add of an exact product per k, whatever the number of rows.
//
// Legend: M tokens (rows), K hidden width (reduced), N routed experts (columns).
//
//   y[m, n] = (...((0 + x[m, 0] w[n, 0]) + x[m, 1] w[n, 1]) + ...) + x[m, K-1] w[n, K-1]
//
// in fp32, k = 0 .. K-1 in that order: the value of fp32 linear over the operands' fp32 casts
// (transformers' Glm4MoeLiteTopkRouter: F.linear(x.float(), w.float()); DeepSeek-V3's router,
// arXiv:2412.19437), summed in one fixed order. A bf16 x bf16 product is exact in fp32 (8 + 8
// significant bits) within fp32's normal range, so each step rounds only the sum, and a fused
// multiply-add gives the same bits as a product then an add. The order depends on k only: a token's logits are the same bits
// in a decode step of one row and in the trainer's micro-batch of thousands (the property
// kernels/linear_unsplit.hpp gets from cuBLASLt without split-K).
// Why a kernel: at GLM-4.7-Flash's router ([64, 2048]) cuBLASLt's fp32 GEMM without split-K runs
// on the CUDA cores in 64 x 64 tiles: 152 us at 8192 rows with the fp32 casts of the operands
// (356 us a layer in the traced 4-layer training step on the H100, beside the shared experts'
// GEMMs; docs/benchmarks.md). Here (kernels/router_logits.cu) x and w are read as bf16, widened
// in shared memory, and each thread keeps a 4 x 4, 2 x 2 or 1 x 1 block of outputs (by M) over
// the whole of K: 86 us at 8192 rows, 33 us at 1-256 (kiln_bench_router_logits).
// CUDA: x [M, K] bf16 with unit column stride, a row stride and start that keep rows on 16-byte
// boundaries; w [N, K] bf16 contiguous and aligned; K a multiple of 8; M, K < 2^31 - 64, N <=
// 65535 x 16 (the grid's second dimension). Elsewhere (CPU, other dtypes or layouts) the reference:
// at::linear over the fp32 casts (summed in its own order: within fp32 rounding of this, not its
// bits). Throws c10::Error naming the shapes, dtypes or devices that do not fit.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

/// x [M, K], w [N, K] (one dtype and device) -> y [M, N] fp32 contiguous. Not differentiable
/// itself (model/blocks/basic.cpp's unsplit_linear_fp32 wraps it with its backward).
at::Tensor router_logits(const at::Tensor& x_MK, const at::Tensor& w_NK);
/// The reference: at::linear(x.float(), w.float()), any device and dtype.
at::Tensor router_logits_ref(const at::Tensor& x_MK, const at::Tensor& w_NK);
/// True when router_logits runs the kernel for these inputs (the CUDA conditions above).
bool router_logits_uses_kernel(const at::Tensor& x_MK, const at::Tensor& w_NK);

}  // namespace kiln::kernels
