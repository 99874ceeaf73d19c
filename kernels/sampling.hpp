#pragma once
// Token sampling for a batch of rows in one kernel (the rollout engine's sampler,
// actors/rollout/sampling.hpp, and the last op of its captured decode graphs).
// Legend: B rows, V vocabulary.
//
// sample_rows: row b draws one token from logits[b] [V] fp32 with temperature T = temperature[b]
// (0: greedy), top_k[b] (0: off) and top_p[b] (1: off), the uniform u = philox_uniform(seed[b],
// step[b]) (kernels/philox.hpp):
//   x = logits / T (T = 1 for greedy rows), p = softmax(x);
//   greedy rows take arg-max(logits) (the lowest index among equal maxima);
//   other rows keep the tokens with p >= the k-th largest p (top-k), then of those the tokens
//   whose kept mass strictly above them is < top_p * the kept mass (top-p, over the tempered,
//   top-k-renormalised distribution; tokens of equal p at the nucleus' edge are all kept), and
//   take the first token in vocabulary order whose cumulative kept mass exceeds
//   u * (1 - 1e-6) * the kept mass (inverse CDF);
//   logprob = log_softmax(x)[token] and entropy = -sum p log p, of the tempered untruncated
//   distribution (the rollout log-prob convention, actors/rollout/sampling.hpp).
// logits [B, V] fp32; temperature [B] fp64 (>= 0); top_k [B] int64 (>= 0); top_p [B] fp64 in
// (0, 1]; seed [B] int64 (the request's seed, its bits as uint64); step [B] int64 (>= 0, the
// token's index in its completion) -> [B, 3] fp64: token id, logprob (nats), entropy (nats).
// CUDA fp32 logits of V <= kSampleKernelMaxVocab (393216) run kernels/sampling.cu (Hopper:
// each row over a cluster of 8 CTAs, each holding its slice of the row in shared memory; no host
// sync: capturable in a CUDA graph; the parameters on the logits' device); anything else the
// LibTorch reference sample_rows_ref (it reads the parameters on the host, from any device). The
// two draw the same token except where their cumulative sums round differently at a token
// boundary. Throws c10::Error on shape or dtype mismatch.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {

/// The largest vocabulary the CUDA kernel takes: each of a row's 8 CTAs holds its eighth of the
/// row in shared memory (196 KB at this V); past it sample_rows is the reference.
constexpr int64_t kSampleKernelMaxVocab = 393216;

at::Tensor sample_rows(const at::Tensor& logits_BV, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& step);
at::Tensor sample_rows_ref(const at::Tensor& logits_BV, const at::Tensor& temperature, const at::Tensor& top_k,
                           const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& step);
/// True when sample_rows runs the kernel for these logits.
bool sample_rows_uses_kernel(const at::Tensor& logits_BV);

}  // namespace kiln::kernels
