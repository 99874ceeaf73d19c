#include "actors/controller/loop.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <thread>

#include "actors/controller/grpo.hpp"
#include "actors/controller/in_flight.hpp"
#include "actors/controller/metrics.hpp"
#include "actors/controller/placement.hpp"
#include "actors/controller/prompts.hpp"
#include "actors/controller/rollout_stream.hpp"
#include "actors/controller/run_dir.hpp"
#include "actors/controller/staleness.hpp"
#include "actors/trainer/checkpoint.hpp"
#include "actors/trainer/samples.hpp"
#include "messaging/stopwatch.hpp"

namespace kiln::controller {

namespace {
namespace fs = std::filesystem;
using messaging::Stopwatch;

// The newest checkpoint this run wrote or resumed from: a failure with nothing trained since
// points to it instead of writing it again (it may hold rollouts in flight that are gone now).
struct LastCheckpoint {
  int64_t step = 0;
  fs::path dir;
};

// What to say after trainer.save(ck) threw, `since` being when the save began: a checkpoint
// is renamed into place only once every rank wrote its part, so a state.json written since then
// means the failure (e.g. a rank lost after the rename) came after a complete checkpoint.
std::string save_failure(const fs::path& ck, fs::file_time_type since, const std::string& error) {
  std::error_code ec;
  const auto written = fs::last_write_time(ck / "state.json", ec);
  if (!ec && written >= since) return "the checkpoint " + ck.string() + " was written, then: " + error;
  return "cannot save a checkpoint: " + error;
}

// " with --set run.overwrite=true" when a run that logged nothing stops over an earlier run:
// metrics.jsonl is there only then (this run writes it at its first logged step), else "".
std::string overwrite_advice(const fs::path& dir) {
  return fs::exists(dir / "metrics.jsonl")
             ? " with --set run.overwrite=true (the run directory still holds the run it was to replace)"
             : "";
}

// After a failure at `step`: checkpoint steps 1..trained (with the prompt RNG after them)
// where the policy lives, say how to continue, exit code 1.
int stop_with_checkpoint(TrainerHandle& trainer, const fs::path& dir, int64_t step, const std::string& what,
                         int64_t trained, const std::string& prompt_rng, RolloutStream& rollouts,
                         const LastCheckpoint& last) {
  std::fprintf(stderr, "kiln run: step %lld: %s\n", (long long)step, what.c_str());
  if (trained >= 1 && trained == last.step && !last.dir.empty()) {
    std::fprintf(stderr, "kiln run: steps 1..%lld are in %s; continue with --set run.resume_from=%s\n",
                 (long long)trained, last.dir.c_str(), shell_word(last.dir.string()).c_str());
    return 1;
  }
  if (trained < 1) {
    std::fprintf(stderr, "kiln run: no step was trained: nothing to checkpoint; start again%s\n",
                 overwrite_advice(dir).c_str());
    return 1;
  }
  const auto ck = checkpoint_dir(dir, trained);
  const auto since = fs::file_time_type::clock::now();
  try {
    trainer.save(ck, {trained, 0, prompt_rng, encode_in_flight(rollouts.in_flight(trained, /*wait=*/false))});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: steps 1..%lld: %s\n%s", (long long)trained, save_failure(ck, since, e.what()).c_str(),
                 continue_hint(dir, last.dir).c_str());
    return 1;
  }
  std::fprintf(stderr, "kiln run: saved %s (steps 1..%lld trained); continue with --set run.resume_from=%s\n",
               ck.c_str(), (long long)trained, shell_word(ck.string()).c_str());
  return 1;
}

// Ctrl-C (the first): checkpoint steps 1..trained unless that checkpoint exists or this run
// trained nothing yet, and print the command that continues the run. Exit code 130.
int stop_on_interrupt(TrainerHandle& trainer, const fs::path& dir, int64_t trained, int64_t first_step,
                      const std::string& prompt_rng, RolloutStream& rollouts, const LastCheckpoint& last) {
  const auto ck = checkpoint_dir(dir, trained);
  if (trained < first_step) {
    std::fprintf(stderr, "kiln run: interrupted before step %lld; nothing new was trained\n", (long long)first_step);
    return 130;
  }
  try {
    if (!fs::exists(ck / "state.json"))
      trainer.save(ck, {trained, 0, prompt_rng, encode_in_flight(rollouts.in_flight(trained, /*wait=*/true))});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: interrupted; cannot save a checkpoint of steps 1..%lld: %s\n%s", (long long)trained,
                 e.what(), continue_hint(dir, last.dir).c_str());
    return 130;
  }
  std::error_code ec;
  const auto exe = fs::read_symlink("/proc/self/exe", ec);
  std::fprintf(stderr, "kiln run: interrupted after step %lld; saved %s\nkiln run: continue with: %s run %s --set run.resume_from=%s\n",
               (long long)trained, ck.c_str(), ec ? "kiln" : shell_word(exe.string()).c_str(),
               shell_word(as_argument(dir / "config.toml")).c_str(), shell_word(ck.string()).c_str());
  return 130;
}

// Restores the trainer, the rollouts in flight and the prompt RNG (after them) from
// config.run.resume_from; the first step to run.
int64_t resume(const Config& c, TrainerHandle& trainer, Prompts& prompts, std::vector<Batch>& in_flight) {
  const fs::path ck(c.run.resume_from);
  if (!fs::is_directory(ck)) throw std::invalid_argument("no such checkpoint directory");
  auto state = trainer.load(ck);
  // A directory named as kiln names checkpoints (step_NNNNNN) must hold that step: metrics rows
  // past state.json's step would otherwise be dropped as not yet trained.
  // (Named after "." and ".." are resolved and a trailing separator dropped: ".../step_000006/".)
  auto named = ck.lexically_normal();
  if (!named.has_filename()) named = named.parent_path();
  const auto name = named.filename().string();
  if (const auto step = trainer::checkpoint_name_step(name); step && *step != state.step)  // (-1: too long for a step)
    throw std::invalid_argument("state.json says step " + std::to_string(state.step) + " but the directory is " + name +
                                ": the checkpoint was edited or moved; resume from the directory of its own step");
  const auto in_flight_file = (ck / trainer::kInFlightRolloutsFile).string();
  if (!state.in_flight_rollouts.empty()) in_flight = decode_in_flight(state.in_flight_rollouts, state.step, in_flight_file);
  while (!in_flight.empty() && in_flight.back().step > c.run.steps) in_flight.pop_back();
  const auto routing = trainer.routing_shape();
  for (const auto& b : in_flight) {  // what the trainer and the staleness bound would trip on later
    const auto group = c.algorithm.samples_per_prompt;
    if (int64_t(b.completions.size()) != int64_t(b.problems.size()) * group)
      throw std::invalid_argument(in_flight_file + ": step " + std::to_string(b.step) + " holds " +
                                  std::to_string(b.completions.size()) + " completions for " +
                                  std::to_string(b.problems.size()) + " problems; algorithm.samples_per_prompt " +
                                  std::to_string(group) + " needs " + std::to_string(int64_t(b.problems.size()) * group) +
                                  " (resume with the samples_per_prompt it was written with)");
    for (const auto& x : b.completions) {
      const auto where = in_flight_file + ": step " + std::to_string(b.step) +
                         " completion " + std::to_string(x.id);
      for (const auto* ids : {&x.prompt, &x.tokens})
        for (auto t : *ids)
          if (t < 0 || t >= trainer.vocab_size())
            throw std::invalid_argument(where + ": token id " + std::to_string(t) + " outside the vocabulary [0, " +
                                        std::to_string(trainer.vocab_size()) + ")");
      for (auto v : x.policy_versions)
        if (v < 0 || v > state.policy_version)
          throw std::invalid_argument(where + ": policy version " + std::to_string(v) + " outside [0, " +
                                      std::to_string(state.policy_version) + "] (the checkpoint's)");
      if (x.routed_experts.defined()) {  // as the log-prob passes and the train step would replay them
        const auto rows = int64_t(x.prompt.size() + x.tokens.size()) - 1;
        if (auto why = trainer::routed_experts_fault(x.routed_experts, rows, routing.layers, routing.per_token,
                                                     routing.experts);
            !why.empty())
          throw std::invalid_argument(where + " " + why);
      }
    }
  }
  try {
    prompts.restore(in_flight.empty() ? state.prompt_rng : in_flight.back().rng_after);
  } catch (const std::exception& e) {
    throw std::invalid_argument(in_flight.empty() ? "state.json in '" + ck.string() + "': " + e.what()
                                                  : in_flight_file + ": step " + std::to_string(in_flight.back().step) +
                                                        " rng_after: " + e.what());
  }
  if (!in_flight.empty())
    std::fprintf(stderr, "kiln run: %s of rollouts in flight restored (%s)\n",
                 in_flight.size() == 1 ? "1 batch" : (std::to_string(in_flight.size()) + " batches").c_str(),
                 in_flight.size() == 1 ? ("step " + std::to_string(in_flight.front().step)).c_str()
                                       : ("steps " + std::to_string(in_flight.front().step) + ".." +
                                          std::to_string(in_flight.back().step)).c_str());
  if (state.step >= c.run.steps)
    throw std::invalid_argument("it holds steps 1.." + std::to_string(state.step) + " and run.steps is " +
                                std::to_string(c.run.steps) + ": nothing to train (raise run.steps to go on)");
  std::fprintf(stderr, "kiln run: resumed from %s at step %lld\n", ck.c_str(), (long long)state.step + 1);
  return state.step + 1;
}

// The current version as the engines take it: with its HF-named tensors unless they get the
// trainer's own (collective weight sync).
PolicyWeights engine_weights(Actors& a, bool copy) {
  return a.engines->needs_tensors() ? a.trainer->weights(copy) : PolicyWeights{a.trainer->version(), {}};
}

// What a run holds from start to end; start() fills it.
struct Session {
  Session(const Config& c, const std::string& tag)
      : signals(tag, c.placement.rollout_engines, c.run.output_dir),
        gateway({"controller", c.placement.mode == "multi_process" ? "ipc://" + tag + "-controller" : ""}),
        prompts(c) {}
  RunSignals signals;
  messaging::Gateway gateway;  // the graph root the nodes join
  Prompts prompts;
  std::unique_ptr<RunLock> lock;
  Actors actors;
  int64_t first_step = 1;
  std::vector<Batch> in_flight;  ///< restored from the checkpoint resumed from
};

// A step's rollouts held on the host: at least ~1 KiB per sequence (request, sampling state,
// completion, routed experts) and 64 bytes per token. Throws std::invalid_argument naming the
// keys when even that lower bound exceeds this machine's memory (instead of an OOM kill).
void check_memory(const AlgorithmConfig& a) {
  const double sequences = double(a.prompts_per_step) * double(a.samples_per_prompt);
  const double bytes = sequences * (1024.0 + 64.0 * double(a.max_new_tokens));
  const double physical = double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGE_SIZE));
  if (physical > 0 && bytes > physical) {
    char text[160];  // doubles: the product may be past int64 (prompts_per_step = 2^63 - 1)
    std::snprintf(text, sizeof text, "%.17g sequences of up to %lld new tokens need at least %.0f GiB", sequences,
                  (long long)a.max_new_tokens, bytes / double(1 << 30));
    throw std::invalid_argument("algorithm.prompts_per_step x samples_per_prompt = " + std::string(text) +
                                " per step; this machine has " + std::to_string(int64_t(physical / (1 << 30))) + " GiB");
  }
}

// A resume's settings that differ from those of the run that wrote the checkpoint
// (RUN/checkpoints/step_N's RUN/config.toml, else this directory's), on stderr: said, not taken
// silently.
void report_changed_settings(const Config& c, const fs::path& dir, const std::string& config_toml) {
  auto before = fs::path(c.run.resume_from).lexically_normal();
  if (!before.has_filename()) before = before.parent_path();
  before = before.parent_path().parent_path() / "config.toml";
  if (!fs::exists(before)) before = dir / "config.toml";
  std::ifstream in(before);
  if (!in.is_open()) return;
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  const auto changed = changed_settings(text, config_toml,
                                        {"run.resume_from", "run.steps", "run.overwrite", "run.output_dir",
                                         "run.checkpoint_every", "logging.plot", "logging.progress"});
  if (changed.empty()) return;
  std::string list;
  for (const auto& x : changed) list += "\n  " + x;
  std::fprintf(stderr, "kiln run: resuming with %zu setting(s) other than %s's (config.toml is rewritten with the new "
                       "ones when the first step is logged):%s\n", changed.size(), before.c_str(), list.c_str());
}

// Locks the run directory, places the actors, resumes, and brings the engines to the
// trainer's version. 0, or the exit code of a run that cannot start (reported on stderr).
int start(Session& s, const Config& c, const std::string& config_toml, const std::string& tag,
          parallel::ProcessGroups* ranks) {
  const fs::path dir(c.run.output_dir);
  try {  // nothing in the run directory changes here but RUN/.lock and the nodes' pid files (commit_run_dir)
    check_memory(c.algorithm);
    check_run_dir(dir, c.run.resume_from, c.run.overwrite, c.model.checkpoint);
    s.lock = std::make_unique<RunLock>(dir, c.run.resume_from, c.run.overwrite);
    s.actors = place_actors(c, {s.gateway, tag, dir}, ranks);
    if (s.prompts.vocab_size() > s.actors.trainer->vocab_size())
      throw std::invalid_argument("the vocabulary of " + s.prompts.tokenizer_source() + " (" +
                                  std::to_string(s.prompts.vocab_size()) + " ids) does not fit the model's (" +
                                  std::to_string(s.actors.trainer->vocab_size()) + " ids, " +
                                  (c.model.checkpoint.empty() ? "model.flavor '" + c.model.flavor + "'"
                                                              : "model.checkpoint '" + c.model.checkpoint + "'") +
                                  ")");
  } catch (const c10::Error& e) {  // LibTorch's (an allocation that failed): without its backtrace
    std::fprintf(stderr, "kiln run: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 2;
  }
  auto& trainer = *s.actors.trainer;
  if (!c.run.resume_from.empty()) {
    try {
      s.first_step = resume(c, trainer, s.prompts, s.in_flight);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kiln run: cannot resume from '%s': %s\n", c.run.resume_from.c_str(), e.what());
      return 2;
    }
  }
  if (!c.run.resume_from.empty()) report_changed_settings(c, dir, config_toml);
  try {  // the engines start from the trainer's current version (initial, or resumed)
    s.actors.engines->load(engine_weights(s.actors, false), trainer);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 1;
  }
  return 0;
}

// The run directory made this run's, once its first step has a row to log (commit_run_dir):
// before that, a start or a first step that fails leaves config.toml, the metrics rows and
// TensorBoard events of the steps a resume trains again, and the checkpoints an overwrite
// replaces, as they were; a directory the run made holds nothing of its own (RunLock removes
// it). In order, renames first, what cannot be undone last: a resume's checkpoints of the steps
// it trains again set aside (supersede_checkpoints: renamed, no advice leads back to them), or an
// overwrite's (set_aside_checkpoints: renamed, put back if what follows fails); config.toml
// (written beside itself and renamed: a failed write leaves the old one whole); the metrics
// files (open() drops the rows and events a resume trains again, truncates them otherwise);
// then the replaced run's checkpoints deleted (delete_replaced_checkpoints).
void commit_run_dir(const Config& c, const fs::path& dir, const std::string& config_toml, int64_t first_step,
                    MetricsLog& log) {
  std::error_code ec;
  const auto run = fs::weakly_canonical(dir, ec);  // "RUN/checkpoints/..": the asides are found beside the real one
  const auto& where = ec ? dir : run;
  if (!c.run.resume_from.empty())
    for (const auto& p : supersede_checkpoints(where, first_step))
      std::fprintf(stderr, "kiln run: %s: a checkpoint of a step trained again now, set aside\n", p.c_str());
  const bool overwrite = c.run.overwrite && c.run.resume_from.empty();
  const auto aside = overwrite ? set_aside_checkpoints(where) : fs::path();
  try {
    replace_file(where / "config.toml", config_toml);
    log.open();
  } catch (...) {
    if (!aside.empty() && !put_back_checkpoints(where, aside))
      std::fprintf(stderr, "kiln run: the replaced run's checkpoints stay in '%s' (they could not be renamed back)\n",
                   aside.c_str());
    throw;
  }
  if (overwrite)
    for (const auto& line : delete_replaced_checkpoints(where, aside)) std::fprintf(stderr, "kiln run: %s\n", line.c_str());
}
}  // namespace

int run(const Config& c, const std::string& config_toml, parallel::ProcessGroups* ranks) {
  try {
    c.validate();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 2;
  }
  const fs::path dir(c.run.output_dir);
  const auto& a = c.algorithm;
  const std::string tag = "/tmp/kiln-run-" + std::to_string(::getpid());
  Session s(c, tag);
  if (const int rc = start(s, c, config_toml, tag, ranks)) return rc;
  auto& trainer = *s.actors.trainer;
  auto& prompts = s.prompts;
  auto& actors = s.actors;
  const int64_t first_step = s.first_step;
  std::optional<MetricsLog> metrics;
  try {
    metrics.emplace(dir, first_step);
  } catch (const std::exception& e) {  // e.g. a directory named metrics.jsonl: refused, nothing trained or written
    std::fprintf(stderr, "kiln run: %s\n", e.what());
    return 2;
  }
  auto& log = *metrics;
  const Stopwatch run_clock;
  std::string rng_consumed = prompts.state();  // after the last batch trained: what a checkpoint holds
  int64_t nonfinite_in_a_row = 0;
  LastCheckpoint last_checkpoint;
  if (!c.run.resume_from.empty()) last_checkpoint = {first_step - 1, fs::path(c.run.resume_from)};
  // After the policy was lost: where to continue from. Before the first row a run started over
  // another (run.overwrite) has not replaced it, and its checkpoints are not this run's.
  const auto lost_hint = [&] {
    if (!log.is_open() && c.run.resume_from.empty())
      return "kiln run: no step of this run was logged: start again" + overwrite_advice(dir) + "\n";
    return continue_hint(dir, last_checkpoint.dir);
  };
  RolloutStream rollouts(
      [&](int64_t step, const std::function<void()>& between_steps) {
        const Stopwatch t;
        auto d = prompts.draw(step);
        Batch b{step, std::move(d.problems), actors.engines->generate(std::move(d.requests), between_steps), 0,
                std::move(d.rng_after)};
        b.rollout_time = t.seconds();
        return b;
      },
      [&](const PolicyWeights& w) { actors.engines->load(w, trainer); }, first_step, c.run.steps, a.staleness,
      std::move(s.in_flight));
  RunSignals::begin_steps();
  for (int64_t step = first_step; step <= c.run.steps; ++step) {
    if (RunSignals::interrupted()) return stop_on_interrupt(trainer, dir, step - 1, first_step, rng_consumed, rollouts, last_checkpoint);
    StepRow row{.step = step};
    Batch batch;
    std::vector<std::vector<float>> ref;
    try {
      batch = rollouts.take(step);
      const Stopwatch t;
      ref = actors.reference->logprobs(batch.completions);
      row.ref_logprob_time = t.seconds();
    } catch (const PolicyLost& e) {  // colocated engines or reference: a trainer rank is gone, and with it
      // the policy's state since the last checkpoint (a save would wait out the collective timeout)
      std::fprintf(stderr, "kiln run: step %lld: %s\n%s", (long long)step, e.what(),
                   lost_hint().c_str());
      return 1;
    } catch (const std::exception& e) {
      return stop_with_checkpoint(trainer, dir, step, e.what(), step - 1, rng_consumed, rollouts, last_checkpoint);
    }
    Groups groups;
    try {  // a reward the verifier made non-finite is refused by name
      const auto rewards = prompts.rewards(batch.problems, batch.completions);
      summarize(row, rewards, batch.completions, ref, c.trainer.loss.kl_estimator);
      row.staleness_histogram = staleness_histogram(batch.completions, trainer.version());
      groups = build_groups(batch.completions, rewards, std::move(ref), a, trainer.version());
    } catch (const std::exception& e) {
      return stop_with_checkpoint(trainer, dir, step, e.what(), step - 1, rng_consumed, rollouts, last_checkpoint);
    }
    row.filtered_groups = groups.filtered;
    row.stale_dropped_groups = groups.stale_dropped;
    row.trained_samples = int64_t(groups.samples.size());
    std::string sync_error;
    if (groups.samples.empty()) {
      rollouts.consumed(step, std::nullopt);
    } else {  // (a step whose loss or gradient is not finite is skipped: no new version to send)
      try {
        row.train = trainer.train(std::move(groups.samples));
      } catch (const PolicyLost& e) {  // its state since the last checkpoint went with it
        std::fprintf(stderr, "kiln run: step %lld: %s\n%s", (long long)step, e.what(),
                   lost_hint().c_str());
        return 1;
      } catch (const std::exception& e) {
        return stop_with_checkpoint(trainer, dir, step, e.what(), step - 1, rng_consumed, rollouts, last_checkpoint);
      }
      if (a.update_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.update_delay_ms));
      try {  // k = 0: into the engines now; k > 0: the rollout thread loads them between decode steps
        const Stopwatch t;
        if (row.train.skipped_nonfinite) rollouts.consumed(step, std::nullopt);
        else rollouts.consumed(step, engine_weights(actors, /*copy=*/a.staleness > 0));
        row.update_weights_time = t.seconds();
      } catch (const std::exception& e) {  // the step is trained: log it, checkpoint it, then stop
        sync_error = e.what();
        row.update_weights_time = -1;
      }
    }
    rng_consumed = batch.rng_after;
    row.rollout_time = batch.rollout_time;
    row.policy_version = trainer.version();
    row.elapsed_s = run_clock.seconds();
    if (!log.is_open()) {  // the first row: the run directory becomes this run's
      try {
        commit_run_dir(c, dir, config_toml, first_step, log);
      } catch (const std::exception& e) {  // the step is not logged: nothing of it is kept
        return stop_with_checkpoint(trainer, dir, step, e.what(), step - 1, rng_consumed, rollouts, last_checkpoint);
      }
    }
    try {
      log.write(row);
    } catch (const std::exception& e) {  // the step is trained; its row could not be written
      return stop_with_checkpoint(trainer, dir, step, std::string(e.what()) + " (this step's metrics row is incomplete)",
                                  step, batch.rng_after, rollouts, last_checkpoint);
    }
    if (!sync_error.empty()) return stop_with_checkpoint(trainer, dir, step, sync_error, step, batch.rng_after, rollouts, last_checkpoint);
    nonfinite_in_a_row = row.train.skipped_nonfinite ? nonfinite_in_a_row + 1 : 0;
    if (a.max_nonfinite_steps > 0 && nonfinite_in_a_row >= a.max_nonfinite_steps)
      return stop_with_checkpoint(trainer, dir, step,
                                  std::to_string(nonfinite_in_a_row) + " steps in a row skipped (algorithm.max_nonfinite_steps): " +
                                      row.train.skip_reason,
                                  step, batch.rng_after, rollouts, last_checkpoint);
    if (c.run.checkpoint_every > 0 && step % c.run.checkpoint_every == 0) {
      const auto since = fs::file_time_type::clock::now();
      try {
        // k > 0: with the batches generated for the next steps (a resumed run trains on them)
        trainer.save(checkpoint_dir(dir, step),
                     {step, 0, batch.rng_after, encode_in_flight(rollouts.in_flight(step, /*wait=*/true))});
        last_checkpoint = {step, checkpoint_dir(dir, step)};
      } catch (const std::exception& e) {
        std::fprintf(stderr, "kiln run: step %lld: %s\n%s", (long long)step,
                     save_failure(checkpoint_dir(dir, step), since, e.what()).c_str(),
                     continue_hint(dir, last_checkpoint.dir).c_str());
        return 1;
      }
    }
    if (c.logging.progress) MetricsLog::print_progress(row, c.run.steps, a.prompts_per_step);
  }
  if (c.logging.plot) log.plot();
  std::fprintf(stderr, "kiln run: done in %.1fs; metrics in %s\n", run_clock.seconds(), (dir / "metrics.jsonl").c_str());
  return 0;
}

}  // namespace kiln::controller
