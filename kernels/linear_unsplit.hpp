#pragma once
// y = x w^T with each output element summed over K in one pass by one CTA: no split-K.
//
// Why: cuBLAS's heuristics split the reduction over K (split-K) for GEMMs of few rows and a
// long K, and the split changes the order in which a row's products are added. On the H200
// that is how a row of torch.mm's result comes to depend on how many rows share the call, at
// GLM-4.7-Flash's shapes (tests/bench/probe_batch_invariance.py: o_proj [2048 x 5120] splits at
// M < 256, the dense layer's down projection [2048 x 10240] at M < 1024, the router's fp32
// [64 x 2048] at every M; the other bf16 projections, torch._grouped_mm and FlashAttention
// varlen give the same bits at every M). A
// rollout decode step runs those GEMMs at M = its batch, the trainer at M = its micro-batch's
// tokens: with the split, a decoded token's hidden state differs from the trainer's in the last
// bit of every o_proj output, and its log-prob by ~5e-3 (docs/benchmarks.md).
//
// CUDA bf16/fp16/fp32: cuBLASLt (fp32 accumulation; fp32 inputs in full fp32, CUBLAS_COMPUTE_32F, never
// TF32) with the heuristic's reduction schemes masked to
// CUBLASLT_REDUCTION_SCHEME_NONE (NVIDIA's recommended way to rule out split-K:
// CUDALibrarySamples issue 243; vLLM's batch-invariant mode on Hopper limits the workspace to
// the same end), no workspace, the algorithm chosen once per shape and alignment and cached.
// Elsewhere (CPU, other dtypes): at::linear (CPU GEMMs do not split K by batch size).
//
// Legend: M rows, K reduced dim, N output columns.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

/// x_MK [M, K] (rows with unit column stride; any row stride >= K), w_NK [N, K] contiguous, one
/// dtype and device -> y [M, N] contiguous in x's dtype, y[m, n] = sum_k x[m, k] w[n, k].
/// Throws c10::Error naming the shapes, dtypes or devices when they do not fit, and naming
/// cuBLASLt's status when it finds no algorithm without split-K or fails to run.
at::Tensor linear_unsplit(const at::Tensor& x_MK, const at::Tensor& w_NK);

/// out_MGN[m, g, :] = x[m] w[g]^T for the G groups of w_GNK [G, N, K], written into out_MGN [M, G,
/// N] in place: any layout with a unit last stride; where its group stride and row stride are
/// 16-byte multiples and its groups do not overlap (group stride >= N, row stride >= (G - 1)
/// group strides + N), one grouped cuBLASLt call (strided batches, x shared), else (or where
/// cuBLASLt has no grouped algorithm without split-K) linear_unsplit of the stacked [G N, K]
/// weight copied in. Each element is the same unsplit sum
/// over K as linear_unsplit's of the stacked weight: e.g. MLA's keys written straight into the
/// per-head slots of a wider [M, H, N+R] tensor (kernels/mla_rope.hpp). x_MK as linear_unsplit's;
/// one dtype and device. Throws c10::Error naming the shapes, dtypes or devices that do not fit,
/// and cuBLASLt's status as linear_unsplit does.
void linear_unsplit_into_groups(const at::Tensor& x_MK, const at::Tensor& w_GNK, const at::Tensor& out_MGN);

/// Whether linear_unsplit runs cuBLASLt for these inputs (CUDA build, CUDA bf16/fp16 with K and N
/// multiples of 8, or fp32 with K and N multiples of 4) rather than at::linear.
bool linear_unsplit_uses_cublaslt(const at::Tensor& x_MK, const at::Tensor& w_NK);

}  // namespace kiln::kernels
