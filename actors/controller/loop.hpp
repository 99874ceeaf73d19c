#pragma once
// The RL loop (the controller): for each step, prompts -> engines (rollouts) -> verifier
// (rewards) -> reference log-probs -> GRPO groups -> trainer (one optimizer step) -> weight
// sync to the engines -> metrics and checkpoints. Asynchronous with a staleness bound when
// algorithm.staleness > 0 (rollout_stream.hpp). The actors are reached through handles that
// placement picks once (placement.hpp); the loop itself knows nothing of processes.
#include <string>

#include "actors/controller/config.hpp"

namespace kiln::parallel {
class ProcessGroups;
}

namespace kiln::controller {

/// Runs `config` (validated here) into config.run.output_dir, which gets `config_toml` as
/// config.toml, metrics.jsonl / metrics.tsv / reward_kl.png (metrics.hpp) and checkpoints.
/// Returns the process exit code: 0 done; 2 a bad configuration or a run that cannot start
/// (reported on stderr, naming the key or what failed); 1 a run that failed after it started
/// (a lost node, a failed weight sync): everything trained so far is checkpointed where the
/// policy still lives, and stderr says how to continue (--set run.resume_from=...).
/// `ranks`: with config.parallel.dp > 1, rank 0's process groups (experiments/ranks.hpp
/// starts the ranks and calls this on rank 0); null otherwise.
int run(const Config& config, const std::string& config_toml, parallel::ProcessGroups* ranks = nullptr);

}  // namespace kiln::controller
