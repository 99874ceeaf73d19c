#pragma once
// The in-process engine's settings (actors/rollout/engine.hpp): one type for the experiment
// file's [rollout] keys and the rollout.init message. Torch-free.
#include <cstdint>

#include <msgpack.hpp>

namespace kiln::rollout {

struct EngineOptions {
  int64_t cache_blocks = 512;         ///< pages in the cache (the memory bound)
  int64_t block_size = 16;            ///< tokens per page
  int64_t max_batch = 64;             ///< sequences decoding at once
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
                     share_prompts, cuda_graphs, mla_decode_kernel, true_on_policy);
};

}  // namespace kiln::rollout
