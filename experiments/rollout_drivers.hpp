#pragma once
// How `kiln run` gets its rollouts beyond the plain in-process engine: a rollout thread that
// runs ahead of the trainer within a staleness bound (AsyncRollout), and an engine in a
// `kiln node` child process (RolloutNode). Used by experiments/rl_run.cpp.
#include <sys/types.h>

#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "actors/rollout/engine.hpp"
#include "actors/trainer/trainer.hpp"
#include "actors/rollout/tasks.hpp"
#include "experiments/experiment.hpp"
#include "messaging/gateway.hpp"

namespace kiln::experiments {

/// One step's rollouts.
struct Batch {
  int64_t step = 0;
  std::vector<rollout::Problem> problems;
  std::vector<rollout::Completion> completions;  ///< sorted by id (= prompt * n + sample)
  double rollout_time = 0;                       ///< seconds
  std::string rng_after;  ///< prompt RNG state after drawing this batch (for checkpoints)
};

/// Asynchronous rollouts: a thread generates the batches of steps first..last in order,
/// running ahead of the trainer by at most `staleness` steps: it starts step s only once the
/// trainer has consumed step s - 1 - k, whose weights it applies first (weights are posted
/// before a step counts as consumed, and applied between decode steps). Tokens are therefore
/// at most k policy versions older than the trainer that learns from them.
class AsyncRollout {
 public:
  using Generate = std::function<Batch(int64_t step, const std::function<void()>& between_steps)>;
  /// Puts new weights into the engines (the in-process engine between decode steps, or the
  /// engine processes over the messaging layer); runs on the rollout thread.
  using Apply = std::function<void(std::vector<messaging::Tensor> weights, int64_t version)>;
  AsyncRollout(Apply apply, Generate generate, int64_t first, int64_t last, int64_t staleness);
  ~AsyncRollout();
  /// The batch of `step` (blocks until generated); rethrows a failure of the rollout thread.
  Batch take(int64_t step);
  /// `step` counts as consumed; `updated`: it made policy `version`, whose `weights` the rollout
  /// thread hands to Apply before its next decode step (empty when Apply fetches them itself,
  /// e.g. from a trainer node).
  void consumed(int64_t step, bool updated, std::vector<messaging::Tensor> weights, int64_t version);

 private:
  void apply_pending();
  void run(int64_t first, int64_t last);
  Apply apply_;
  Generate generate_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> ready_;
  std::optional<std::pair<std::vector<messaging::Tensor>, int64_t>> pending_;
  int64_t consumed_;
  const int64_t k_;
  bool stop_ = false;
  std::string error_;
  std::thread thread_;
};

/// Starts `kiln node --name NAME --bind ipc://TAG-SUFFIX --join GW --actor ACTOR` as a child
/// process, writes its pid to DIR/PIDFILE and waits until ACTOR joined. "" or an error message.
std::string spawn_node(messaging::Gateway& gw, const std::string& tag, const std::string& suffix,
                       const std::string& actor, const std::filesystem::path& dir, const std::string& pidfile,
                       pid_t& pid);
/// SIGTERM to a node spawned so, then wait for it; pid becomes -1 (idempotent).
void stop_node(pid_t& pid);

/// The reference policy in a `kiln node` child process (placement.reference = "process"),
/// hosted as actor ref/0: built from the experiment's model, loaded with the run's initial
/// policy weights (weight sync, checked), asked for per-token log-probs of completions.
class RefNode {
 public:
  ~RefNode() { stop(); }
  std::string start(messaging::Gateway& gw, const std::string& tag, const ExperimentConfig& c,
                    const std::filesystem::path& dir);
  static constexpr const char* kActor = "ref/0";
  /// result[i]: samples[i]'s completion log-probs. Throws std::runtime_error naming the node.
  std::vector<std::vector<float>> logprobs(messaging::Gateway& gw, const std::vector<rollout::Completion>& samples,
                                           bool routing_replay);
  void stop();

 private:
  pid_t pid_ = -1;
};

/// The trainer settings of an experiment, as trainer.init carries them (the one-process run
/// builds its trainer from the same message: trainer::trainer_config).
messaging::TrainerInit trainer_init(const ExperimentConfig& c);

/// The policy trainer in a `kiln node` child process (placement.trainer = "process"), hosted as
/// actor trainer/0: it builds the seeded initial policy, trains on the batches the controller
/// sends, pushes each version to the engines (and the initial one to the reference) itself,
/// and writes the checkpoints. Failures throw TrainerNodeError.
class TrainerNode {
 public:
  /// `target_failed`: the trainer is alive but a push target (named in what()) failed; else the
  /// trainer node itself failed or is gone (its state since the last checkpoint is lost).
  struct Error : std::runtime_error {
    Error(const std::string& what, bool target) : std::runtime_error(what), target_failed(target) {}
    bool target_failed;
  };
  ~TrainerNode() { stop(); }
  static constexpr const char* kActor = "trainer/0";
  /// Starts the node (pid in DIR/trainer_node.pid) and sends trainer.init. "" or an error.
  std::string start(messaging::Gateway& gw, const std::string& tag, const ExperimentConfig& c,
                    const std::filesystem::path& dir);
  int64_t version() const { return version_; }
  int64_t vocab_size() const { return vocab_size_; }
  /// One optimizer step; `log_probs_time` gets the separate pi_old pass's seconds (0: none).
  trainer::StepMetrics train(messaging::Gateway& gw, const std::vector<trainer::Sample>& samples,
                             double& log_probs_time);
  /// Streams the current version to each of `targets` (checked there; one trainer.push_weights,
  /// so the policy's HF tensors are taken once); returns that version.
  int64_t push(messaging::Gateway& gw, const std::vector<std::string>& targets);
  void save(messaging::Gateway& gw, const std::filesystem::path& dir, int64_t step, const std::string& prompt_rng);
  /// Loads a checkpoint into the node's policy and optimizer; returns the saved version.
  int64_t load(messaging::Gateway& gw, const std::filesystem::path& dir);
  void stop();

 private:
  messaging::Envelope call(messaging::Gateway& gw, messaging::Envelope request, std::chrono::seconds timeout,
                           bool target_call = false);
  pid_t pid_ = -1;
  int64_t version_ = 0, vocab_size_ = 0;
};

/// A rollout engine in a `kiln node` child process (placement.mode = "multi_process"), hosted
/// as actor rollout/INDEX.
class RolloutNode {
 public:
  ~RolloutNode() { stop(); }
  /// Starts the node, waits until it joined `gw` (the graph root) and built its engine; writes
  /// its pid to DIR/rollout_node.pid (index 0) or DIR/rollout_node_INDEX.pid. Returns an error
  /// message, or "" on success.
  std::string start(messaging::Gateway& gw, const std::string& tag, const ExperimentConfig& c,
                    const std::filesystem::path& dir, int64_t index = 0);
  std::string actor() const { return "rollout/" + std::to_string(index_); }
  /// A generate request in flight (send, then collect: several nodes work at once).
  struct Pending {
    std::future<messaging::Expected<messaging::Envelope>> reply;
    std::map<uint64_t, std::vector<int64_t>> prompts;  ///< by request id
    std::size_t count = 0;
  };
  Pending send_generate(messaging::Gateway& gw, const std::vector<rollout::GenerationRequest>& requests);
  /// The completions of `p` (sorted by id); throws std::runtime_error naming this node if it is
  /// lost or answers something that does not fit the requests.
  std::vector<rollout::Completion> collect(Pending& p);
  /// SIGTERM and wait (idempotent).
  void stop();

 private:
  pid_t pid_ = -1;
  int64_t index_ = 0;
};

}  // namespace kiln::experiments
