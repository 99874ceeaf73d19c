#pragma once
// The replay tensors of a list of n samples (or completions) as a message's tensor frames, one
// layout for rollout.result, ref.logprobs and trainer.train (docs/wire-format.md): frame i
// (i < n) is item i's routed experts "routed_experts.i" [P + n - 1, L, K] I64; when every item
// also has sparse-attention selections (glm5_next's indexer top-k), frames n + i are
// "topk_indices.i" [P + n - 1, Ls, W] I64. No frames when an item has no routed experts (the
// receiver then routes, and selects, itself).
#include <string>
#include <vector>

#include <torch/torch.h>

#include "messaging/tensor.hpp"

namespace kiln::messaging {

/// Frames for items with `routed_experts` and `topk_indices` (same length; undefined entries allowed).
std::vector<Tensor> replay_frames(const std::vector<torch::Tensor>& routed_experts,
                                  const std::vector<torch::Tensor>& topk_indices);

/// What a receiver reads back: each list empty (not sent) or one tensor per item (int64, owning).
struct ReplayTensors {
  std::vector<torch::Tensor> routed_experts, topk_indices;
};

/// Reads `frames` of `rows.size()` items, item i having rows[i] = P + n - 1 rows. Throws
/// std::invalid_argument "WHAT: ..." naming the frame for a count other than 0, n or 2n, a
/// dtype other than I64, or a shape other than [rows[i], *, *].
ReplayTensors read_replay_frames(const std::vector<Tensor>& frames, const std::vector<int64_t>& rows,
                                 const std::string& what);

}  // namespace kiln::messaging
