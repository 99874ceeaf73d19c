#include "actors/controller/metrics.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>

#include "actors/controller/run_dir.hpp"
#include "actors/trainer/losses.hpp"

extern char** environ;

namespace kiln::controller {

void summarize(StepRow& row, const std::vector<float>& rewards, const std::vector<rollout::Completion>& completions,
               const std::vector<std::vector<float>>& ref_logprobs, const std::string& kl_estimator) {
  auto r = torch::tensor(rewards);
  row.reward_mean = r.mean().item<double>();
  row.reward_std = r.std(false).item<double>();
  double entropy = 0;
  int64_t tokens = 0;
  std::vector<float> sampled, reference;  // every generated token, one KL estimate call
  for (std::size_t i = 0; i < completions.size(); ++i) {
    for (float e : completions[i].entropies) entropy += e;
    tokens += int64_t(completions[i].tokens.size());
    sampled.insert(sampled.end(), completions[i].logprobs.begin(), completions[i].logprobs.end());
    reference.insert(reference.end(), ref_logprobs[i].begin(), ref_logprobs[i].end());
  }
  row.entropy = tokens ? entropy / double(tokens) : 0.0;
  row.kl = sampled.empty() ? 0.0
                           : trainer::kl_estimate(torch::tensor(sampled), torch::tensor(reference),
                                                  trainer::kl_estimator_from_string(kl_estimator))
                                 .mean()
                                 .item<double>();
}

namespace {
// A metrics file whose write failed (disk full, a file-size limit) stops the run by name: its
// rows would otherwise be lost while the run reports success.
void check_written(const std::ofstream& out, const std::filesystem::path& file) {
  if (!out) throw std::runtime_error("writing '" + file.string() + "' failed (disk full, or a file-size limit?)");
}

// Whether `path` could be written as a file (`directory` false) or a directory of files, without
// writing it: an existing one must be of that kind and writable (a link is followed: /dev/full is
// one), a missing one needs a writable directory to be made in; a symbolic link that leads to
// nothing is refused (writing through it would make its target, or fail).
bool writable(const std::filesystem::path& path, bool directory) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (std::filesystem::exists(st))
    return std::filesystem::is_directory(st) == directory && ::access(path.c_str(), W_OK) == 0;
  if (!dangling_link(path).empty()) return false;
  return ::access(path.parent_path().c_str(), W_OK) == 0;
}
}  // namespace

MetricsLog::MetricsLog(const std::filesystem::path& dir, int64_t first_step) : dir_(dir), first_step_(first_step) {
  for (const auto* name : {"metrics.jsonl", "metrics.tsv"})
    if (!writable(dir / name, false))
      throw std::runtime_error("cannot open '" + (dir / name).string() +
                               "' for writing (a directory, a link to nothing, or not writable)");
  if (!writable(dir / "tensorboard", true))
    throw std::runtime_error("cannot open '" + (dir / "tensorboard").string() +
                             "' for TensorBoard's event files (not a directory, a link to nothing, or not writable)");
}

void MetricsLog::open() {
  if (is_open()) return;
  const auto first_step = first_step_;
  if (first_step > 1) {
    int64_t cut = 0;
    const int64_t dropped = drop_rows_from(dir_, first_step, &cut);
    if (dropped - cut > 0)
      std::fprintf(stderr,
                   "kiln run: dropped %lld metric rows of steps after the checkpoint (those steps are trained again now)\n",
                   (long long)(dropped - cut));
    if (cut > 0)
      std::fprintf(stderr,
                   "kiln run: dropped %lld line(s) of metrics.jsonl cut short (not JSON: a write that did not finish); "
                   "the steps they held have no metrics row\n",
                   (long long)cut);
  }
  const auto mode = first_step > 1 ? std::ios::app : std::ios::trunc;
  jsonl_.open(dir_ / "metrics.jsonl", mode);
  if (!jsonl_.is_open()) throw std::runtime_error("cannot open '" + (dir_ / "metrics.jsonl").string() + "' for writing");
  tsv_.open(dir_ / "metrics.tsv", mode);
  if (!tsv_.is_open()) throw std::runtime_error("cannot open '" + (dir_ / "metrics.tsv").string() + "' for writing");
  // A comment line naming the columns, at the top of a new file (gnuplot skips it; a run resumed
  // into the same directory keeps the first one, one resumed into a new directory writes it).
  tsv_.seekp(0, std::ios::end);
  if (tsv_.tellp() == 0) tsv_ << "# step\treward_mean\tkl\n" << std::flush;
  check_written(tsv_, dir_ / "metrics.tsv");
  events_.emplace(dir_ / "tensorboard", first_step);  // last: is_open() says all three are
}

void MetricsLog::write(const StepRow& row) {
  open();
  const auto& m = row.train;
  nlohmann::json j;
  j["step"] = row.step;
  j["reward_mean"] = row.reward_mean;
  j["reward_std"] = row.reward_std;
  j["kl"] = row.kl;
  j["entropy"] = row.entropy;
  j["clip_fraction"] = m.clip_fraction;
  j["train/rollout logprob abs diff"] = m.train_rollout_logprob_abs_diff;
  j["loss"] = m.loss;
  if (m.mtp_ce != 0) {  // algorithm.mtp_loss_weight > 0: the MTP term (in loss) and its cross-entropy
    j["mtp_loss"] = m.mtp_loss;
    j["mtp_ce"] = m.mtp_ce;
  }
  j["grad_norm"] = m.grad_norm;
  j["lr"] = m.lr;
  j["skipped_nonfinite"] = m.skipped_nonfinite;
  if (m.skipped_nonfinite) j["skip_reason"] = m.skip_reason;
  j["filtered_groups"] = row.filtered_groups;
  j["stale_dropped_groups"] = row.stale_dropped_groups;
  j["trained_samples"] = row.trained_samples;
  nlohmann::json hist = nlohmann::json::object();
  for (const auto& [k, n] : row.staleness_histogram) hist[std::to_string(k)] = n;
  j["staleness_histogram"] = hist;
  j["rollout_time"] = row.rollout_time;
  j["ref_logprob_time"] = row.ref_logprob_time;
  j["log_probs_time"] = m.log_probs_time;
  j["actor_train_time"] = m.actor_train_time;
  j["update_weights_time"] = row.update_weights_time;
  j["train_tokens_per_s"] = m.actor_train_time > 0 ? double(m.tokens) / m.actor_train_time : 0.0;
  // Each trainer rank's peak device memory since its previous step (GiB): CUDA allocator
  // peak, or the process's peak RSS on CPU (kernels/device_memory.hpp).
  for (std::size_t r = 0; r < m.peak_memory_gib.size(); ++r)
    j["peak_memory_gib_rank_" + std::to_string(r)] = m.peak_memory_gib[r];
  j["policy_version"] = row.policy_version;
  j["elapsed_s"] = row.elapsed_s;
  jsonl_ << j.dump() << "\n" << std::flush;
  check_written(jsonl_, dir_ / "metrics.jsonl");
  events_->write(j, std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  tsv_ << row.step << "\t" << row.reward_mean << "\t" << row.kl << "\n" << std::flush;
  check_written(tsv_, dir_ / "metrics.tsv");
}

void MetricsLog::print_progress(const StepRow& row, int64_t steps, int64_t prompts_per_step) {
  std::fprintf(stderr,
               "step %3lld/%lld  reward %.3f ±%.3f  kl %.4f  clip %.3f  filtered %lld/%lld  rollout %.2fs  train %.2fs  "
               "sync %.3fs\n",
               (long long)row.step, (long long)steps, row.reward_mean, row.reward_std, row.kl, row.train.clip_fraction,
               (long long)row.filtered_groups, (long long)prompts_per_step, row.rollout_time,
               row.train.actor_train_time, row.update_weights_time);
  if (row.train.skipped_nonfinite)
    std::fprintf(stderr, "step %3lld: skipped, policy unchanged: %s\n", (long long)row.step, row.train.skip_reason.c_str());
}

void MetricsLog::plot() const {
  const auto tsv = dir_ / "metrics.tsv", png = dir_ / "reward_kl.png", script = dir_ / "reward_kl.gp";
  // One row: ranges around its point (gnuplot warns of an empty range otherwise).
  std::ifstream in(tsv);
  std::string line, first;
  int64_t rows = 0;
  for (double step = 0; std::getline(in, line);)
    if (std::istringstream(line) >> step && rows++ == 0) first = line;  // numeric rows (a header is not)
  std::string ranges;
  if (rows == 1) {
    std::istringstream f(first);
    double step = 0, reward = 0, kl = 0;
    f >> step >> reward >> kl;
    char buf[256];
    std::snprintf(buf, sizeof buf, "set xrange [%g:%g]; set yrange [%g:%g]; set y2range [%g:%g]; ", step - 1, step + 1,
                  reward - 0.5, reward + 0.5, kl - 0.5, kl + 0.5);
    ranges = buf;
  }
  // The script in a file, gnuplot started without a shell in the run directory, and only
  // relative names in the script: the directory's name never reaches gnuplot's parser (a
  // newline or a backtick in it would end a string or run a command there).
  std::ofstream(script) << "set terminal png size 900,500; set output '" << png.filename().string()
                        << "'; set xlabel 'step'; set ylabel 'reward'; set y2label 'KL'; set y2tics; set ytics nomirror; "
                        << "set key left top; " << ranges << "plot '" << tsv.filename().string() << "' using 1:2 with "
                        << (rows == 1 ? "points" : "lines") << " lw 2 title 'reward mean', '" << tsv.filename().string()
                        << "' using 1:3 axes x1y2 with lines title 'KL'\n";
  std::string prog = "gnuplot", arg = script.filename().string(), cwd = dir_.string();
  char* argv[] = {prog.data(), arg.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addchdir_np(&actions, cwd.c_str());
  pid_t pid = -1;
  int status = 0;
  const int spawned = posix_spawnp(&pid, "gnuplot", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  const bool waited = spawned == 0 && ::waitpid(pid, &status, 0) == pid;
  std::error_code ec;
  std::filesystem::remove(script, ec);
  if (spawned != 0)
    std::fprintf(stderr, "kiln run: no plot: gnuplot could not be started (%s; is it installed?)\n", std::strerror(spawned));
  else if (!waited || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const std::string how = !waited               ? "its process was lost"
                            : WIFEXITED(status)   ? "exit status " + std::to_string(WEXITSTATUS(status))
                                                  : "signal " + std::to_string(WTERMSIG(status));
    std::fprintf(stderr, "kiln run: no plot: gnuplot failed on %s (%s)\n", tsv.c_str(), how.c_str());
  }
}

int64_t MetricsLog::drop_rows_from(const std::filesystem::path& dir, int64_t first_step, int64_t* cut_short) {
  int64_t dropped = 0;
  if (cut_short) *cut_short = 0;
  for (const std::string name : {"metrics.jsonl", "metrics.tsv"}) {
    const bool json = name == "metrics.jsonl";
    std::ifstream in(dir / name);
    std::vector<std::string> keep;
    std::size_t lines = 0;
    for (std::string line; std::getline(in, line); ++lines) {
      int64_t row_step = 0;
      try {
        row_step = json ? nlohmann::json::parse(line).at("step").get<int64_t>() : std::stoll(line);
      } catch (const std::exception&) {
        // metrics.jsonl: a line cut short by a run that died mid-write: dropped (the file stays
        // JSON lines); metrics.tsv: the header, kept
        if (json && cut_short) ++*cut_short;
        row_step = json ? first_step : 0;
      }
      if (row_step < first_step) keep.push_back(line);
      else if (json) ++dropped;
    }
    in.close();
    if (keep.size() == lines) continue;  // nothing to drop: the file stays as it is
    std::string text;
    for (const auto& l : keep) text += l + "\n";
    try {  // a write that fails leaves the rows as they were
      replace_file(dir / name, text);
    } catch (const std::exception& e) {
      throw std::runtime_error("cannot drop the rows of steps the resume trains again: " + std::string(e.what()));
    }
  }
  return dropped;
}

}  // namespace kiln::controller
