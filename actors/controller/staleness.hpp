#pragma once
// The staleness bound of asynchronous RL: never train policy version t on tokens sampled by a
// version older than t - k (k = algorithm.staleness; AReaL, arXiv:2505.24298, calls this the
// maximum staleness eta). Every token carries the version that sampled it.
#include <cstdint>
#include <map>
#include <vector>

#include "actors/rollout/backend.hpp"

namespace kiln::controller {

/// Tokens by age in versions (trainer_version - the token's version), over all completions.
std::map<int64_t, int64_t> staleness_histogram(const std::vector<rollout::Completion>& completions,
                                               int64_t trainer_version);

/// Whether any token of completions[first .. first + count) is more than `k` versions older
/// than `trainer_version` (the group must then be dropped).
bool too_stale(const std::vector<rollout::Completion>& completions, std::size_t first, std::size_t count,
               int64_t trainer_version, int64_t k);

}  // namespace kiln::controller
