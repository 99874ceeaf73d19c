#pragma once
// Where each step's rollouts come from, and when new weights reach the engines.
//  - staleness k = 0 (synchronous, on-policy): a step's batch is generated when the loop asks
//    for it; new weights are loaded into the engines at once.
//  - k > 0: a rollout thread generates the batches of steps first..last in order, running
//    ahead of the trainer by at most k steps: it starts step s only once the trainer has
//    consumed step s - 1 - k, whose weights it loads first (weights are posted before a step
//    counts as consumed, and loaded between decode steps). Tokens are therefore at most k
//    policy versions older than the trainer that learns from them (staleness.hpp).
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "actors/controller/handles.hpp"
#include "actors/rollout/tasks.hpp"

namespace kiln::controller {

/// One step's rollouts.
struct Batch {
  int64_t step = 0;
  std::vector<rollout::Problem> problems;        ///< [prompts_per_step]
  std::vector<rollout::Completion> completions;  ///< sorted by id (= prompt * n + sample)
  double rollout_time = 0;                       ///< seconds
  std::string rng_after;  ///< prompt RNG state after drawing this batch (for checkpoints)
};

class RolloutStream {
 public:
  /// Generates a step's batch; `between_steps` must run between decode steps.
  using Generate = std::function<Batch(int64_t step, const std::function<void()>& between_steps)>;
  /// Puts a version into the engines (k > 0: on the rollout thread).
  using Load = std::function<void(const PolicyWeights& weights)>;
  /// `restored`: batches of steps first, first + 1, ... kept by the checkpoint this run resumes
  /// from (in_flight.hpp); they are delivered first, generation starts after them.
  RolloutStream(Generate generate, Load load, int64_t first, int64_t last, int64_t staleness,
                std::vector<Batch> restored = {});
  ~RolloutStream();
  /// The batch of `step` (k > 0: blocks until generated; batches made before a failure of the
  /// rollout thread are still delivered, the failure surfaces at its own step, rethrown).
  Batch take(int64_t step);
  /// `step` is consumed; `weights`: the version it made (none if it trained nothing). k = 0:
  /// loaded now (throws what Load throws); k > 0: loaded by the rollout thread before its next
  /// decode step.
  void consumed(int64_t step, std::optional<PolicyWeights> weights);
  /// The batches generated but not taken, for a checkpoint of steps 1..`step`: those of steps
  /// step + 1, step + 2, ... in order (none unless the first is step + 1). `wait`: first
  /// waits until the batches through step + k are generated (those whose generation began
  /// before `step`'s weights existed: a run resumed from the checkpoint could not make them
  /// again) or the rollout thread has failed or ended.
  std::vector<Batch> in_flight(int64_t step, bool wait);

 private:
  void load_pending();
  void run(int64_t first, int64_t last);
  Generate generate_;
  Load load_;
  const int64_t k_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> ready_;
  std::optional<PolicyWeights> pending_;
  int64_t consumed_;
  int64_t last_;
  bool stop_ = false;
  bool done_ = false;  ///< the rollout thread has ended
  std::string error_;
  std::thread thread_;  // k > 0 only
};

}  // namespace kiln::controller
