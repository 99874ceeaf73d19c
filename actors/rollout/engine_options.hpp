#pragma once
// The in-process engine's settings (actors/rollout/engine.hpp): one type for the experiment
// file's [rollout] keys and the rollout.init message. Torch-free.
#include <cstdint>

#include <msgpack.hpp>

namespace kiln::rollout {

struct EngineOptions {
  int64_t cache_blocks = 512;         ///< pages in the cache (the memory bound)
  int64_t block_size = 16;            ///< tokens per page
  int64_t max_batch = 64;             ///< sequences decoding at once (at most cache_blocks: decode_slots)
  int64_t max_prefill_tokens = 8192;  ///< prompt tokens admitted per step
  int64_t step_delay_ms = 0;          ///< testing: sleep after each step that did work (slow rollouts)
  /// CUDA: decode steps attend in latent space over the cache (CausalLM::set_absorbed_decode)
  /// instead of expanding every cached latent through kv_b (faster; log-probs further from
  /// the trainer's). CPU engines always attend in latent space.
  bool absorbed_decode = false;
  /// Requests with the same prompt (the samples of a GRPO group) prefill it once: the others
  /// share its full cache pages and copy its last, partial page (copy-on-write at the first
  /// generated token), and sample their first token from the same logits with their own seed.
  /// Off by default: with it on, the rows a prefill batch holds depend on how a step's groups
  /// are split over engines, so runs of different placements are no longer bit-identical.
  bool share_prompts = false;
  /// CUDA: steps in which every sequence decodes one token replay a CUDA graph of the model's
  /// decode forward and lm_head, captured per batch-size and context bucket
  /// (actors/rollout/decode_graphs.hpp), instead of launching each op from the host. Needs a
  /// CUDA model with a device decode step (CausalLM::forward_decode) and absorbed_decode; the
  /// cache gets one more page (the padding rows' scratch page). Off by default.
  bool cuda_graphs = false;
  /// CUDA: absorbed decode steps (eager and graphed) attend with the paged-cache kernel
  /// (kernels/mla_decode.hpp: each cached latent read once, in place, all heads sharing each
  /// load; CausalLM::set_decode_kernel) instead of gathering every sequence's padded latents
  /// and reading them with two batched GEMMs. No effect without absorbed_decode. On by
  /// default: equal to the gather within bf16 rounding on an H200, eager steps 1.2-1.9x faster,
  /// graphed steps 1.2-1.5x at 8192 x 128-256 and within 5% elsewhere (docs/benchmarks.md,
  /// "Rollout decode with the paged-cache attention kernel").
  bool mla_decode_kernel = true;
  /// CUDA: tokens are drawn by the one-kernel sampler (kernels/sampling.hpp: one block per row,
  /// the whole batch in one launch) and, in graphed decode steps, inside the captured graph, so
  /// that a step's one host read is the sampled [B] tokens with their log-probs and entropies;
  /// off: the LibTorch reference sampler after the forward (the same draws but where cumulative
  /// sums round differently at a token boundary). Either way a request's uniforms are Philox of
  /// (its seed, the token's index): the same seed gives the same tokens. On by default.
  bool sampling_kernel = true;
  /// CUDA bf16: the routed experts of steps with at most 1024 (token, expert) rows (decode steps
  /// of up to 256 sequences at GLM-4.7-Flash's top-4) run the decode kernels of
  /// kernels/moe_decode.hpp (each touched expert's weights streamed once through the tensor
  /// cores, an untouched expert's not read) instead of the grouped GEMM
  /// (kernels::DecodeExpertsGuard around the step). Equal within bf16 rounding. On by default: on
  /// an H200 they run at 87-91% of the copy rate where the grouped GEMM runs at 52-66%
  /// (docs/benchmarks.md, "Rollout decode: the routed experts on the tensor cores").
  bool moe_decode_kernel = true;
  /// CUDA graphs with the sampling kernel: a decode step whose successor is a decode step too
  /// (no request waiting for admission) queues that successor before it reads its own tokens,
  /// the successor's ids taken on the device from its samples (SGLang's overlap scheduler), so
  /// that the host's work between steps (reading the tokens, stop checks, the next step's page
  /// tables) runs while the GPU computes. A row whose sequence the read step finished (a stop
  /// token) is computed once more and dropped; a sequence reaching max_new_tokens is left out
  /// beforehand. The same tokens, log-probs and routed experts as without. No effect unless
  /// cuda_graphs and sampling_kernel are on. On by default.
  bool overlap_schedule = true;
  /// The true on-policy mode (CausalLM::set_batch_invariant): the model's forward, the
  /// expanded cache attention on every device, and the sampled token's log-prob (z[token] -
  /// bi_logsumexp(z), z = bi_linear logits / T: model::invariant_tempered_logits) in
  /// batch-invariant kernels, so that the trainer's log-probs equal the engine's bit for bit.
  /// Not an experiment key of its own: the run fills it from algorithm.true_on_policy
  /// (controller::Config::engine_for_run). Refused with absorbed_decode or cuda_graphs (the
  /// latent-space decode is another formula than the trainer's) and by a model without a
  /// batch-invariant forward.
  bool true_on_policy = false;
  MSGPACK_DEFINE_MAP(cache_blocks, block_size, max_batch, max_prefill_tokens, step_delay_ms, absorbed_decode,
                     share_prompts, cuda_graphs, mla_decode_kernel, sampling_kernel, moe_decode_kernel, true_on_policy,
                     overlap_schedule);
};

}  // namespace kiln::rollout
