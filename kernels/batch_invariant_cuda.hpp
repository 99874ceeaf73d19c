#pragma once
// Host entry points of kernels/batch_invariant.cu (CUDA builds only): the CUDA side of the
// batch-invariant ops of kernels/batch_invariant.hpp, which documents the formulas, shapes and
// dtypes and checks them before calling these (so these check only what the kernels add).
// Each returns a fresh tensor on the inputs' device, launched on the current stream.
//
// Invariance: every output element is computed by one fixed chain of operations that depends
// on the reduced length alone (K, Dqk/keys, D, N), never on the number of rows, the row's
// position, the tile or the grid:
//   bi_linear_cuda / bi_grouped_linear_cuda, bf16 with K % 8 == 0: tensor cores (mma.sync
//     m16n8k16, fp32 accumulate), one accumulator per element fed the 16-wide k slices in
//     increasing k; no split-K, no atomics. The CTA tile may differ with M (a smaller one for
//     decode-sized M) because the tile does not enter an element's chain.
//   fp32 (or K % 8 != 0): CUDA cores, one fmaf per k in increasing k.
//   bi_attention_cuda: per (query, head) the online softmax steps over 64-key blocks from key
//     0; bf16 with Dqk = Dv in {128, 256}: scores and P V on tensor cores (mma.sync chains over
//     Dqk and over the keys in order, P rounded to bf16 as FlashAttention does); otherwise fp32
//     SIMT fmaf chains. Keys past the query's causal limit never change its result.
//   bi_rms_norm_cuda: one warp per row; bi_logsumexp_cuda: one CTA per row (fixed lanes, fixed
//     tree).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {

/// x [M, K], w [N, K] (same dtype fp32/bf16, contiguous not required) -> [M, N] in out_dtype
/// (fp32 or bf16).
at::Tensor bi_linear_cuda(const at::Tensor& x, const at::Tensor& w, at::ScalarType out_dtype);

/// x [M, K] sorted by group, counts [E] (int32/int64, any device; when on the GPU the sum is
/// not read back: rows past M are ignored and rows not covered are zero), w [E, N, K] -> [M, N]
/// in x's dtype.
at::Tensor bi_grouped_linear_cuda(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w);

/// q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] (one dtype fp32/bf16), cu_q, cu_k [B+1]
/// (int32/int64, any device) -> [Tq, H, Dv] in q's dtype. Dv <= 256 (throws otherwise).
at::Tensor bi_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                             const at::Tensor& cu_k, double scale);

/// x [T, D], w [D] (same dtype fp32/bf16) -> [T, D] in x's dtype.
at::Tensor bi_rms_norm_cuda(const at::Tensor& x, const at::Tensor& w, double eps);

/// x [M, N] (fp32/bf16) -> [M] fp32.
at::Tensor bi_logsumexp_cuda(const at::Tensor& x);

}  // namespace kiln::kernels::cuda
