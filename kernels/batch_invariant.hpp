#pragma once
// Batch-invariant ops for the true on-policy mode (algorithm.true_on_policy, docs/gpu.md).
// Every output row is a function of that row's inputs (and the weights) alone, bit for bit,
// whatever the number of rows, the row's position in the batch, or how many other sequences
// or keys share the call: each reduction runs in a fixed order that depends only on the
// reduced length (sequential from index 0 in fixed-size blocks; no split-K, no atomics, the
// same instruction sequence for every row). So the trainer's packed forward and the rollout
// engine's prefill/decode produce the same bits for the same token.
// Source: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (He et al. 2025) and
// its batch_invariant_ops; slime/miles "true on-policy" (SGLang + FSDP).
//
// Legend: M rows, N output columns, K reduced dim, E groups (experts), T tokens, D hidden,
// Tq queries, Tk keys, H heads, Dqk/Dv head dims, B sequences.
// Dtypes: fp32 or bf16 inputs; every accumulation in fp32. Devices: CPU runs plain loops
// over the data (kernels/batch_invariant.cpp, parallel over rows/output elements only, never
// over a reduced dim); CUDA runs kernels/batch_invariant.cu where the build has it
// (kernels/batch_invariant_cuda.hpp: bf16 GEMMs and attention on tensor cores, docs/gpu.md).
// The values are not bitwise equal to the ordinary ops (a different summation order), only
// close (tests/kernels/batch_invariant_test.cpp states the tolerances). None of the ops is
// differentiable: model/blocks/batch_invariant.hpp wraps them for training.
// Every op throws c10::Error naming the bad shape, dtype or device.
#include <ATen/core/Tensor.h>

#include <optional>

namespace kiln::kernels {

/// y[m, n] = sum_k x[m, k] w[n, k] (torch linear without bias), fp32 accumulation.
/// x_MK [M, K], w_NK [N, K]: same dtype (fp32 or bf16), same device -> [M, N] in out_dtype
/// (default x's dtype; fp32 gives the unrounded accumulator).
at::Tensor bi_linear(const at::Tensor& x_MK, const at::Tensor& w_NK,
                     std::optional<at::ScalarType> out_dtype = std::nullopt);

/// Rows of x sorted by group (expert): counts_E [E] int64 (any device) rows per group,
/// sum = M; y[r] = x[r] . w[e(r)]^T (y[r, n] = sum_k x[r, k] w[e(r), n, k]), fp32 accumulation.
/// x_MK [M, K], w_ENK [E, N, K] (same dtype fp32/bf16, same device) -> [M, N] in x's dtype.
/// Throws when counts has the wrong length, a negative count, or does not sum to M (on CUDA
/// only for counts on the CPU: counts already on the GPU are not read back, and rows they do
/// not cover come out zero).
at::Tensor bi_grouped_linear(const at::Tensor& x_MK, const at::Tensor& counts_E, const at::Tensor& w_ENK);

/// The cached-attention form of kernels/attention.hpp's varlen_attention_cached: sequence b
/// has queries q[cu_q[b] : cu_q[b+1]] that are its LAST n_b positions, keys/values
/// k, v[cu_k[b] : cu_k[b+1]] (L_b of them, n_b <= L_b); query j sees keys 0 .. L_b - n_b + j.
/// Training is the case cu_q == cu_k.
///   out[t, h] = sum_j softmax_j(scale q[t, h] . k[j, h]) v[j, h]
/// q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] (one dtype, fp32/bf16) -> out [Tq, H, Dv]
/// in q's dtype; cu_q, cu_k [B+1] int64 or int32 (any device; the model's packed forward
/// passes its int32 device copy of cu_seqlens). fp32 math per (query, head): keys in
/// blocks of 64 from key 0, each score a dot in fixed order over Dqk, the online softmax
/// (Milakov & Gimelshein 2018; FlashAttention's rescaling) updated block by block in key
/// order; keys past the causal limit are never touched. CUDA, bf16, Dqk = Dv in {128, 256}:
/// QK^T and PV on tensor cores in the same fixed order, P rounded to bf16 before PV (as
/// FlashAttention); offsets already on the GPU are not read back (nor checked).
at::Tensor bi_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                        const at::Tensor& cu_k, double scale);

/// RMSNorm row by row, the formula of model/blocks/basic.hpp's RMSNorm (transformers'
/// Glm4MoeLiteRMSNorm): y = w * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype), the sum of
/// squares in fp32 in fixed order. x_TD [T, D], w_D [D] (same dtype fp32/bf16) -> [T, D] in
/// x's dtype.
at::Tensor bi_rms_norm(const at::Tensor& x_TD, const at::Tensor& w_D, double eps);

/// Per-row logsumexp: lse[m] = max_n x + log(sum_n exp(x[m, n] - max)), fp32, fixed order
/// (a row of all -inf gives -inf). x_MN [M, N] (fp32 or bf16) -> [M] fp32.
at::Tensor bi_logsumexp(const at::Tensor& x_MN);

}  // namespace kiln::kernels
