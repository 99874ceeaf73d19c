#include "actors/rollout/weight_update_groups.hpp"

namespace kiln::rollout {

WeightUpdateGroups::WeightUpdateGroups(parallel::GroupOptions options) : options_(options) {}
WeightUpdateGroups::~WeightUpdateGroups() = default;

void WeightUpdateGroups::init(const parallel::TorchGroupAddress& at, torch::Device device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (groups_.count(at.group_name))
      throw std::invalid_argument("group_name '" + at.group_name +
                                  "': this server is in that group already (/destroy_weights_update_group first)");
    groups_[at.group_name] = nullptr;  // reserved while joining: a second init of the name is refused
  }
  try {
    auto joined = std::make_shared<Joined>();
    joined->group = parallel::join_torch_group(at, device, options_);
    std::lock_guard<std::mutex> lock(mu_);
    groups_[at.group_name] = std::move(joined);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    groups_.erase(at.group_name);
    throw;
  }
}

void WeightUpdateGroups::destroy(const std::string& name) {
  std::shared_ptr<Joined> joined;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(name);
    if (it == groups_.end()) throw std::invalid_argument("group_name '" + name + "': this server is in no such group");
    if (!it->second) throw GroupBusy("group_name '" + name + "': the group is still forming");
    joined = it->second;
    std::unique_lock<std::mutex> busy(joined->busy, std::try_to_lock);
    if (!busy.owns_lock()) throw GroupBusy("group_name '" + name + "': an update is receiving on it");
    groups_.erase(it);
  }
  // `joined` (and the group's connections) goes when the last holder lets go.
}

std::vector<std::string> WeightUpdateGroups::names() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [name, g] : groups_)
    if (g) out.push_back(name);
  return out;
}

std::vector<torch::Tensor> WeightUpdateGroups::receive(const std::string& name, const std::vector<TensorSpec>& specs) {
  std::shared_ptr<Joined> joined;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(name);
    if (it == groups_.end() || !it->second)
      throw std::invalid_argument("group_name '" + name +
                                  "': this server is in no such group (/init_weights_update_group first)");
    joined = it->second;
  }
  std::unique_lock<std::mutex> busy(joined->busy, std::try_to_lock);
  if (!busy.owns_lock()) throw GroupBusy("group_name '" + name + "': another update is receiving on it");
  auto& group = *joined->group;
  std::vector<torch::Tensor> out;
  out.reserve(specs.size());
  std::size_t i = 0;
  try {
    // One broadcast at a time (SGLang queues them all): when the trainer stops sending, no
    // further broadcast is queued behind the one that times out, each of which would hold the
    // group's teardown for another timeout (a Gloo group drains its queue before it goes).
    for (; i < specs.size(); ++i) {
      const auto& s = specs[i];
      out.push_back(torch::empty(s.shape, torch::TensorOptions().dtype(s.dtype).device(group.device())));
      group.broadcast(out.back(), 0);
    }
    if (group.device().is_cuda()) torch::cuda::synchronize(group.device().index());
  } catch (const std::exception& e) {
    busy.unlock();
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = groups_.find(name);
      if (it != groups_.end() && it->second == joined) groups_.erase(it);
    }
    const std::string which = i < specs.size() ? "tensor " + std::to_string(i) + " ('" + specs[i].name + "')" : "the update";
    throw parallel::CollectiveError("receiving " + which + " of " + std::to_string(specs.size()) + " on group '" + name +
                                    "' failed; the group is left: " + e.what());
  }
  return out;
}

}  // namespace kiln::rollout
