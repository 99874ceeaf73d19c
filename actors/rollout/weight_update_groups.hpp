#pragma once
// The serving side of SGLang's weight-update groups (`kiln serve`'s /init_weights_update_group,
// /update_weights_from_distributed and /destroy_weights_update_group, weight_routes.cpp): named
// c10d groups that this server joins at a trainer's address, each laid out in the store as
// torch.distributed lays it out (parallel::join_torch_group), so that a Python trainer using
// SGLang's init_custom_process_group is rank 0 of the same group. Gloo on CPU, NCCL on CUDA.
// An update is a sequence of broadcasts from group rank 0, one per tensor, in the order the
// request names them; this class only receives (what is received is checked against the model
// and written by the caller). No HTTP and no model here.
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "parallel/process_group.hpp"

namespace kiln::rollout {

/// One tensor of an update as the request declares it.
struct TensorSpec {
  std::string name;  ///< HF name
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> shape;
};

/// A group is in use by another request (an update still receiving on it).
struct GroupBusy : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class WeightUpdateGroups {
 public:
  /// `options.store_timeout` bounds joining a group (every rank meeting), `options.collective_timeout`
  /// each broadcast of an update (a trainer that stops sending fails the update then).
  explicit WeightUpdateGroups(parallel::GroupOptions options);
  ~WeightUpdateGroups();
  WeightUpdateGroups(const WeightUpdateGroups&) = delete;
  WeightUpdateGroups& operator=(const WeightUpdateGroups&) = delete;

  /// Joins group `at.group_name` as rank `at.rank` on `device` (CPU: Gloo, CUDA: NCCL); returns
  /// once every rank joined. Throws std::invalid_argument for a name already joined or values out
  /// of range (parallel::join_torch_group), parallel::RendezvousError naming the address when the
  /// trainer's store or a rank is not reached within the store timeout.
  void init(const parallel::TorchGroupAddress& at, torch::Device device);
  /// Leaves group `name`. Throws std::invalid_argument for a name not joined, GroupBusy while an
  /// update receives on it.
  void destroy(const std::string& name);
  /// The names joined, sorted.
  std::vector<std::string> names() const;

  /// Receives one update on group `name`: for each spec in order, a broadcast from group rank 0
  /// into a new contiguous tensor [spec.shape] of spec.dtype on the group's device. Throws
  /// std::invalid_argument for a name not joined, GroupBusy while another update receives on it,
  /// parallel::CollectiveError naming the tensor when a broadcast fails or outlives the
  /// collective timeout (a lost or stopped trainer): the group is then left, since its members
  /// no longer agree on what comes next (join it again).
  std::vector<torch::Tensor> receive(const std::string& name, const std::vector<TensorSpec>& specs);

 private:
  struct Joined {
    std::unique_ptr<parallel::Group> group;
    std::mutex busy;  ///< held while an update receives
  };
  parallel::GroupOptions options_;
  mutable std::mutex mu_;  ///< guards groups_ (not the groups' traffic)
  std::map<std::string, std::shared_ptr<Joined>> groups_;
};

}  // namespace kiln::rollout
