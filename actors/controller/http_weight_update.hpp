#pragma once
// rollout.weight_update = "distributed" for the HTTP rollout backend: the controller (which
// holds the trainer's weights) is rank 0 of a c10d group with every server (server i: rank
// 1 + i), the way SGLang's trainers (slime, verl) drive SGLang: the servers join with
// /init_weights_update_group at start, and each version travels as one
// /update_weights_from_distributed per server (names, dtypes, shapes of every HF tensor, in
// order) while this side broadcasts the tensors one by one, in that order, from rank 0. Gloo on
// CPU, NCCL on CUDA (the group's store keys are torch.distributed's: parallel::join_torch_group).
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "actors/controller/handles.hpp"

namespace kiln::parallel {
class Group;
}

namespace kiln::controller {

class DistributedWeightUpdate {
 public:
  /// `urls`: the servers (rank 1 + i); `address`: where they reach this process's store;
  /// `device`: where the tensors are broadcast from (CPU: Gloo, CUDA: NCCL); `timeout`: forming
  /// the group and each broadcast; `http_timeout_s`: each request to a server.
  DistributedWeightUpdate(std::vector<std::string> urls, std::string address, torch::Device device,
                          std::chrono::seconds timeout, int64_t http_timeout_s);
  ~DistributedWeightUpdate();

  /// Forms the group: asks every server to leave a group of the same name it may still be in
  /// (a previous run's), then /init_weights_update_group to each (concurrently) while this
  /// process joins as rank 0. Throws std::runtime_error naming each server that did not join
  /// and why.
  void connect();
  /// Sends `w` (HF-named tensors, CPU) as weight version w.version to every server; connects
  /// first when not connected. Returns once every server answered success. Throws
  /// std::runtime_error naming each server that failed and its message (and this side's
  /// broadcast error); the group is then left (the next send forms it again).
  void send(const PolicyWeights& w);

  /// The group's name on every member.
  static constexpr const char* kGroupName = "kiln_weight_update";

 private:
  std::vector<std::string> urls_;
  std::string address_;
  torch::Device device_;
  std::chrono::seconds timeout_;
  int64_t http_timeout_s_;
  std::unique_ptr<parallel::Group> group_;
};

}  // namespace kiln::controller
