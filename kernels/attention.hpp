#pragma once
// Causal attention over packed documents ("varlen"): every token attends to the tokens of its
// own document up to itself, never across documents.
//   out[t, h] = softmax_j(scale * q[t, h] . k[j, h]) v[j, h],  j in doc(t), j <= t
// Shapes: q [T, H, Dqk], k [T, H, Dqk], v [T, H, Dv] -> out [T, H, Dv]; cu_seqlens [B+1] int64
// (document starts, cu_seqlens[0] = 0, cu_seqlens[B] = T), on any device.
// CUDA tensors in bf16/fp16 with Dqk, Dv <= 256 run ATen's FlashAttention-2 varlen kernels
// (at::_flash_attention_forward/_backward, Dao 2023, arXiv:2307.08691) in one launch for the
// whole pack; Dv < Dqk is zero-padded to Dqk (the padding's output columns are dropped), which
// FlashAttention needs. Everything else (CPU, fp32, wider heads) runs the LibTorch reference:
// scaled_dot_product_attention once per document. Differentiable in q, k, v either way.
// Throws c10::Error on shape mismatch.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

/// The dispatching, differentiable op. max_seqlen: the longest document (0: computed here,
/// one host read of cu_seqlens).
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                            double scale, int64_t max_seqlen = 0);
/// LibTorch reference, any device and dtype.
at::Tensor varlen_attention_ref(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_seqlens, double scale);

/// Incremental form (rollout with a cache): sequence b has queries q[cu_q[b] : cu_q[b+1]] that
/// are its LAST (cu_q[b+1] - cu_q[b]) positions, and keys/values k, v[cu_k[b] : cu_k[b+1]] for
/// all its positions; causal, aligned at the end (query j of n sees keys 0 .. L - n + j).
/// q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] -> [Tq, H, Dv]. Inference only (no autograd
/// on the CUDA path). Same dispatch as varlen_attention: one FlashAttention-2 varlen launch on
/// CUDA bf16/fp16 (so rollout runs the training kernel), per-sequence masked SDPA elsewhere.
at::Tensor varlen_attention_cached(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, int64_t max_q,
                                   int64_t max_k);
at::Tensor varlen_attention_cached_ref(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_q, const at::Tensor& cu_k, double scale);
/// True when varlen_attention would take the FlashAttention path for these inputs.
bool varlen_attention_uses_flash(const at::Tensor& q, const at::Tensor& v);

}  // namespace kiln::kernels
