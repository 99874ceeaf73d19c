#pragma once
// `kiln run`: the RL loop of an experiment in one process (synchronous: staleness 0).
// Per step: draw prompts, sample n completions each with the rollout engine, score them with
// the task's verifier, form GRPO groups (dropping groups with zero reward variance), train
// one optimizer step, and sync the new weights to the engine in checksummed buckets.
// Writes RUN_DIR/config.toml, RUN_DIR/metrics.jsonl (one JSON object per step) and
// RUN_DIR/reward_kl.png (gnuplot), and prints a progress line per step.
#include "experiments/experiment.hpp"

namespace kiln::experiments {

/// Runs the experiment; returns the process exit code (2 for a bad configuration, with the
/// message on stderr).
int run_experiment(const ExperimentConfig& config);

}  // namespace kiln::experiments
