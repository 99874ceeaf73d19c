#pragma once
// Experiment files (TOML): every key has a default (the built-in default experiment), a file
// overrides some, `--set section.key=value` overrides any. Unknown sections or keys and values
// of the wrong type or range are rejected by name. docs/experiments.md lists every key.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::experiments {

struct ExperimentConfig {
  struct Run {
    std::string name = "default";
    std::string output_dir = "runs/default";
    int64_t seed = 1;
    int64_t steps = 100;
    int64_t checkpoint_every = 0;  ///< 0: no checkpoints
    std::string resume_from;       ///< a checkpoint directory written by a run (RUN/checkpoints/step_N)
  } run;
  struct Model {
    std::string package = "glm4_moe_lite";
    std::string flavor = "debug";
    std::string checkpoint;  ///< HF checkpoint directory; overrides flavor when set
    std::string device = "cpu";  ///< "cpu", "cuda" or "cuda:N": policy, reference and engine
    std::string dtype = "fp32";  ///< "fp32" | "bf16" (bf16: fp32 master weights + AdamW state)
  } model;
  struct Task {
    std::string name = "next_digit";
    int64_t min_digits = 1, max_digits = 1;  ///< arithmetic
    std::string operators = "+";             ///< arithmetic
  } task;
  struct Algorithm {
    int64_t prompts_per_step = 32;
    int64_t samples_per_prompt = 16;
    double temperature = 1.0, top_p = 1.0;
    int64_t top_k = 0;
    int64_t max_new_tokens = 1;
    bool normalize_std = true;
    bool filter_zero_variance = true;
    int64_t staleness = 0;  ///< k: 0 = synchronous
    double lr = 2e-3, weight_decay = 0.0, grad_clip = 1.0;  // default: next_digit learns in ~60 steps
    std::string lr_schedule = "constant";
    int64_t warmup_steps = 0;
    double clip_low = 0.2, clip_high = 0.28;
    double kl_coef = 0.0;
    std::string kl_estimator = "k3";
    std::string aggregation = "token_mean";
    double tis_cap = 2.0;
    double entropy_coef = 0.0;
    int64_t max_tokens_per_microbatch = 4096;
    bool routing_replay = true;
    /// pi_old from a separate no-grad pass before the update (timed as log_probs_time), instead
    /// of the training forward's own detached values.
    bool recompute_old_logprobs = false;
    int64_t update_delay_ms = 0;  ///< testing: sleep after each policy update, to emulate a slow trainer
  } algorithm;
  struct Rollout {
    std::string backend = "engine";
    int64_t cache_blocks = 1024, block_size = 16, max_batch = 512;
    int64_t step_delay_ms = 0;  ///< testing: sleep per engine step, to emulate slow rollouts
  } rollout;
  struct WeightSync {
    double bucket_mib = 64;
  } weight_sync;
  struct Placement {
    std::string mode = "single_process";
    int64_t rollout_engines = 1;  ///< multi_process: rollout engines, each a kiln node process
    std::string reference = "controller";  ///< "controller" | "process": ref/0 in a kiln node
    std::string trainer = "controller";    ///< "controller" | "process": trainer/0 in a kiln node
  } placement;
  struct Logging {
    bool progress = true;
    bool plot = true;
  } logging;

  /// Reads a TOML file over the defaults. Throws std::invalid_argument naming the file and
  /// the key for unknown keys, wrong types, bad values, or TOML syntax errors (with line).
  static ExperimentConfig from_file(const std::string& path);
  /// Applies "section.key=value" (value in TOML syntax: 3, 0.5, true, "text" or bare text).
  void set(const std::string& assignment);
  /// Checks ranges and combinations; throws std::invalid_argument naming the key.
  void validate() const;
  /// Every key with its current value, TOML (written into the run directory).
  std::string to_toml() const;
};

}  // namespace kiln::experiments
