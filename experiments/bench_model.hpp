#pragma once
// `kiln bench model`: on this machine, in one run:
//  1. per-token log-probs at GLM-4.7-Flash's vocabulary (154880): kiln's chunked function vs
//     the full fp32 log-softmax path (what transformers does), forward+backward time and the
//     largest fp32 [rows, V] buffer each holds;
//  2. packed forward+backward of a CPU-sized glm4_moe_lite: tokens/s and achieved GFLOP/s
//     against the measured fp32 GEMM rate of the same machine (the hardware limit);
//  3. the same pack as an RL step whose documents' second halves are completions: the output
//     head on the completion rows only (kiln's trainer) vs on every row (verl's actor computes
//     every token's logits, then keeps the response's), forward+backward time and the FLOP
//     share it predicts.
#include <cstdint>

#include "model/glm4_moe_lite/config.hpp"

namespace kiln::experiments {

struct ModelBenchOptions {
  int64_t logprob_tokens = 256;   ///< T for part 1
  int64_t logprob_chunk = 64;     ///< chunk of the kiln path
  int64_t train_tokens = 2048;    ///< packed tokens for part 2 (4 documents)
  int repeats = 3;                ///< best of
};

int run_model_bench(const ModelBenchOptions& options);

/// Matmul FLOPs of one forward over `docs` packed documents of `n` tokens each: every
/// projection (routed experts at top_k, the shared expert, the router, lm_head) plus causal
/// attention (n^2/2 query-key pairs per document, head). Backward counts as 2x forward.
double glm4_forward_flops(const model::glm4_moe_lite::Glm4MoeLiteConfig& c, int64_t docs, int64_t n);

}  // namespace kiln::experiments
