#pragma once
// Fused per-token log-prob (and entropy) over the vocabulary, for one chunk of rows whose
// logits the caller produced with one GEMM (kiln::model::token_logprobs drives it chunk by
// chunk, so [T, V] is never held; the logits stay in the GEMM's dtype, bf16 on the GPU, and
// are read once per pass in fp32 registers).
//   forward:  lse = logsumexp(z), logp = z[target] - lse (0 where target < 0),
//             with_entropy: mean_z = E_p[z], entropy = lse - mean_z          (all fp32 [n])
//   backward: dz = g_lp (onehot(target) - p) - g_ent p (z - mean_z),  p = exp(z - lse)
//             (d logp/dz and dH/dz; g_lp is 0 where target < 0)            -> [n, V] in z's dtype
// z: [n, V] (row-major, fp32/bf16/fp16), targets: [n] int64. On CUDA, fp32 or 16-bit logits
// run kernels/logprobs.cu (one block per row: one pass with an online max/sum for the forward,
// optionally writing a 16-bit copy of z for the backward; one elementwise pass for the
// backward, writing dz in the 16-bit model dtype); everything else the LibTorch reference.
// Throws c10::Error on shape mismatch.
#include <ATen/core/Tensor.h>

#include <tuple>

namespace kiln::kernels {

/// Statistics of the kept (rounded) logits: the backward from kept logits must use the
/// softmax of those very values (lse [n], mean_z [n] when with_entropy), so that its
/// gradient is exactly that of log_softmax(kept), as a bf16-logit model's would be.
struct KeptStats {
  at::Tensor lse, mean_z;
};
/// -> (logp [n], lse [n], entropy [n] or empty, mean_z [n] or empty), fp32. keep: optional
/// [n, V] 16-bit tensor that receives z rounded to its dtype; then *kept gets its statistics.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_chunk_forward(const at::Tensor& z,
                                                                                 const at::Tensor& targets,
                                                                                 bool with_entropy,
                                                                                 const at::Tensor& keep = {},
                                                                                 KeptStats* kept = nullptr);
/// g_lp [n] fp32 (already zero where target < 0); g_ent [n] fp32 or undefined (no entropy
/// gradient); mean_z needed only with g_ent. -> dz [n, V] in out_dtype.
/// `out` (optional, [n, V] contiguous in out_dtype): dz is written there and returned. It may
/// be z itself when z has out_dtype: dz then replaces z in place (every element is read before
/// it is written, by the same thread on CUDA), so the backward from kept logits needs no second
/// [n, V] buffer.
at::Tensor logprob_chunk_backward(const at::Tensor& z, const at::Tensor& targets, const at::Tensor& lse,
                                  const at::Tensor& g_lp, const at::Tensor& g_ent, const at::Tensor& mean_z,
                                  at::ScalarType out_dtype, const at::Tensor& out = {});

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_chunk_forward_ref(const at::Tensor& z,
                                                                                     const at::Tensor& targets,
                                                                                     bool with_entropy,
                                                                                     const at::Tensor& keep = {},
                                                                                     KeptStats* kept = nullptr);
at::Tensor logprob_chunk_backward_ref(const at::Tensor& z, const at::Tensor& targets, const at::Tensor& lse,
                                      const at::Tensor& g_lp, const at::Tensor& g_ent, const at::Tensor& mean_z,
                                      at::ScalarType out_dtype);

}  // namespace kiln::kernels
