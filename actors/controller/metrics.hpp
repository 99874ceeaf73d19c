#pragma once
// Per-step metrics of a run: one JSON object per line in RUN/metrics.jsonl (every key below),
// the same numbers as TensorBoard scalars in RUN/tensorboard/ (tensorboard.hpp), step /
// reward mean / KL in RUN/metrics.tsv for the plot (RUN/reward_kl.png, gnuplot), and a
// progress line on stderr. Names follow the field (verl, slime): rollout_time,
// ref_logprob_time, log_probs_time, actor_train_time, update_weights_time (seconds).
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "actors/controller/tensorboard.hpp"
#include "actors/rollout/backend.hpp"
#include "actors/trainer/trainer_config.hpp"

namespace kiln::controller {

struct StepRow {
  int64_t step = 0;
  double reward_mean = 0, reward_std = 0;
  double kl = 0;       ///< mean KL(pi_behaviour || ref) estimate over the step's tokens
  double entropy = 0;  ///< mean entropy of the sampling distribution over generated tokens
  trainer::StepMetrics train;  ///< zero when no group was trained
  int64_t filtered_groups = 0, stale_dropped_groups = 0, trained_samples = 0;
  std::map<int64_t, int64_t> staleness_histogram;  ///< tokens by age in versions
  double rollout_time = 0, ref_logprob_time = 0, update_weights_time = 0;  ///< update: -1 if it failed
  int64_t policy_version = 0;
  double elapsed_s = 0;  ///< since the loop started
};

/// Mean reward and population std of `rewards`, mean entropy of the completions' tokens, and
/// the mean KL estimate (actors/trainer/losses.hpp) of behaviour vs reference log-probs.
void summarize(StepRow& row, const std::vector<float>& rewards, const std::vector<rollout::Completion>& completions,
               const std::vector<std::vector<float>>& ref_logprobs, const std::string& kl_estimator);

class MetricsLog {
 public:
  /// Checks, changing nothing, that RUN/metrics.{jsonl,tsv} and RUN/tensorboard can be written:
  /// throws std::runtime_error "cannot open 'FILE' ..." for a path there that is of another kind
  /// (a directory named metrics.jsonl, a file named tensorboard), a symbolic link that leads to
  /// nothing, or not writable.
  /// The files are changed only by open() (the first step's row): a run that fails before it
  /// leaves the rows and events of the run it continues or replaces as they were.
  MetricsLog(const std::filesystem::path& dir, int64_t first_step);
  /// Opens RUN/metrics.{jsonl,tsv}: appended to when `first_step` > 1 (a resume), after
  /// dropping rows of steps >= first_step (steps a resume trains again); else truncated. Starts
  /// a new TensorBoard event file in RUN/tensorboard (the events of steps >= first_step
  /// dropped from the earlier ones: tensorboard::EventWriter). Throws std::runtime_error naming
  /// the file that cannot be opened or rewritten. Once; write() calls it if nothing did.
  void open();
  bool is_open() const { return events_.has_value(); }
  /// One row in metrics.jsonl and metrics.tsv, and its numbers as one TensorBoard event. Throws
  /// std::runtime_error naming the file when a write fails (disk full, a file-size limit) or
  /// it cannot be opened.
  void write(const StepRow& row);
  /// "step 3/100  reward 0.125 ±0.331  kl ..." on stderr.
  static void print_progress(const StepRow& row, int64_t steps, int64_t prompts_per_step);
  /// RUN/reward_kl.png from metrics.tsv (says so on stderr if gnuplot fails).
  void plot() const;
  /// Rows of steps >= first_step removed from RUN/metrics.{jsonl,tsv}, and metrics.jsonl lines
  /// that are not JSON (cut short by a run that died mid-write; counted in *cut_short); returns
  /// how many metrics.jsonl lines went. Each file is rewritten beside itself and renamed over it:
  /// a failed write throws std::runtime_error and leaves it as it was.
  static int64_t drop_rows_from(const std::filesystem::path& dir, int64_t first_step, int64_t* cut_short = nullptr);

 private:
  std::filesystem::path dir_;
  int64_t first_step_;
  std::ofstream jsonl_, tsv_;
  std::optional<tensorboard::EventWriter> events_;  // set by open()
};

}  // namespace kiln::controller
