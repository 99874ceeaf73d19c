#include "actors/controller/staleness.hpp"

namespace kiln::controller {

std::map<int64_t, int64_t> staleness_histogram(const std::vector<rollout::Completion>& completions,
                                               int64_t trainer_version) {
  std::map<int64_t, int64_t> h;
  for (const auto& c : completions)
    for (auto v : c.policy_versions) ++h[trainer_version - v];
  return h;
}

bool too_stale(const std::vector<rollout::Completion>& completions, std::size_t first, std::size_t count,
               int64_t trainer_version, int64_t k) {
  for (std::size_t i = first; i < first + count; ++i)
    for (auto v : completions[i].policy_versions)
      if (trainer_version - v > k) return true;
  return false;
}

}  // namespace kiln::controller
