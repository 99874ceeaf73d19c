#pragma once
// GRPO group building (DeepSeekMath, arXiv:2402.03300 §4.1.2): the n completions of one prompt
// form a group; rewards -> group-relative advantages (trainer::grpo_advantages) -> groups
// whose rewards are all equal dropped (they carry no signal: DAPO's dynamic sampling filter,
// arXiv:2503.14476) -> groups past the staleness bound dropped (staleness.hpp) -> training
// samples. Legend: G prompts (groups) of a step, n samples per prompt, S = G * n.
#include <cstdint>
#include <vector>

#include "actors/controller/config.hpp"
#include "actors/rollout/backend.hpp"
#include "actors/trainer/trainer.hpp"

namespace kiln::controller {

struct Groups {
  std::vector<trainer::Sample> samples;  ///< the kept groups' samples, in completion order
  int64_t filtered = 0;                  ///< groups dropped for zero reward variance
  int64_t stale_dropped = 0;             ///< groups dropped for tokens past the staleness bound
};

/// completions [S] sorted by id (= prompt * n + sample), rewards [S], ref_logprobs [S][tokens]
/// (the reference policy's, or empty per sample when unused); `trainer_version`: the policy
/// the samples will train. Throws std::invalid_argument when the sizes do not fit.
Groups build_groups(const std::vector<rollout::Completion>& completions, const std::vector<float>& rewards,
                    std::vector<std::vector<float>> ref_logprobs, const AlgorithmConfig& algorithm,
                    int64_t trainer_version);

}  // namespace kiln::controller
