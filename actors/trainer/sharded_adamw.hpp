#pragma once
// AdamW over data-parallel ranks with sharded state (ZeRO stage 2, Rajbhandari et al. 2020,
// arXiv:1910.02054): every rank holds the full policy, but gradients are reduce-scattered into
// flat fp32 shards, and the fp32 master weights and AdamW's moments of a rank cover only its
// shard (1/dp of the elements). After the update every rank all-gathers the shards back into
// its full policy. Collectives go through parallel::Group (Gloo on CPU, NCCL on CUDA).
//
// Legend: N elements of all parameters (flattened in parameters() order, each row-major),
// W data-parallel ranks, S = ceil(N / W) elements per shard; rank r owns flat elements
// [r*S, min((r+1)*S, N)) (the last shard's tail past N is padding, always 0).
//
// Numerics: the update is LibTorch's fused AdamW kernel (at::_fused_adamw_, fused_adamw.hpp)
// over torch::optim::AdamW's state, one tensor per (parameter, shard) piece, so each element
// sees exactly the one-rank AdamW arithmetic (elementwise, per-parameter step counts; a
// parameter with no gradient on any rank is skipped as torch skips it). Gradient
// clipping follows torch::nn::utils::clip_grad_norm_ (coefficient max_norm / (norm + 1e-6),
// at most 1) with the norm from the shards' squared sums, all-reduced.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/group.hpp"

namespace kiln::trainer {

/// AdamW's state over flat elements [begin, begin + master.numel()) of the flat parameter index
/// (above), whatever the world size that held it: what sharded checkpoints store per rank.
struct FlatAdamWState {
  int64_t begin = 0;
  torch::Tensor master, exp_avg, exp_avg_sq;  ///< [end - begin] fp32 (moments 0 where no state)
  torch::Tensor steps;  ///< [P] int64: each parameter's AdamW step count; -1: none here
};

/// One AdamW parameter: `master` (fp32, any shape, contiguous) holds flat elements
/// [offset, offset + master.numel()) of the flat index, inside parameter `param`.
struct FlatPiece {
  std::size_t param;
  int64_t offset;
  torch::Tensor master;
};

/// The state of `adamw` over `pieces`, as flat elements [begin, end) of `params` parameters.
FlatAdamWState read_flat_state(torch::optim::AdamW& adamw, const std::vector<FlatPiece>& pieces, int64_t begin,
                               int64_t end, std::size_t params);
/// Sets every piece's master, moments and step count from `parts` (any split of the flat
/// index: their overlaps with each piece are copied). Throws std::invalid_argument naming the
/// parameter and the elements when `parts` do not cover a piece, or a part has another
/// parameter count.
void write_flat_state(torch::optim::AdamW& adamw, const std::vector<FlatPiece>& pieces,
                      const std::vector<FlatAdamWState>& parts);

class ShardedAdamW {
 public:
  /// `params`: the policy's parameters (any float dtype, on `group`'s device), held by
  /// reference: step() writes them. Makes every rank's parameters equal to group rank 0's (a
  /// broadcast, as torch's DistributedDataParallel does at construction), then copies this
  /// rank's shard to fp32 masters. Collective: every rank of `group` must construct it with
  /// parameters of the same shapes. Throws std::invalid_argument naming the parameter and
  /// the devices when a parameter is not on the group's device.
  /// `reduce_dtype`: the dtype the gradients are reduce-scattered in (fp32, or bf16: half the
  /// bytes, each rank's gradient rounded to bf16 and summed in bf16 by the backend, as FSDP2's
  /// MixedPrecisionPolicy.reduce_dtype and Megatron's bf16 gradient reduction; the sum is added
  /// to the fp32 shard either way). A one-rank group reduces nothing (fp32 throughout).
  ShardedAdamW(std::vector<torch::Tensor> params, parallel::Group& group, torch::optim::AdamWOptions options,
               torch::Dtype reduce_dtype = torch::kFloat32);

  /// Collective. The parameters' gradients (policy dtype; undefined = none on this rank) are
  /// summed over the group and added to this rank's fp32 shard (zero after zero_grad); the
  /// parameters' own gradients are left as they are. start_reduce_gradients() then
  /// finish_reduce_gradients().
  void reduce_gradients();
  /// Collective. Starts the reduce-scatter of the parameters' gradients as they are now (read
  /// before this returns: the caller may drop them at once) and returns without waiting, so
  /// that the backward goes on meanwhile. May be called several times per step (micro-batches,
  /// each layer's gradients as its backward ends): the shard receives the sum of all.
  void start_reduce_gradients();
  /// Collective. Waits for every started reduce-scatter (parallel::Group::finish, within the
  /// group's timeout), adds them to the shard, and gives each
  /// master its gradient, or none where no rank had a gradient for its parameter in any of
  /// them (torch's AdamW skips those). Throws parallel::CollectiveError when one failed.
  void finish_reduce_gradients();
  /// Collective. The L2 norm of the whole (summed) gradient; the shard is scaled by
  /// min(1, max_norm / (norm + 1e-6)). Returns the norm (NaN or inf when a gradient is).
  double clip_gradients(double max_norm);
  /// Not collective: [1] fp32, the squared L2 norm of this rank's gradient shard (the parts
  /// of a norm over several optimizers, e.g. dense and expert-parallel ones).
  torch::Tensor shard_squared_norm() const;
  /// Not collective: the shard's gradient times `coefficient` ([1] fp32).
  void scale_gradients(const torch::Tensor& coefficient);
  /// Collective. One AdamW step at `lr` on this rank's masters (fused_adamw_step), then every
  /// parameter is all-gathered from the shards (gather_parameters) unless `gather` is false
  /// (the caller gathers them its own way, e.g. FullyShardedLayers; not collective then).
  void step(double lr, bool gather = true);
  /// Collective. Every parameter all-gathered from the ranks' masters, rounded to its dtype
  /// (before the gather when all parameters share a dtype: bf16 moves half the bytes of fp32;
  /// one at::_foreach_copy_ after it): what step() does after the update; after masters were
  /// loaded from a checkpoint.
  void gather_parameters();
  /// gather_parameters() in two halves: start queues the all-gather (after whatever the
  /// current stream holds, e.g. the update) and returns; finish waits for it (within the
  /// group's timeout; parallel::CollectiveError when it failed) and writes the parameters.
  void start_gather_parameters();
  void finish_gather_parameters();
  /// Drops the shard's gradient (a skipped step).
  void zero_grad();
  /// Re-reads this rank's masters from the parameters (after they were loaded).
  void reload_from_parameters();

  /// LibTorch's AdamW over masters(): its state holds this rank's moments only.
  torch::optim::AdamW& optimizer() { return *adamw_; }
  /// This rank's fp32 master pieces, one per parameter its shard intersects, in flat order.
  const std::vector<torch::Tensor>& masters() const { return masters_; }
  /// [S] fp32: this rank's shard of the summed (after clip_gradients: clipped) gradient.
  const torch::Tensor& gradient_shard() const { return grad_shard_; }
  /// [S] fp32: this rank's shard of the fp32 master weights (masters() are views of it).
  const torch::Tensor& master_shard() const { return master_shard_; }
  int64_t numel() const { return numel_; }        ///< N
  /// The flat offset of parameter `i` (of the constructor's `params`).
  int64_t param_offset(std::size_t i) const { return offsets_.at(i); }
  int64_t shard_size() const { return shard_; }   ///< S
  /// This rank's flat elements [begin(), end()).
  int64_t begin() const { return std::min(numel_, group_.rank() * shard_); }
  int64_t end() const { return std::min(numel_, (group_.rank() + 1) * shard_); }
  /// masters() with their flat offsets (for read_flat_state / write_flat_state).
  std::vector<FlatPiece> pieces() const;

 private:
  /// [W*S] `dtype` on the group's device (`into` when given): each parameter's `pick` (a tensor of
  /// its shape, or undefined for zeros) at its flat offset, the padding zero. has[i] = 1 where
  /// pick(i) was defined.
  template <typename Pick>
  torch::Tensor flatten(Pick pick, std::vector<int64_t>* has = nullptr, torch::Tensor into = {},
                        torch::Dtype dtype = torch::kFloat32) const;

  /// One parameter's elements [param_offset, param_offset + length) inside the shard at
  /// shard_offset.
  struct Piece {
    std::size_t param;
    int64_t param_offset, shard_offset, length;
  };

  std::vector<torch::Tensor> params_;
  parallel::Group& group_;
  torch::Dtype reduce_dtype_ = torch::kFloat32;
  std::vector<int64_t> offsets_;  ///< flat offset of each parameter
  int64_t numel_ = 0, shard_ = 0;
  torch::Tensor master_shard_;    ///< [S] fp32; masters_ are views of it
  torch::Tensor grad_shard_;      ///< [S] fp32
  std::vector<Piece> pieces_;
  std::vector<torch::Tensor> masters_;
  std::unique_ptr<torch::optim::AdamW> adamw_;
  /// Started reduce-scatters: the work, its input [W*S] and output [S] (alive until it ends);
  /// the first since zero_grad() writes the shard itself (output undefined: no [S] copy) when
  /// it reduces in fp32; `first`: it is that first one (its output replaces the shard).
  struct Reduction {
    c10::intrusive_ptr<c10d::Work> work;
    torch::Tensor input, output;
    bool first = false;
  };
  bool shard_written_ = false;  ///< a reduction since zero_grad() wrote grad_shard_
  std::vector<Reduction> reductions_;
  std::vector<int64_t> has_gradient_;  ///< [P] 1 where some started reduction had a gradient
  /// A started gather_parameters: the work, its input [S] and output [W*S] in the gather's
  /// dtype (alive until it ends).
  c10::intrusive_ptr<c10d::Work> gathering_;
  torch::Tensor gather_input_, gathered_;
};

}  // namespace kiln::trainer
