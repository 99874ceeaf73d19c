#pragma once
// The temperature bound shared by the samplers and the trainer's log-prob head (torch-free, so
// that configuration checks can use it).

namespace kiln::model {

/// The smallest temperature that logits are divided by (0 means greedy where a sampler takes
/// it). Below it sampling is greedy in practice (vLLM samples greedily under 1e-5), and far
/// below it logits / temperature overflow fp32 into NaN log-probs (1e-300 rounds to 0 in fp32).
inline constexpr double kMinTemperature = 1e-5;

}  // namespace kiln::model
