#include "actors/trainer/trainer_config.hpp"
#include "actors/shown_value.hpp"
#include "model/blocks/temperature.hpp"

#include <cmath>
#include <stdexcept>

namespace kiln::trainer {

void TrainerConfig::validate(const FieldName& name) const {
  auto need = [&](bool ok, const std::string& field, const std::string& why) {
    if (!ok) throw std::invalid_argument((name ? name(field) : "trainer config: " + field) + " " + why);
  };
  need(logprobs.max_tokens_per_microbatch >= 1, "max_tokens_per_microbatch",
       "must be >= 1, got " + shown(logprobs.max_tokens_per_microbatch));
  need(logprobs.temperature >= model::kMinTemperature, "temperature",
       "must be >= 1e-5 (logits are divided by it; smaller ones overflow them into NaN), got " +
           shown(logprobs.temperature));
  need(logprobs.chunk >= 1, "chunk", "must be >= 1, got " + shown(logprobs.chunk));
  need(lr > 0, "lr", "must be > 0, got " + shown(lr));
  need(activation_checkpointing_layers >= 0, "activation_checkpointing_layers",
       "must be >= 0 (0: every layer), got " + shown(activation_checkpointing_layers));
  need(activation_checkpointing_layers == 0 || activation_checkpointing, "activation_checkpointing_layers",
       "is " + shown(activation_checkpointing_layers) +
           " but activation checkpointing is off: set algorithm.activation_checkpointing = true too (or this to 0)");
  need(std::isfinite(keep_logits_gib) && keep_logits_gib >= 0 && keep_logits_gib <= 1 << 20, "keep_logits_gib",
       "must be in [0, 1048576] (0: recompute every chunk's logits), got " + shown(keep_logits_gib));
  need(!train_indexer, "train_indexer",
       "must be false: the RL loss does not train the sparse-attention indexer (its weights are frozen and it runs "
       "without gradient; it has its own training objective, a KL to dense attention, which kiln does not implement)");
  need(reduce_dtype == "fp32" || reduce_dtype == "bf16", "reduce_dtype",
       "must be \"fp32\" or \"bf16\", got \"" + reduce_dtype + "\"");
  need(mtp_loss_weight >= 0 && std::isfinite(mtp_loss_weight), "mtp_loss_weight",
       "must be finite and >= 0 (0: off), got " + shown(mtp_loss_weight));
  need(mtp_depths >= 1 && mtp_depths <= 16, "mtp_depths", "must be in [1, 16], got " + shown(mtp_depths));
  need(weight_decay >= 0, "weight_decay", "must be >= 0, got " + shown(weight_decay));
  need(grad_clip >= 0, "grad_clip", "must be >= 0 (0: no clipping), got " + shown(grad_clip));
  need(beta1 >= 0 && beta1 < 1, "beta1", "must be in [0, 1), got " + shown(beta1));
  need(beta2 >= 0 && beta2 < 1, "beta2", "must be in [0, 1), got " + shown(beta2));
  need(lr_schedule == "constant" || lr_schedule == "cosine", "lr_schedule",
       "must be \"constant\" or \"cosine\", got \"" + lr_schedule + "\"");
  need(warmup_steps >= 0, "warmup_steps", "must be >= 0, got " + shown(warmup_steps));
  need(lr_schedule != "cosine" || total_steps >= 1, "total_steps",
       "must be >= 1 with lr_schedule \"cosine\", got " + shown(total_steps));
  need(min_lr_ratio >= 0 && min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1], got " + shown(min_lr_ratio));
  need(loss.clip_low >= 0 && loss.clip_low < 1, "clip_low", "must be in [0, 1), got " + shown(loss.clip_low));
  need(loss.clip_high >= 0, "clip_high", "must be >= 0, got " + shown(loss.clip_high));
  need(loss.kl_coef >= 0, "kl_coef", "must be >= 0, got " + shown(loss.kl_coef));
  need(loss.entropy_coef >= 0, "entropy_coef", "must be >= 0, got " + shown(loss.entropy_coef));
  need(loss.tis_cap > 0, "tis_cap", "must be > 0, got " + shown(loss.tis_cap));
  need(loss.kl_estimator == "k1" || loss.kl_estimator == "k2" || loss.kl_estimator == "k3", "kl_estimator",
       "must be \"k1\", \"k2\" or \"k3\", got \"" + loss.kl_estimator + "\"");
  need(loss.aggregation == "token_mean" || loss.aggregation == "sequence_mean", "aggregation",
       "must be \"token_mean\" or \"sequence_mean\", got \"" + loss.aggregation + "\"");
}

}  // namespace kiln::trainer
