#pragma once
// The actors in `kiln node` child processes (placement.mode = "multi_process"): engines as
// rollout/0..N-1, the reference as ref/0, the trainer as trainer/0. Each handle starts its
// node(s) (the nodes join the controller's gateway, the graph root, and exit with it), sends
// the init message and then drives the actor with requests. A node that dies fails the
// request in flight at once (peer loss), with an error naming the node.
#include <sys/types.h>

#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <optional>

#include "actors/controller/config.hpp"
#include "actors/controller/handles.hpp"
#include "actors/rollout/messages.hpp"
#include "messaging/gateway.hpp"

namespace kiln::controller {

/// Where the run's nodes live: the controller's gateway (the root they join), the run's
/// socket tag (/tmp/kiln-run-PID: nodes bind ipc://TAG-SUFFIX) and directory (pid files).
struct NodeSite {
  messaging::Gateway& gateway;
  std::string tag;
  std::filesystem::path dir;
};

/// A `kiln node` child process hosting one actor (`kiln node --name SUFFIX-node --bind
/// ipc://TAG-SUFFIX --join ROOT --actor ACTOR --exit-with-parent PID`). Its pid is written to
/// DIR/PIDFILE. Stopped (SIGTERM, SIGKILL after 5 s) on destruction.
class Node {
 public:
  /// Starts the node and waits until its actor joined (up to 60 s; a node that exits first
  /// is reported at once). Throws std::runtime_error naming the actor.
  Node(const NodeSite& site, const std::string& suffix, const std::string& actor, const std::string& pidfile);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
  const std::string& actor() const { return actor_; }
  /// The process has not exited (it may still be unresponsive).
  bool alive();

 private:
  void stop();
  std::string actor_;
  pid_t pid_ = -1;
};

/// The trainer in a node (trainer/0): it builds the seeded initial policy itself, trains on
/// the batches sent to it, streams each version to engines and reference, writes checkpoints.
/// Failures of the node itself throw PolicyLost; a push target's failure std::runtime_error.
class RemoteTrainer : public TrainerHandle {
 public:
  RemoteTrainer(const NodeSite& site, const Config& config);
  int64_t version() const override { return version_; }
  int64_t vocab_size() const override { return vocab_size_; }
  RoutingShape routing_shape() const override { return routing_; }
  trainer::StepMetrics train(std::vector<trainer::Sample> samples) override;
  PolicyWeights weights(bool) override { return {version_.load(), {}}; }  ///< the node streams them
  void send(const PolicyWeights& w, const std::vector<std::string>& targets) override;
  void save(const std::filesystem::path& dir, const trainer::CheckpointState& state) override;
  trainer::CheckpointState load(const std::filesystem::path& dir) override;

 private:
  messaging::Envelope call(messaging::Envelope request, std::chrono::seconds timeout);
  messaging::Gateway& gw_;
  Node node_;
  std::atomic<int64_t> version_{0};
  int64_t vocab_size_ = 0;
  RoutingShape routing_;
};

/// placement.rollout_engines engines, each in a node (rollout/0..N-1); each request's prompt
/// groups are split into contiguous shares, all engines generate at once.
///
/// Supervised: an engine node that is lost (its process died, or it stopped answering: a
/// `peer_lost` or `timeout`) is restarted, up to placement.engine_restarts times in a row
/// with backoff 0.5 s, 1 s, 2 s, ... up to 30 s (a share generated in full resets the count). The new
/// node is built with rollout.init, gets the weights last loaded into the engines from the
/// trainer, and generates the lost node's share again: the same requests with the same seeds,
/// so with staleness 0 its completions equal the ones that were lost. Nothing of the lost
/// share was returned, so no sample is lost or delivered twice.
/// With weight_sync.transport = "collective" the weights go over a c10d broadcast group (NCCL
/// between GPUs, Gloo on CPU: weight_sync/collective.hpp) of the trainer and every engine,
/// formed once the engines are up and formed again after an engine restart.
class RemoteEngines : public RolloutEngines {
 public:
  /// `trainer`: for collective weight sync, the device of its policy.
  RemoteEngines(const NodeSite& site, const Config& config, TrainerHandle& trainer);
  std::vector<rollout::Completion> generate(std::vector<rollout::GenerationRequest> requests,
                                            const std::function<void()>& between_steps) override;
  void load(const PolicyWeights& w, TrainerHandle& trainer) override;
  bool needs_tensors() const override { return !collective_; }

 private:
  /// Starts node i and sends it rollout.init (waits for it up to 60 s).
  void start_node(std::size_t i);
  /// Replaces lost node i (after `what` went wrong): backoff, a new node, the current weights.
  /// Throws std::runtime_error naming the engine when the restarts in a row are used up, or
  /// PolicyLost when the trainer is lost meanwhile.
  void restart(std::size_t i, const std::string& what);
  /// `w` into the engines `targets` (collective: into every engine, forming the group first
  /// when an engine was replaced).
  void push(const PolicyWeights& w, const std::vector<std::string>& targets);
  std::vector<std::string> actors() const;
  NodeSite site_;
  std::unique_ptr<weight_sync::CollectiveSender> collective_;
  bool regroup_ = false;  ///< an engine was replaced since the group formed
  messaging::RolloutInit init_;
  std::vector<std::string> devices_;  // engine i's device (placement.rollout_device)
  int64_t group_size_;
  int64_t max_restarts_;
  std::vector<std::unique_ptr<Node>> nodes_;
  std::vector<int64_t> restarts_in_a_row_;
  std::optional<PolicyWeights> loaded_;  ///< the version last loaded into the engines
  TrainerHandle* trainer_ = nullptr;     ///< who sent it
};

/// The reference in a node (ref/0), loaded with the trainer's initial weights.
class RemoteReference : public ReferencePolicy {
 public:
  RemoteReference(const NodeSite& site, const Config& config, TrainerHandle& initial);
  std::vector<std::vector<float>> logprobs(const std::vector<rollout::Completion>& completions) override;

 private:
  messaging::Gateway& gw_;
  bool routing_replay_;
  Node node_;
};

}  // namespace kiln::controller
