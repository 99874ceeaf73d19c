#include "messaging/replay_frames.hpp"

#include <stdexcept>

#include "messaging/torch_tensor.hpp"

namespace kiln::messaging {

std::vector<Tensor> replay_frames(const std::vector<torch::Tensor>& routed_experts,
                                  const std::vector<torch::Tensor>& topk_indices) {
  std::vector<Tensor> out;
  bool selections = topk_indices.size() == routed_experts.size();
  for (std::size_t i = 0; i < routed_experts.size(); ++i) {
    if (!routed_experts[i].defined()) return {};
    selections = selections && topk_indices[i].defined();
  }
  for (std::size_t i = 0; i < routed_experts.size(); ++i)
    out.push_back(from_torch("routed_experts." + std::to_string(i), routed_experts[i].to(torch::kInt64).contiguous()));
  if (selections)
    for (std::size_t i = 0; i < topk_indices.size(); ++i)
      out.push_back(from_torch("topk_indices." + std::to_string(i), topk_indices[i].to(torch::kInt64).contiguous()));
  return out;
}

ReplayTensors read_replay_frames(const std::vector<Tensor>& frames, const std::vector<int64_t>& rows,
                                 const std::string& what) {
  const std::size_t n = rows.size();
  ReplayTensors r;
  if (frames.empty()) return r;
  if (frames.size() != n && frames.size() != 2 * n)
    throw std::invalid_argument(what + ": " + std::to_string(frames.size()) + " replay tensors for " + std::to_string(n) +
                                " samples (expected 0, " + std::to_string(n) + " or " + std::to_string(2 * n) + ")");
  for (std::size_t k = 0; k < frames.size(); ++k) {
    const auto& t = frames[k];
    const std::size_t i = k % n;
    const bool experts = k < n;
    if (t.dtype != DType::int64 || t.shape.size() != 3 || t.shape[0] != rows[i])
      throw std::invalid_argument(what + ": " + (experts ? "routed experts" : "topk indices") + " '" + t.name +
                                  "' must be I64 [P + n - 1 = " + std::to_string(rows[i]) +
                                  (experts ? ", L, K]" : ", Ls, W]") + " (sample " + std::to_string(i) + ")");
    (experts ? r.routed_experts : r.topk_indices).push_back(to_torch(t).clone());
  }
  return r;
}

}  // namespace kiln::messaging
