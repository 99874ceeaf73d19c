#include "model/blocks/basic.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda_graph.hpp"
#include "kernels/linear_unsplit.hpp"
#include "kernels/moe.hpp"
#include "kernels/rms_norm.hpp"
#include "kernels/rope.hpp"
#include "kernels/router_logits.hpp"
#include "kernels/swiglu.hpp"
#include "model/blocks/fusions.hpp"
#include "model/blocks/recompute.hpp"

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <stdexcept>

namespace kiln::model {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  // CUDA: the fused kernel (same math, kernels/rms_norm.hpp); elsewhere the composite below.
  if (x.is_cuda() && x.scalar_type() == weight.scalar_type()) return kernels::rms_norm(x, weight, eps);
  auto xf = x.to(torch::kFloat32);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return batch_invariant_ ? invariant_rms_norm(x, weight, eps_) : rms_norm(x, weight, eps_);
}

namespace {
bool fused_norm(const torch::Tensor& x, const torch::Tensor& w) {
  return x.is_cuda() && x.scalar_type() == w.scalar_type();  // rms_norm's kernel condition
}
}  // namespace

std::pair<torch::Tensor, torch::Tensor> RMSNormImpl::forward_pass(const torch::Tensor& x) {
  if (batch_invariant_ || !training_fusions() || !fused_norm(x, weight)) return {x, forward(x)};
  return kernels::rms_norm_pass(x, weight, eps_);
}

std::pair<torch::Tensor, torch::Tensor> RMSNormImpl::forward_add(const torch::Tensor& x, const torch::Tensor& r) {
  if (batch_invariant_ || !training_fusions() || !fused_norm(x, weight) || r.scalar_type() != x.scalar_type()) {
    auto h = x + r;
    return {h, forward(h)};
  }
  return kernels::add_rms_norm(x, r, weight, eps_);
}

namespace {
// [T, R/2] each, in dtype: apply_rope's angles pos * theta^(-2i/R) (fp32) and their cos, sin.
std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const torch::Tensor& positions, int64_t R, double theta,
                                                     torch::Dtype dtype) {
  auto fopts = torch::TensorOptions().dtype(torch::kFloat32).device(positions.device());
  auto inv_freq = 1.0 / torch::pow(theta, torch::arange(0, R, 2, fopts) / double(R));  // [R/2]
  auto angles = positions.to(torch::kFloat32).unsqueeze(-1) * inv_freq;                  // [T, R/2]
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}
}  // namespace

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& positions, double theta, bool interleaved) {
  auto [cos, sin] = rope_cos_sin(positions, x.size(-1), theta, x.scalar_type());
  return kernels::rope_rotate_rows(x, cos, sin, interleaved);
}

RopeTable rope_table(int64_t positions, int64_t R, double theta, torch::Dtype dtype, torch::Device device) {
  if (positions < 1 || R < 2 || R % 2 != 0)
    throw std::invalid_argument("rope_table: " + std::to_string(positions) + " positions and R = " + std::to_string(R) +
                                ": need >= 1 and an even R >= 2");
  struct Entry {
    RopeTable now;
    std::vector<RopeTable> kept;  // the smaller ones handed out before
  };
  // Never destroyed: a static destructor would free CUDA memory after the CUDA runtime's exit.
  static auto* mutex = new std::mutex;
  static auto* tables = new std::map<std::tuple<std::string, int, double, int64_t>, Entry>;
  const std::lock_guard<std::mutex> lock(*mutex);
  auto& e = (*tables)[{device.str(), int(dtype), theta, R}];
  if (e.now.cos.defined() && e.now.cos.size(0) >= positions) return e.now;
  if (kernels::CapturedGraph::capturing(device))
    throw std::logic_error("rope_table: " + std::to_string(positions) + " positions asked for on " + device.str() +
                           " while its stream captures a CUDA graph (the table has " +
                           std::to_string(e.now.cos.defined() ? e.now.cos.size(0) : 0) +
                           "): make it before the capture");
  int64_t size = 4096;
  while (size < positions) size *= 2;
  torch::NoGradGuard no_grad;
  auto [cos, sin] = rope_cos_sin(torch::arange(size, torch::TensorOptions().dtype(torch::kInt64).device(device)), R,
                                 theta, dtype);
  if (e.now.cos.defined()) e.kept.push_back(e.now);
  e.now = {cos, sin};
  return e.now;
}

torch::Tensor apply_rope_cached(const torch::Tensor& x, const torch::Tensor& positions, int64_t max_positions,
                                double theta, bool interleaved) {
  if (!x.is_cuda()) return apply_rope(x, positions, theta, interleaved);
  const auto t = rope_table(max_positions, x.size(-1), theta, x.scalar_type(), x.device());
  return kernels::rope_rotate(x, positions, t.cos, t.sin, interleaved);
}

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t intermediate, std::optional<double> swiglu_limit) : limit_(swiglu_limit) {
  auto lin = [](int64_t i, int64_t o) { return torch::nn::Linear(torch::nn::LinearOptions(i, o).bias(false)); };
  gate = register_module("gate", lin(dim, intermediate));
  up = register_module("up", lin(dim, intermediate));
  down = register_module("down", lin(intermediate, dim));
}

namespace {
// Forward by kernels::linear_unsplit (with `fp32`, of x and w cast to fp32), backward by mm in
// x's dtype (the gradients need no fixed order; with `fp32` the fp32 gradient is rounded to it
// first, and x is saved as it is, not its fp32 copy).
struct UnsplitLinear : public torch::autograd::Function<UnsplitLinear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_MK, const torch::Tensor& w_NK,
                               bool fp32) {
    ctx->save_for_backward({x_MK, w_NK});
    if (!fp32) return kernels::linear_unsplit(x_MK, w_NK);
    // bf16 operands on CUDA: kernels::router_logits (each output summed over K in order from
    // the bf16 values, no fp32 copy of x); else cuBLASLt's fp32 GEMM without split-K.
    if (kernels::router_logits_uses_kernel(x_MK, w_NK)) return kernels::router_logits(x_MK, w_NK);
    return kernels::linear_unsplit(x_MK.to(torch::kFloat32), w_NK.to(torch::kFloat32));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const auto g = grads[0].to(x.scalar_type()).contiguous();  // [M, N]
    return {ctx->needs_input_grad(0) ? g.mm(w) : torch::Tensor(), ctx->needs_input_grad(1) ? g.t().mm(x) : torch::Tensor(),
            torch::Tensor()};
  }
};

// unsplit_linear_pair's function: two outputs of one x, x's gradient accumulated in one buffer.
struct UnsplitLinearPair : public torch::autograd::Function<UnsplitLinearPair> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_MK,
                                                const torch::Tensor& w1_NK, const torch::Tensor& w2_NK) {
    ctx->save_for_backward({x_MK, w1_NK, w2_NK});
    ctx->set_materialize_grads(false);  // an output without a gradient: no zeros, no GEMMs for it
    return {kernels::linear_unsplit(x_MK, w1_NK), kernels::linear_unsplit(x_MK, w2_NK)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w1 = saved[1], &w2 = saved[2];
    const auto g1 = grads[0].defined() ? grads[0].to(x.scalar_type()).contiguous() : torch::Tensor();  // [M, N1]
    const auto g2 = grads[1].defined() ? grads[1].to(x.scalar_type()).contiguous() : torch::Tensor();  // [M, N2]
    torch::Tensor dx;
    if (ctx->needs_input_grad(0)) {
      if (g1.defined()) dx = g1.mm(w1);
      if (g2.defined()) dx = dx.defined() ? dx.addmm_(g2, w2) : g2.mm(w2);
    }
    return {dx, ctx->needs_input_grad(1) && g1.defined() ? g1.t().mm(x) : torch::Tensor(),
            ctx->needs_input_grad(2) && g2.defined() ? g2.t().mm(x) : torch::Tensor()};
  }
};

// SwiGLU's activation and down projection for training, keeping gate and up but not the
// activation [M, F]: the backward recomputes it (swiglu_pair's forward kernel) for the down
// weight's gradient. The same forward as unsplit_linear(swiglu_pair(gate, up), w_down).
struct SwigluDown : public torch::autograd::Function<SwigluDown> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up, const torch::Tensor& w_down, std::optional<double> limit) {
    ctx->save_for_backward({gate, up, w_down});
    ctx->saved_data["limit"] = limit ? c10::IValue(*limit) : c10::IValue();
    return kernels::linear_unsplit(kernels::swiglu_pair(gate, up, limit), w_down);  // [M, D]
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &gate = saved[0], &up = saved[1], &w = saved[2];
    const auto lim = ctx->saved_data["limit"];
    const std::optional<double> limit = lim.isNone() ? std::nullopt : std::optional<double>(lim.toDouble());
    const auto g = grads[0].to(gate.scalar_type()).contiguous();  // [M, D]
    const bool want_dw = ctx->needs_input_grad(2);
    if (!ctx->needs_input_grad(0) && !ctx->needs_input_grad(1))
      return {torch::Tensor(), torch::Tensor(), want_dw ? g.t().mm(kernels::swiglu_pair(gate, up, limit)) : torch::Tensor(),
              torch::Tensor()};
    // With the fusions (model/blocks/fusions.hpp) the activation for the down weight's gradient
    // comes out of the same pass as d gate, d up; else it is recomputed first.
    const bool fused = want_dw && training_fusions();
    torch::Tensor dw = want_dw && !fused ? g.t().mm(kernels::swiglu_pair(gate, up, limit)) : torch::Tensor();
    auto r = kernels::swiglu_pair_backward(gate, up, g.mm(w), limit, /*want_act=*/fused);
    if (fused) dw = g.t().mm(r.act);
    return {r.dgate, r.dup, dw, torch::Tensor()};  // dw [D, F]
  }
};
}  // namespace

namespace {
// A process-wide switch read once from `name` in the environment: unset or empty gives
// `default_on`, "1" on, "0" off, anything else a c10::Error naming it.
bool env_switch(const char* name, bool default_on) {
  const char* env = std::getenv(name);
  if (!env || !*env) return default_on;
  if (std::strcmp(env, "1") == 0) return true;
  TORCH_CHECK(std::strcmp(env, "0") == 0, name, "=", env, ": expected 1 (on) or 0 (off); unset: ",
              default_on ? "on" : "off");
  return false;
}
std::atomic<bool>& recompute_switch() {
  static std::atomic<bool> on{env_switch("KILN_RECOMPUTE_IN_BACKWARD", true)};
  return on;
}
std::atomic<bool>& fusions_switch() {
  static std::atomic<bool> on{env_switch("KILN_TRAINING_FUSIONS", true)};
  return on;
}
std::atomic<bool>& overlap_switch() {
  static std::atomic<bool> on{env_switch("KILN_SHARED_EXPERT_OVERLAP", true)};
  return on;
}
}  // namespace

bool recompute_in_backward() { return recompute_switch(); }
bool set_recompute_in_backward(bool on) { return recompute_switch().exchange(on); }
bool training_fusions() { return fusions_switch(); }
bool set_training_fusions(bool on) { return fusions_switch().exchange(on); }
bool shared_expert_overlap() { return overlap_switch(); }
bool set_shared_expert_overlap(bool on) { return overlap_switch().exchange(on); }

torch::Tensor unsplit_linear(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t K = w.size(1);
  if (x.dim() < 1 || x.size(-1) != K)
    throw std::invalid_argument("unsplit_linear: x's last dim must be w's K = " + std::to_string(K) + ", got x " +
                                c10::str(x.sizes()));
  if (!x.is_cuda()) return torch::linear(x, w);
  auto x2 = x.reshape({-1, K});
  if (!kernels::linear_unsplit_uses_cublaslt(x2, w)) return torch::linear(x, w);
  auto out_shape = x.sizes().vec();
  out_shape.back() = w.size(0);
  return UnsplitLinear::apply(x2, w, false).view(out_shape);
}

std::pair<torch::Tensor, torch::Tensor> unsplit_linear_pair(const torch::Tensor& x, const torch::Tensor& w1,
                                                            const torch::Tensor& w2) {
  if (x.dim() != 2 || w1.dim() != 2 || w2.dim() != 2 || x.size(1) != w1.size(1) || x.size(1) != w2.size(1))
    throw std::invalid_argument("unsplit_linear_pair: x must be [M, K] for w1 [N1, K] and w2 [N2, K], got x " +
                                c10::str(x.sizes()) + ", w1 " + c10::str(w1.sizes()) + ", w2 " + c10::str(w2.sizes()));
  // kernels::linear_unsplit is at::linear wherever it does not take cuBLASLt: unsplit_linear's
  // forward bits on every device.
  auto y = UnsplitLinearPair::apply(x, w1, w2);
  return {y[0], y[1]};
}

torch::Tensor unsplit_linear_fp32(const torch::Tensor& x, const torch::Tensor& w) {
  // bf16 only (fp16's range would flush small gradients such as the router's per-token-normalised
  // ones, ~1e-6 and below), w in it too (its gradient is computed in that dtype); 16-byte rows in
  // bf16 are 16-byte rows in fp32 too.
  if (x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.is_cuda() && x.dim() == 2 &&
      x.size(1) == w.size(1) && kernels::linear_unsplit_uses_cublaslt(x, w))
    return UnsplitLinear::apply(x, w, true);
  return unsplit_linear(x.to(torch::kFloat32), w.to(torch::kFloat32));
}

torch::Tensor SwiGLUImpl::forward(const torch::Tensor& x) {
  if (!batch_invariant_) {
    const auto x2 = x.reshape({-1, x.size(-1)});
    auto [g, u] = unsplit_linear_pair(x2, gate->weight, up->weight);
    auto out_shape = x.sizes().vec();
    // Training: the activation recomputed in the backward, not kept (SwigluDown).
    if (torch::GradMode::is_enabled() && recompute_in_backward())
      return SwigluDown::apply(g, u, down->weight, limit_).view(out_shape);
    return unsplit_linear(kernels::swiglu_pair(g, u, limit_), down->weight).view(out_shape);
  }
  if (limit_)
    throw std::invalid_argument("SwiGLU: the batch-invariant mode has no clamped SwiGLU (swiglu_limit " +
                                std::to_string(*limit_) + ")");
  auto act = invariant_swiglu(invariant_linear(x, gate->weight), invariant_linear(x, up->weight));
  return invariant_linear(act, down->weight);
}

torch::Tensor to_model_device(const torch::Tensor& t, torch::Device device, std::optional<torch::Dtype> dtype) {
  auto src = dtype ? t.to(*dtype) : t;
  if (src.device() == device) return src;
  // Pinned: the copy is queued on the stream and the caching host allocator keeps the staging
  // block until it has run.
  if (src.is_cpu() && device.is_cuda()) return src.pin_memory().to(device, /*non_blocking=*/true);
  return src.to(device);
}

PackedBatch PackedBatch::from_documents(const std::vector<std::vector<int64_t>>& docs) {
  if (docs.empty()) throw std::invalid_argument("PackedBatch: no documents");
  std::vector<int64_t> ids, pos, cu{0};
  for (std::size_t d = 0; d < docs.size(); ++d) {
    if (docs[d].empty()) throw std::invalid_argument("PackedBatch: document " + std::to_string(d) + " is empty");
    for (std::size_t i = 0; i < docs[d].size(); ++i) {
      ids.push_back(docs[d][i]);
      pos.push_back(int64_t(i));
    }
    cu.push_back(int64_t(ids.size()));
  }
  return PackedBatch{torch::tensor(ids, torch::kInt64), torch::tensor(pos, torch::kInt64), torch::tensor(cu, torch::kInt64)};
}

void PackedBatch::validate() const {
  auto bad = [](const std::string& s) { throw std::invalid_argument("PackedBatch: " + s); };
  if (input_ids.dim() != 1 || input_ids.scalar_type() != torch::kInt64) bad("input_ids must be [T] int64");
  if (position_ids.sizes() != input_ids.sizes() || position_ids.scalar_type() != torch::kInt64)
    bad("position_ids must be [T] int64 like input_ids");
  if (cu_seqlens.dim() != 1 || cu_seqlens.size(0) < 2 || cu_seqlens.scalar_type() != torch::kInt64)
    bad("cu_seqlens must be [B+1] int64 with B >= 1");
  auto cu = cu_seqlens.to(torch::kCPU);
  auto* c = cu.data_ptr<int64_t>();
  if (c[0] != 0) bad("cu_seqlens[0] must be 0");
  for (int64_t i = 1; i < cu.size(0); ++i)
    if (c[i] <= c[i - 1]) bad("cu_seqlens must be strictly increasing (empty document at " + std::to_string(i - 1) + ")");
  if (c[cu.size(0) - 1] != input_ids.size(0))
    bad("cu_seqlens ends at " + std::to_string(c[cu.size(0) - 1]) + " but there are " +
        std::to_string(input_ids.size(0)) + " tokens");
}

}  // namespace kiln::model
