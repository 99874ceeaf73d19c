#pragma once
// The trainer over several ranks as the controller sees it (parallel.dp x parallel.ep > 1).
// Rank 0 trains in the controller's process (a LocalTrainer over the ranks' mesh: data
// parallel, or expert parallel when ep > 1) and drives ranks 1..W-1, each a
// TrainerService in its own process (experiments/ranks.hpp, actor trainer/R): every request
// that changes the policy (init, train, load, save) goes to every other rank first, then all
// of them run it together, meeting in the group's collectives. ZeroMQ carries the requests,
// c10d (Gloo on CPU, NCCL on CUDA) the tensors. Each rank publishes its ZeroMQ endpoint in the
// job's TCPStore (key kTrainerRankEndpointKey + R), so the actor graph needs no second
// rendezvous. Rank 0 holds the whole dense policy (ZeRO-2: only gradients and AdamW state are
// sharded), so weights for the engines and the reference come from it; with expert parallel
// every rank takes part in gathering the full experts (trainer.gather_weights) while rank 0
// reads them.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/controller/config.hpp"
#include "actors/controller/local_handles.hpp"
#include "parallel/process_group.hpp"

namespace kiln::controller {

/// Store keys (under the job store's "kiln/" prefix): rank R's trainer endpoint; set by rank
/// 0 when the run is over (value: its exit code); set by rank R once it stopped serving.
inline constexpr const char* kTrainerRankEndpointKey = "trainer_rank/";
inline constexpr const char* kRunOverKey = "run_over";
inline constexpr const char* kRankDoneKey = "rank_done/";

class DataParallelTrainer : public TrainerHandle {
 public:
  /// `groups`: rank 0's process groups with mesh dimensions "dp" and "ep" (held by reference). Waits up to
  /// config.parallel.store_timeout_s for every rank's endpoint, sends each trainer.init, then
  /// builds rank 0's policy (seeded as a one-rank run) and trainer; every rank's parameters
  /// become rank 0's. Throws std::runtime_error naming a rank that published no endpoint or
  /// could not build its trainer.
  DataParallelTrainer(const Config& config, parallel::ProcessGroups& groups, messaging::Gateway& gateway);
  int64_t version() const override { return local_->version(); }
  int64_t vocab_size() const override { return local_->vocab_size(); }
  RoutingShape routing_shape() const override { return local_->routing_shape(); }
  /// Collective over the ranks. Throws PolicyLost naming the rank(s) lost (a process that died
  /// or stopped answering) or a rank whose step failed where rank 0's did not (the ranks no
  /// longer agree); rank 0's own refusal of the batch as LocalTrainer does (every rank
  /// refuses it alike).
  trainer::StepMetrics train(std::vector<trainer::Sample> samples) override;
  /// Expert parallel: collective over the ranks (they gather the full experts with rank 0).
  PolicyWeights weights(bool copy) override;
  void send(const PolicyWeights& w, const std::vector<std::string>& targets) override { local_->send(w, targets); }
  torch::Device policy_device() const override { return local_->policy_device(); }
  /// Expert parallel: collective over the ranks (they gather the experts into rank 0's buckets,
  /// trainer.sync_experts).
  void send_collective(weight_sync::CollectiveSender& sender) override;
  /// Collective: every rank writes its optimizer shard into `dir` (one filesystem the ranks
  /// share), rank 0 the policy and the loop state (trainer/checkpoint.hpp).
  void save(const std::filesystem::path& dir, const trainer::CheckpointState& state) override;
  /// Collective: every rank loads the policy and the optimizer shards that overlap its range
  /// (a checkpoint written at any number of ranks).
  trainer::CheckpointState load(const std::filesystem::path& dir) override;
  /// Collective: whole prompt groups to each rank (prompt_group_shares, rank order), every
  /// rank generating its share on its colocated engine (trainer.generate), rank 0 here.
  std::vector<rollout::Completion> generate_colocated(std::vector<rollout::GenerationRequest> requests,
                                                      const rollout::EngineOptions& engine, int64_t group_size,
                                                      const std::function<void()>& between_steps) override;
  /// Collective: contiguous shares of `completions` to each rank (as even as the count
  /// allows), every rank's frozen reference computing its share (ref.logprobs), rank 0 here.
  std::vector<std::vector<float>> reference_logprobs(const std::vector<rollout::Completion>& completions) override;

 private:
  /// Sends `request` to every other rank, runs `here` in this process, then waits for every
  /// answer; returns the answers of ranks 1..R-1 in rank order; throws as train() says, `what`
  /// naming the request. A rank lost while `here` runs aborts this rank's groups (NCCL: the
  /// collective `here` waits in ends at once); once a rank is lost the others get 3 s more.
  std::vector<messaging::Envelope> on_all_ranks(const std::string& what, const std::function<messaging::Envelope(const std::string& actor)>& request,
                    const std::function<void()>& here, std::chrono::seconds timeout);

  /// The rank of trainer actor `actor` ("trainer/R" -> R).
  std::size_t rank_of(const std::string& actor) const;

  messaging::Gateway& gw_;
  parallel::ProcessGroups& groups_;  ///< aborted when a rank is lost while rank 0 runs its part
  std::vector<std::string> actors_, endpoints_;  ///< [R - 1]: trainer/R and where it listens
  std::chrono::milliseconds collective_timeout_;
  bool expert_parallel_ = false;
  std::unique_ptr<LocalTrainer> local_;
};

}  // namespace kiln::controller
