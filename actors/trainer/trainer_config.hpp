#pragma once
// The trainer's settings and a step's metrics: one type each, torch-free and serialisable as
// they are (msgpack maps), nested in the experiment config (actors/controller/config.hpp) and
// in the trainer's wire messages (actors/trainer/messages.hpp). Experiment files set them
// under [algorithm] (docs/experiments.md lists every key).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <msgpack.hpp>

namespace kiln::trainer {

/// How per-token log-probs are computed: shared by the trainer (pi and pi_old) and the
/// reference policy, so that ratios and KL compare like with like.
struct LogprobConfig {
  int64_t max_tokens_per_microbatch = 4096;  ///< tokens packed into one forward
  bool routing_replay = true;                ///< use the rollout's expert ids in the forward (R3)
  /// Sampling temperature of the rollouts: log-probs are log_softmax(logits / temperature),
  /// the convention of actors/rollout/sampling.hpp.
  double temperature = 1.0;
  int64_t chunk = 1024;                      ///< vocabulary-projection chunk, tokens
  /// The true on-policy mode (experiment key algorithm.true_on_policy; docs/gpu.md): the
  /// policy (and the reference) run batch-invariant kernels (CausalLM::set_batch_invariant), as
  /// the rollout engines do (EngineOptions::true_on_policy, filled from this key), so that the
  /// trainer's log-prob of every rollout token equals the engine's bit for bit (with
  /// routing_replay). Slower in both; off by default.
  bool true_on_policy = false;
  MSGPACK_DEFINE_MAP(max_tokens_per_microbatch, routing_replay, temperature, chunk, true_on_policy);
};

/// The RL loss (actors/trainer/losses.hpp has the formulas).
struct PolicyLossConfig {
  double clip_low = 0.2;    ///< ratio floor 1 - clip_low
  double clip_high = 0.28;  ///< ratio ceiling 1 + clip_high (clip-higher, DAPO arXiv:2503.14476)
  std::string aggregation = "token_mean";  ///< "token_mean" | "sequence_mean"
  double kl_coef = 0.0;
  std::string kl_estimator = "k3";  ///< "k1" | "k2" | "k3"
  double entropy_coef = 0.0;
  /// Truncated importance sampling for stale tokens: each token's loss is weighted by
  /// min(exp(old_logprob - behavior_logprob), tis_cap) (detached); <= 0 turns it off.
  double tis_cap = 2.0;
  MSGPACK_DEFINE_MAP(clip_low, clip_high, aggregation, kl_coef, kl_estimator, entropy_coef, tis_cap);
};

struct TrainerConfig {
  LogprobConfig logprobs;
  double lr = 1e-3;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999;
  double grad_clip = 1.0;                ///< max global gradient norm; <= 0 turns clipping off
  std::string lr_schedule = "constant";  ///< "constant" | "cosine" (after linear warmup)
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;               ///< for "cosine"
  double min_lr_ratio = 0.1;             ///< cosine floor, fraction of lr
  /// pi_old from a separate no-grad pass before the update (verl/slime "recompute old
  /// log-prob", timed as log_probs_time) instead of the training forward's detached values.
  bool recompute_old_logprobs = false;
  /// Activation checkpointing per decoder layer (CausalLM::set_activation_checkpointing): the
  /// policy's layers keep only their inputs and run again in the backward (long packs in less
  /// memory, one more forward of the layers per step; the same loss and gradients).
  bool activation_checkpointing = false;
  /// With activation_checkpointing: checkpoint only the first N decoder layers (Megatron's
  /// --recompute-method block --recompute-num-layers N), the others keep their activations;
  /// 0 (or N >= the model's layers): every layer. N > 0 without activation_checkpointing is
  /// refused by validate().
  int64_t activation_checkpointing_layers = 0;
  /// GiB of the policy's 16-bit logits the log-prob head keeps from the forward for the
  /// backward (CausalLM::set_kept_logits_bytes; model/blocks/logprobs.hpp): a micro-batch whose
  /// [T, V] logits fit is not recomputed, a longer one keeps its leading chunks that fit and
  /// recomputes the rest (one GEMM of 2*V*D FLOPs per recomputed token). 0: recompute all.
  double keep_logits_gib = 4.0;
  /// keep_logits_gib in bytes (CausalLM::set_kept_logits_bytes' unit).
  int64_t keep_logits_bytes() const { return int64_t(keep_logits_gib * double(int64_t(1) << 30)); }
  /// Fully sharded data parallel for the decoder layers over the data-parallel ranks (experiment
  /// key parallel.fsdp; Trainer, FullyShardedLayers): no effect on one rank.
  bool fsdp = false;
  /// With fsdp: free each layer's parameters after its forward and gather them again for its
  /// backward (true, ZeRO-3), or keep them whole through the step and only reduce each layer's
  /// gradients as its backward ends (false, FSDP's SHARD_GRAD_OP; experiment key
  /// parallel.reshard_after_forward, FSDP2's name).
  bool reshard_after_forward = true;
  /// The dtype data-parallel ranks reduce-scatter gradients in (experiment key
  /// parallel.reduce_dtype): "fp32" (each rank's gradient converted first; torchtitan's default)
  /// or "bf16" (half the bytes; each rank's gradient rounded to bf16 and summed in bf16, as
  /// FSDP2's reduce_dtype and Megatron's bf16 gradient reduction); the sum is accumulated into
  /// the fp32 gradient shard either way. No effect on one rank.
  std::string reduce_dtype = "fp32";
  /// Train the sparse-attention indexers (glm5_next's KPool indexers) with the RL loss: refused
  /// by validate(). The indexer runs without gradient and its weights are frozen: it is trained
  /// by its own objective (a KL to dense attention, DeepSeek-V3.2 §2.1), which the RL loss is not.
  bool train_indexer = false;
  /// Multi-token prediction (DeepSeek-V3 §2.2; model::mtp_loss): lambda of the MTP loss added
  /// to the policy loss, over the completion tokens the policy loss trains; 0 = off. A policy
  /// without an MTP layer (CausalLM::mtp_layers() 0) refuses a weight > 0 (Trainer's constructor).
  double mtp_loss_weight = 0.0;
  /// Logical MTP depths (predicting tokens t+2 .. t+1+depths), run on the model's physical MTP
  /// layers with shared weights (glm5_next: its one layer at every depth).
  int64_t mtp_depths = 1;
  PolicyLossConfig loss;
  MSGPACK_DEFINE_MAP(logprobs, lr, weight_decay, beta1, beta2, grad_clip, lr_schedule, warmup_steps, total_steps,
                     min_lr_ratio, recompute_old_logprobs, activation_checkpointing, fsdp, reshard_after_forward,
                     train_indexer, mtp_loss_weight, mtp_depths, loss, reduce_dtype, keep_logits_gib,
                     activation_checkpointing_layers);

  /// What a field is called where the settings came from, for error messages: e.g.
  /// "experiment: key 'algorithm.lr'" for "lr". Default: "trainer config: lr".
  using FieldName = std::function<std::string(const std::string& field)>;
  /// Checks ranges and names; throws std::invalid_argument "<name(field)> <why>" for the
  /// first field out of range (fields: the leaf names above).
  void validate(const FieldName& name = {}) const;
};

/// One optimizer step's metrics, as the controller logs them.
struct StepMetrics {
  double loss = 0, pg_loss = 0, kl = 0, clip_fraction = 0, grad_norm = 0, lr = 0;
  double entropy = 0;  ///< mean policy entropy over trained tokens (computed when entropy_coef > 0)
  /// The multi-token-prediction term included in `loss` (mtp_loss_weight > 0; else 0), and its
  /// mean cross-entropy per supervised prediction over all depths.
  double mtp_loss = 0, mtp_ce = 0;
  double train_rollout_logprob_abs_diff = 0;  ///< mean |policy - behaviour| log-prob over trained tokens
  int64_t micro_batches = 0, tokens = 0, loss_tokens = 0;
  double actor_train_time = 0;  ///< seconds of the optimizer step
  double log_probs_time = 0;    ///< seconds of the separate pi_old pass (0: none)
  /// The step's loss or gradient norm was NaN or inf: it changed no parameter, no optimizer
  /// state (moments, step count, lr) and no version; loss and grad_norm above show the values.
  bool skipped_nonfinite = false;
  std::string skip_reason;  ///< why, e.g. "loss is inf"; empty when the step was taken
  /// Peak device memory of each trainer rank (index = rank) since its previous step, GiB
  /// (kernels::take_peak_memory_gib on the policy's device): filled by whoever runs the
  /// trainer (the controller's handles, TrainerService), not by Trainer::step; a rank's own
  /// answer holds its value alone (-1: a rank whose answer held none).
  std::vector<double> peak_memory_gib;
  MSGPACK_DEFINE_MAP(loss, pg_loss, kl, clip_fraction, grad_norm, lr, entropy, mtp_loss, mtp_ce, train_rollout_logprob_abs_diff,
                     micro_batches, tokens, loss_tokens, actor_train_time, log_probs_time, skipped_nonfinite,
                     skip_reason, peak_memory_gib);
};

}  // namespace kiln::trainer
