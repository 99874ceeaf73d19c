#pragma once
// Small blocks shared by model packages: RMSNorm, rotary embedding, SwiGLU MLP.
// Shape legend: T tokens (packed), H heads, D hidden, R rope dims, F intermediate.
#include <torch/torch.h>

#include <optional>

#include "model/blocks/batch_invariant.hpp"

namespace kiln::model {

/// RMSNorm (Zhang & Sennrich 2019), as transformers' Glm4MoeLiteRMSNorm / T5LayerNorm:
/// y = weight * (x_fp32 * rsqrt(mean(x_fp32^2, -1) + eps)).to(x.dtype). x: [..., D], weight [D].
/// CUDA tensors of weight's dtype: the fused kernel (kernels/rms_norm.hpp); elsewhere ATen ops.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

/// The module of rms_norm; with set_batch_invariant(true), invariant_rms_norm.
class RMSNormImpl : public torch::nn::Module, public BatchInvariantSwitch {
 public:
  RMSNormImpl(int64_t dim, double eps);
  /// Parameters the constructor registers (the weight [dim]).
  static int64_t parameter_count(int64_t dim) { return dim; }
  torch::Tensor forward(const torch::Tensor& x);
  /// A pre-norm block's norms with the residual stream's additions folded in (x, r [..., D]):
  /// forward_pass(x) -> {x_on, norm(x)}, x_on to be used in place of x, so that its gradient and
  /// the norm's are summed by the norm's backward; forward_add(x, r) -> {h = x + r, norm(h)},
  /// the sum made and its gradients summed by the norm's passes. The values of the unfused ops,
  /// bit for bit: kernels::rms_norm_pass / add_rms_norm on CUDA with the training fusions
  /// (model/blocks/fusions.hpp), the composite otherwise and in the batch-invariant mode.
  std::pair<torch::Tensor, torch::Tensor> forward_pass(const torch::Tensor& x);
  std::pair<torch::Tensor, torch::Tensor> forward_add(const torch::Tensor& x, const torch::Tensor& r);
  torch::Tensor weight;  ///< [D]

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

/// Rotary position embedding (Su et al. 2021) with inv_freq_i = theta^(-2i/R).
/// interleaved = true rotates adjacent pairs (x0, x1), (x2, x3), ... in place: the layout of
/// DeepSeek/GLM checkpoints (transformers' apply_rotary_pos_emb_interleave; kiln keeps each
/// pair adjacent in the output, which changes no dot product between q and k).
/// interleaved = false rotates (x_i, x_{i+R/2}) (transformers' rotate_half).
/// Angles are computed in fp32; the result has x's dtype.
/// x: [T, H, R], positions: [T] int64 -> [T, H, R].
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& positions, double theta, bool interleaved);

/// apply_rope's cos and sin of every position < `positions` ([P, R/2] each, `dtype`, on
/// `device`), computed by apply_rope's own ops, so the rows equal what apply_rope computes for
/// those positions. One table per (device, dtype, theta, R) in the process, made larger when
/// more positions are asked for; a table once handed out stays allocated (captured CUDA graphs
/// read it), and growing one while the device's stream captures a graph throws
/// std::logic_error (make it before the capture, e.g. in the warm-up run).
struct RopeTable {
  torch::Tensor cos, sin;
};
RopeTable rope_table(int64_t positions, int64_t R, double theta, torch::Dtype dtype, torch::Device device);

/// apply_rope for inference (no gradient) with every position < max_positions: on CUDA the
/// rows of rope_table(max_positions) by kernels::rope_rotate (one kernel, the same bits as
/// apply_rope); elsewhere apply_rope.
torch::Tensor apply_rope_cached(const torch::Tensor& x, const torch::Tensor& positions, int64_t max_positions,
                                double theta, bool interleaved);

/// A projection without split-K: x [..., K], w [N, K] -> [..., N], the value of torch's
/// linear (no bias), its forward by kernels::linear_unsplit (on CUDA in bf16/fp16/fp32 cuBLASLt
/// with each output summed over K in one pass; elsewhere at::linear) and its backward by torch's
/// mm.
/// A token's output then has the same bits whether it rides in a decode step of a few rows or
/// in the trainer's micro-batch of thousands (kernels/linear_unsplit.hpp says why cuBLAS's own
/// choice does not): MLA's projections, the SwiGLU MLPs and the MoE router's fp32 logits use it
/// in the default mode.
torch::Tensor unsplit_linear(const torch::Tensor& x, const torch::Tensor& w);
/// Two projections of one input, x [M, K] -> (x w1^T [M, N1], x w2^T [M, N2]): the forward
/// two unsplit_linear GEMMs (the same bits), the backward x's gradient as one GEMM then a second
/// accumulated into it (g1 w1, then += g2 w2 with beta 1, rounded once more) in place of two
/// GEMMs and autograd's add of their [M, K] results (gate/up of the SwiGLU MLPs, q_a/kv_a of
/// MLA: one pass over [M, K] less each); an output without a gradient costs no GEMM. Any
/// device (at::linear's forward where unsplit_linear takes it). Throws std::invalid_argument
/// when x is not [M, K] for w1 and w2's K.
std::pair<torch::Tensor, torch::Tensor> unsplit_linear_pair(const torch::Tensor& x, const torch::Tensor& w1,
                                                            const torch::Tensor& w2);
/// unsplit_linear in fp32 (x and w cast to fp32: the fp32 GEMM's value) -> [..., N] fp32. For a
/// bf16 x [M, K] and w on CUDA the forward is kernels::router_logits (each output summed over K
/// in order from the bf16 values: the same bits at any M; kernels/router_logits.hpp) where its
/// layout conditions hold, and the backward runs in bf16 (the gradient rounded to bf16, two
/// tensor-core GEMMs with fp32 accumulation, as torchtitan's bf16 router; x saved in bf16), not
/// on the CUDA cores in fp32 through an fp32 copy of x; otherwise unsplit_linear of the fp32
/// casts. The MoE router's logits.
torch::Tensor unsplit_linear_fp32(const torch::Tensor& x, const torch::Tensor& w);

/// SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)). x: [T, D] -> [T, D].
/// swiglu_limit: transformers' clamped form (GLM-5.3-Flash's Glm5NextTextMLP; kernels::swiglu).
/// Projections by unsplit_linear; with set_batch_invariant(true) invariant_linear and
/// invariant_swiglu (no limit: refused with std::invalid_argument in forward).
class SwiGLUImpl : public torch::nn::Module, public BatchInvariantSwitch {
 public:
  SwiGLUImpl(int64_t dim, int64_t intermediate, std::optional<double> swiglu_limit = std::nullopt);
  /// Parameters the constructor registers (gate, up [intermediate, dim], down [dim, intermediate]).
  static int64_t parameter_count(int64_t dim, int64_t intermediate) { return 3 * dim * intermediate; }
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear gate{nullptr}, up{nullptr}, down{nullptr};  ///< [F, D], [F, D], [D, F]

 private:
  std::optional<double> limit_;
};
TORCH_MODULE(SwiGLU);

/// `t` on `device` (converted to `dtype` first, on its own device, when given) for a model's
/// forward: from the host to a GPU staged through pinned memory and copied without blocking the
/// host (a copy from pageable memory waits for the GPU's stream to drain, so the host could not
/// queue the step's first kernels while the GPU still ran the previous step). Elsewhere
/// Tensor::to.
torch::Tensor to_model_device(const torch::Tensor& t, torch::Device device,
                              std::optional<torch::Dtype> dtype = std::nullopt);

/// Packed documents: T tokens of B documents back to back.
struct PackedBatch {
  torch::Tensor input_ids;     ///< [T] int64
  torch::Tensor position_ids;  ///< [T] int64, restarting at 0 in each document
  torch::Tensor cu_seqlens;    ///< [B+1] int64 on CPU, 0 = cu[0] < ... < cu[B] = T
  /// Builds a batch from documents (positions 0..len-1 each). Throws std::invalid_argument
  /// for an empty document list or an empty document.
  static PackedBatch from_documents(const std::vector<std::vector<int64_t>>& docs);
  /// Checks shapes and that cu_seqlens is increasing from 0 to T; throws
  /// std::invalid_argument naming the fault.
  void validate() const;
};

}  // namespace kiln::model
