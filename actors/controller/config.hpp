#pragma once
// An RL run's configuration: one struct per component, nested here once. Experiment files
// (experiments/experiment.hpp) read and write it as TOML; the init messages carry its parts
// as they are (model::ModelSpec, trainer::TrainerConfig, rollout::EngineOptions). Every field
// has a default: together they are the built-in default experiment. docs/experiments.md
// lists every key. Torch-free.
#include <cstdint>
#include <string>
#include <vector>

#include "actors/rollout/engine_options.hpp"
#include "actors/trainer/trainer_config.hpp"
#include "model/model_spec.hpp"

namespace kiln::controller {

struct RunConfig {
  std::string name = "default";
  std::string output_dir = "runs/default";
  int64_t seed = 1;
  int64_t steps = 100;
  int64_t checkpoint_every = 0;  ///< 0: no checkpoints
  std::string resume_from;       ///< a checkpoint directory written by a run (RUN/checkpoints/step_N)
  /// Replace a finished run in output_dir (its metrics and checkpoints); without it, a run
  /// directory that holds a run is refused unless resuming.
  bool overwrite = false;
};

struct TaskConfig {
  std::string name = "next_digit";             ///< "next_digit" | "arithmetic" | "countdown" | "jsonl"
  int64_t min_digits = 1, max_digits = 1;      ///< arithmetic
  std::string operators = "+";                 ///< arithmetic
  std::string path;                            ///< jsonl: the dataset, one JSON object per line
  std::string prompt_field = "question";       ///< jsonl: the prompt's field (a string)
  std::string answer_field = "answer";         ///< jsonl: the answer's field (GSM8K: "... #### 72")
  /// A model's tokenizer.json; empty: the character tokenizer (its alphabet grown by the
  /// characters of a jsonl dataset's prompts).
  std::string tokenizer;
  /// How prompts are formatted: "glm47" | "glm4" (a user turn and the generation prompt; needs
  /// `tokenizer`) | "none" (the text as it is).
  std::string chat_template = "none";
};

/// The controller's part of the algorithm: prompts, sampling, GRPO groups, staleness.
/// (Its keys share the [algorithm] section with the trainer's: trainer::TrainerConfig.)
struct AlgorithmConfig {
  int64_t prompts_per_step = 32;
  int64_t samples_per_prompt = 16;   ///< GRPO group size
  double top_p = 1.0;                ///< sampling (the temperature is the trainer's logprobs.temperature)
  int64_t top_k = 0;
  int64_t max_new_tokens = 1;
  bool normalize_std = true;         ///< advantages divided by the group's std
  bool filter_zero_variance = true;  ///< drop groups whose rewards are all equal
  int64_t staleness = 0;             ///< k: 0 = synchronous, else rollouts run up to k versions ahead
  int64_t update_delay_ms = 0;       ///< testing: sleep after each policy update (a slow trainer)
  /// Steps in a row whose loss or gradient norm is not finite (skipped: the policy unchanged)
  /// after which the run stops with a checkpoint; 0: never stop for them.
  int64_t max_nonfinite_steps = 3;
};

struct RolloutConfig {
  /// "engine": kiln's LibTorch engine, in this process or in kiln node processes (placement);
  /// "http": servers speaking SGLang's native API at `urls` (`kiln serve`, or SGLang itself:
  /// actors/controller/http_engines.hpp, docs/serving.md)
  std::string backend = "engine";
  rollout::EngineOptions engine{1024, 16, 512};
  std::vector<std::string> urls;  ///< http: the servers, e.g. "http://127.0.0.1:30000"
  /// http: seconds one /generate may take, retries included (a dead server is reported then)
  int64_t http_timeout_s = 900;
  /// http: seconds a server may be unreachable (connection refused or lost) before it counts as
  /// lost; requests are retried with backoff meanwhile
  int64_t http_retry_s = 30;
  /// http: where each policy version is written (HF layout) for the servers'
  /// /update_weights_from_disk; they must see it at the same path. "": RUN/rollout_weights
  std::string weights_dir;
  /// http: how new weights reach the servers (slime's and SGLang's words): "disk" (safetensors
  /// under weights_dir, /update_weights_from_disk) or "distributed" (a c10d group of the
  /// controller, rank 0, and every server, rank 1 + i, formed at start with
  /// /init_weights_update_group; each version broadcast tensor by tensor while
  /// /update_weights_from_distributed is in flight; Gloo on CPU, NCCL on CUDA)
  std::string weight_update = "disk";
  /// http, "distributed": the address the servers reach the controller's rendezvous store at
  std::string weight_update_address = "127.0.0.1";
  /// Seconds a weight-update group may take to form and each broadcast to complete: a lost
  /// server (controller side) or trainer (`kiln serve` side) fails an update within this.
  int64_t weight_update_timeout_s = 600;
};

struct WeightSyncConfig {
  double bucket_mib = 64;
  /// "messages": buckets as ZeroMQ messages (any placement); "collective": a c10d broadcast
  /// group of the trainer and the engine nodes (NCCL between GPUs, Gloo on CPU;
  /// weight_sync/collective.hpp), multi_process with the trainer in the controller only.
  std::string transport = "messages";
};

/// Where each actor runs: in the controller's process, or in `kiln node` child processes.
struct PlacementConfig {
  /// "single_process" | "multi_process" (engines in nodes) | "colocated" (an engine in each
  /// trainer rank over the trainer's own parameters: rollout::ColocatedEngine; no weight copies
  /// or sync; with parallel.ep > 1 the engines are expert-parallel in lockstep)
  std::string mode = "single_process";
  int64_t rollout_engines = 1;           ///< multi_process: engines, each a kiln node process
  /// multi_process: restarts of one engine node in a row, in [0, 20] (a lost node is restarted
  /// with backoff 0.5 s, 1 s, 2 s, ... up to 30 s, and its share regenerated; 0: a lost engine
  /// stops the run)
  int64_t engine_restarts = 3;
  /// "controller" | "process": ref/0 in a kiln node | "colocated": a frozen copy of the initial
  /// policy in each trainer rank, with expert parallel only its experts (trainer::FrozenReference)
  std::string reference = "controller";
  std::string trainer = "controller";    ///< "controller" | "process": trainer/0 in a kiln node
  /// multi_process: the engines' devices ("cpu", "cuda", "cuda:N"): one for every engine (one entry), or
  /// one per engine (engine i on entry i: data-parallel rollout over GPUs); empty: model.device
  std::vector<std::string> rollout_device;
  /// The device of engine i: its entry of rollout_device, the one entry, or model_device.
  std::string engine_device(std::size_t i, const std::string& model_device) const {
    if (rollout_device.empty()) return model_device;
    return rollout_device.size() == 1 ? rollout_device.front() : rollout_device.at(i);
  }
  /// reference = "process": the reference node's device ("cpu", "cuda", "cuda:N"); "": model.device
  std::string reference_device;
};

/// The trainer's ranks (docs/parallel.md): one process per rank (per GPU, or per CPU rank),
/// launched by `kiln run` itself, torchrun or Slurm's srun, meeting through a c10d TCPStore.
struct ParallelConfig {
  /// Data-parallel trainer ranks: each trains on its share of a step's samples, gradients and
  /// AdamW state sharded over them (trainer::Trainer with a dp group); rank 0 also runs the
  /// controller, the engines and the reference. Under torchrun or srun it must equal the
  /// launcher's world size; without a launcher `kiln run` starts ranks 1..dp-1 itself.
  int64_t dp = 1;
  /// Expert-parallel ranks per data-parallel replica: the routed experts split over `ep` ranks
  /// (all-to-all dispatch), the job then has dp x ep ranks, each training its share of the
  /// batch (torchtitan's mesh: ep borrows ranks from data parallel); its checkpoints are
  /// sharded. (parallel.fsdp, fully sharding the decoder layers, is trainer::TrainerConfig::fsdp:
  /// it travels to the ranks with the trainer's settings.)
  int64_t ep = 1;
  /// Without a launcher: the TCPStore's port on 127.0.0.1 (0: a free port).
  int64_t master_port = 0;
  int64_t store_timeout_s = 300;       ///< rendezvous: every rank connected, each group made
  int64_t collective_timeout_s = 600;  ///< any collective; a lost rank surfaces within this
};

struct LoggingConfig {
  bool progress = true;  ///< a line per step on stderr
  bool plot = true;      ///< RUN/reward_kl.png at the end (gnuplot)
};

struct Config {
  RunConfig run;
  model::ModelSpec model;
  TaskConfig task;
  AlgorithmConfig algorithm;
  /// Keys under [algorithm]: lr, clip_low, kl_coef, temperature, ... (the default experiment
  /// learns next_digit in ~60 steps at lr 2e-3).
  trainer::TrainerConfig trainer{.lr = 2e-3};
  RolloutConfig rollout;
  WeightSyncConfig weight_sync;
  PlacementConfig placement;
  ParallelConfig parallel;
  LoggingConfig logging;

  /// Checks ranges and combinations; throws std::invalid_argument
  /// "experiment: key 'section.key' <why>" for the first key that is wrong.
  void validate() const;
  /// The trainer's settings for this run (total_steps = run.steps for the lr schedule).
  trainer::TrainerConfig trainer_for_run() const;
  /// The rollout engines' settings for this run: rollout.engine with true_on_policy =
  /// algorithm.true_on_policy (one key for both sides).
  rollout::EngineOptions engine_for_run() const;
};

}  // namespace kiln::controller
