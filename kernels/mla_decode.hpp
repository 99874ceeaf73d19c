#pragma once
// Absorbed MLA decode attention over a paged latent cache (DeepSeek-V2 arXiv:2405.04434 §2.1.2
// weight absorption; the split-context online softmax of FlashDecoding, Dao et al. 2023): one
// new token per sequence attends to its first `lengths[b]` cached entries, each read once, in
// place, from the sequence's pages, all heads of the sequence sharing every load (MQA-like:
// the latent is one key/value shared by the heads).
//
//   s[b, h, p] = scale * (q_latent[b, h, :] . latent[b, p, :] + q_rope[b, h, :] . k_rope[b, p, :])
//   out[b, h, :] = sum_p softmax_p(s[b, h, :]) * latent[b, p, :]           over p < lengths[b]
//
// where cache row block_table[b, p / Z] * Z + p % Z holds position p's entry [latent C | k_rope R].
// The value absorption (kv_b's value half) and o_proj stay with the caller.
//
// Legend: B sequences, H heads, C latent width (kv_lora_rank), R rope width
// (qk_rope_head_dim), G pages, Z page size (tokens), W pages per row of the block table.
// Shapes and dtypes: q_latent [B, H, C] and q_rope [B, H, R] in the cache's dtype; cache
// [G, Z, C+R] (C+R columns contiguous); block_table [B, W] int64 page ids (entries past a
// sequence's pages are never read); lengths [B] int64 in [1, W*Z]; -> [B, H, C] in the cache's
// dtype. scale: the softmax scale (1/sqrt(qk_nope + qk_rope) for GLM).
//
// CUDA (kernels/mla_decode.cu, when mla_decode_kernel_supports()): bf16 tensor-core products
// (mma.sync m16n8k16) accumulated in fp32, the softmax in fp32 with the probabilities rounded to
// bf16 for the value product (as FlashAttention does); the context is split into a fixed
// number of chunks per sequence chosen from the static shapes (B, W*Z and the device's SM
// count), combined by a second kernel; no host sync and no allocation that depends on the
// data, so it can be captured in a CUDA graph. Elsewhere the LibTorch reference below.
// Throws c10::Error on shapes, dtypes or devices that disagree, naming them.
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

/// -> [B, H, C]. The CUDA kernel when supported, else the reference.
at::Tensor mla_decode_attention(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
                                const at::Tensor& block_table, const at::Tensor& lengths, double scale);
/// LibTorch reference, any device: gathers every sequence's W*Z entries (masked past its
/// length) and computes in fp32; the result rounded to the cache's dtype.
at::Tensor mla_decode_attention_ref(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
                                    const at::Tensor& block_table, const at::Tensor& lengths, double scale);
/// Whether the CUDA kernel takes these inputs: a CUDA build, CUDA tensors, bf16, H <= 32, and
/// (C, R) one of the compiled widths: (512, 64) (GLM-4.7-Flash, DeepSeek-V2/V3) and (32, 8)
/// (the debug flavor).
bool mla_decode_kernel_supports(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache);

}  // namespace kiln::kernels
