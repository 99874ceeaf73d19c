#pragma once
// Host entries of the fused log-prob head: the Hopper GEMM (kernels/lm_head_sm90.cuh: CUTLASS 3's
// sm90 GEMM with an epilogue visitor tree, compiled for sm_90a beside the grouped GEMM) and the
// targets' log-probs (kernels/lm_head_targets.cu, any CUDA GPU). Torch-free: kernels/lm_head.cpp
// checks the tensors and fills LmHeadArgs / LmHeadTargetArgs.
//
// Legend: N rows (tokens), D hidden, V vocabulary. bf16 operands, fp32 accumulation.
#include <cstddef>
#include <cstdint>

namespace kiln::kernels::cuda {

struct LmHeadArgs {
  const void* hidden = nullptr;  ///< [N, D] bf16, row-major
  const void* weight = nullptr;  ///< [V, D] bf16, row-major
  const float* reference = nullptr;  ///< [N] fp32: each row's reference c (nats)
  void* probs = nullptr;         ///< [N, V] bf16, row-major: bf16(min(exp(acc - c), 2^64)), acc = hidden @ weight^T
  float* lse = nullptr;          ///< [N]: logsumexp over V of the fp32 accumulators
  float* kept_lse = nullptr;     ///< [N]: c + log sum_v probs[t, v] (fp32 sums of the values written)
  int64_t N = 0, V = 0, D = 0;
  int sm_count = 0;
  void* stream = nullptr;  ///< cudaStream_t
  /// The kernel schedule: false cooperative (128x256 tiles), true pingpong (128x128 tiles, one
  /// warp group's epilogue under the other's mainloop); the same results up to the tiles' order.
  bool pingpong = false;
};

/// Device memory for the call: CUTLASS's workspace, the references padded to N rounded up to 128
/// rows, and the tiles' row partials (two buffers of N rounded up to 128 x ceil(V / tile width) x 8 bytes; at V 154880 and a chunk of 1024 rows
/// ~5 MB each with the cooperative schedule's 256-wide tiles, ~10 MB with pingpong's 128):
/// (bytes, ctx) -> pointer valid until the work queued on args.stream is done (a stream-ordered
/// allocator).
using LmHeadAlloc = void* (*)(size_t bytes, void* ctx);

/// Queues the GEMM and the row partials' merge on args.stream; throws std::runtime_error when
/// CUTLASS refuses the problem
/// (N, V, D must be >= 1; V and D multiples of 8) or the launch fails.
void lm_head_probs_lse(const LmHeadArgs& args, LmHeadAlloc alloc, void* alloc_ctx);

/// The target log-probs beside it (kernels/lm_head_targets.cu, any CUDA GPU: no CUTLASS).
struct LmHeadTargetArgs {
  const void* hidden = nullptr;     ///< [N, D] bf16, row-major, from a 16-byte boundary
  const void* weight = nullptr;     ///< [V, D] bf16, row-major, from a 16-byte boundary
  const int64_t* targets = nullptr; ///< [N]
  const float* lse = nullptr;       ///< [N]: the rows' logsumexps
  float* out = nullptr;             ///< [N]: hidden[t] . weight[targets[t]] - lse[t] (fp32), 0 where
                                    ///< targets[t] is outside [0, V)
  int64_t N = 0, D = 0, V = 0;
  void* stream = nullptr;  ///< cudaStream_t
};
/// Queues it on args.stream (nothing for N = 0); throws std::runtime_error when D is not a
/// positive multiple of 8 or the launch fails.
void lm_head_target_logprobs(const LmHeadTargetArgs& args);

}  // namespace kiln::kernels::cuda
