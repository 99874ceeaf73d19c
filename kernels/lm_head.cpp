#include "kernels/lm_head.hpp"

#include <ATen/ATen.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "kernels/alignment.hpp"
#include "kernels/scale_rows.hpp"

#ifdef KILN_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/lm_head_cuda.hpp"
#endif
#ifdef KILN_LM_HEAD
#include "kernels/stream_scratch.hpp"
#endif

namespace kiln::kernels {

namespace {
// A count on the device read by the host later: copied into pinned memory behind an event when
// made, read() waits for that event only. Between the two the host queues more work, so the
// GPU does not idle while the host reads (a read right away waits for all queued work, then the
// GPU waits while the host queues the next small kernels one by one). CPU tensors: read as is.
class HostCount {
 public:
  explicit HostCount(const at::Tensor& count) {
#ifdef KILN_CUDA
    if (count.is_cuda()) {
      host_ = at::empty({}, count.options().device(at::kCPU).pinned_memory(true));
      host_.copy_(count, /*non_blocking=*/true);
      event_.record(at::cuda::getCurrentCUDAStream(count.device().index()));
      return;
    }
#endif
    host_ = count.to(at::kCPU);
  }
  int64_t read() {
#ifdef KILN_CUDA
    if (event_.isCreated()) event_.synchronize();
#endif
    return host_.item<int64_t>();
  }

 private:
  at::Tensor host_;
#ifdef KILN_CUDA
  at::cuda::CUDAEvent event_{cudaEventDisableTiming};
#endif
};

std::atomic<bool>& fused_switch() {
  // On unless turned off: faster than cuBLAS plus kiln's pass in the training step, and 1.7 GiB
  // less at 8192 tokens (docs/benchmarks.md, "The fused head in the training step").
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("KILN_LM_HEAD_FUSED");
    if (!env || !*env || std::strcmp(env, "1") == 0) return true;
    TORCH_CHECK(std::strcmp(env, "0") == 0, "KILN_LM_HEAD_FUSED=", env, ": expected 1 (on, the default) or 0 (off)");
    return false;
  }()};
  return on;
}

std::atomic<LmHeadSchedule>& schedule_switch() {
  static std::atomic<LmHeadSchedule> s{[] {
    const char* env = std::getenv("KILN_LM_HEAD_SCHEDULE");
    if (!env || !*env || std::strcmp(env, "cooperative") == 0) return LmHeadSchedule::cooperative;
    TORCH_CHECK(std::strcmp(env, "pingpong") == 0, "KILN_LM_HEAD_SCHEDULE=", env,
                ": expected cooperative or pingpong");
    return LmHeadSchedule::pingpong;
  }()};
  return s;
}
}  // namespace

bool set_lm_head_fused(bool on) { return fused_switch().exchange(on); }
LmHeadSchedule set_lm_head_schedule(LmHeadSchedule s) { return schedule_switch().exchange(s); }
LmHeadSchedule lm_head_schedule() { return schedule_switch(); }

bool lm_head_fused_available(const at::Tensor& hidden_ND, const at::Tensor& weight_VD) {
#ifdef KILN_LM_HEAD
  return fused_switch() && hidden_ND.is_cuda() && weight_VD.device() == hidden_ND.device() &&
         hidden_ND.scalar_type() == at::kBFloat16 && weight_VD.scalar_type() == at::kBFloat16 && hidden_ND.dim() == 2 &&
         weight_VD.dim() == 2 && hidden_ND.size(1) == weight_VD.size(1) && hidden_ND.size(1) % 8 == 0 &&
         weight_VD.size(0) % 8 == 0 && at::cuda::getDeviceProperties(hidden_ND.device().index())->major == 9;
#else
  (void)hidden_ND, (void)weight_VD;
  return false;
#endif
}

std::pair<at::Tensor, at::Tensor> lm_head_probs_lse(const at::Tensor& hidden_ND, const at::Tensor& weight_VD,
                                                    const at::Tensor& reference_N, const at::Tensor& probs_NV) {
  TORCH_CHECK(hidden_ND.dim() == 2 && weight_VD.dim() == 2 && hidden_ND.size(1) == weight_VD.size(1),
              "lm_head_probs_lse: hidden [N, D] and weight [V, D] expected, got ", hidden_ND.sizes(), " and ",
              weight_VD.sizes());
  TORCH_CHECK(probs_NV.dim() == 2 && probs_NV.size(0) == hidden_ND.size(0) && probs_NV.size(1) == weight_VD.size(0),
              "lm_head_probs_lse: probs must be [N, V] = [", hidden_ND.size(0), ", ", weight_VD.size(0), "], got ",
              probs_NV.sizes());
  TORCH_CHECK(reference_N.dim() == 1 && reference_N.size(0) == hidden_ND.size(0) &&
                  reference_N.scalar_type() == at::kFloat && reference_N.device() == hidden_ND.device(),
              "lm_head_probs_lse: reference must be [", hidden_ND.size(0), "] fp32 on ", hidden_ND.device(), ", got ",
              reference_N.sizes(), " ", reference_N.scalar_type(), " on ", reference_N.device());
  TORCH_CHECK(lm_head_fused_available(hidden_ND, weight_VD), "lm_head_probs_lse: no fused kernel for hidden ",
              hidden_ND.sizes(), " ", hidden_ND.scalar_type(), " on ", hidden_ND.device(), " and weight ",
              weight_VD.sizes(), " ", weight_VD.scalar_type(), " on ", weight_VD.device(),
              " (needs a CUDA build with CUTLASS, a Hopper GPU, bf16, D and V multiples of 8, and the switch on: ",
              "KILN_LM_HEAD_FUSED unset or 1)");
  TORCH_CHECK(probs_NV.scalar_type() == at::kBFloat16 && probs_NV.device() == hidden_ND.device() &&
                  probs_NV.is_contiguous(),
              "lm_head_probs_lse: probs must be bf16, contiguous, on ", hidden_ND.device(), ", got ",
              probs_NV.scalar_type(), " on ", probs_NV.device());
#ifdef KILN_LM_HEAD
  const c10::cuda::CUDAGuard device(hidden_ND.device());  // CUTLASS launches on the current device
  auto h = aligned_contiguous(hidden_ND), w = aligned_contiguous(weight_VD);
  TORCH_CHECK(aligned16(probs_NV), "lm_head_probs_lse: probs must start on a 16-byte boundary");
  const auto fopt = hidden_ND.options().dtype(at::kFloat);
  auto lse = at::empty({hidden_ND.size(0)}, fopt), kept_lse = at::empty({hidden_ND.size(0)}, fopt);
  if (hidden_ND.size(0) == 0) return {lse, kept_lse};
  auto c = reference_N.contiguous();
  cuda::LmHeadArgs a;
  a.hidden = h.data_ptr();
  a.weight = w.data_ptr();
  a.reference = c.data_ptr<float>();
  a.probs = probs_NV.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.kept_lse = kept_lse.data_ptr<float>();
  a.N = h.size(0);
  a.V = w.size(0);
  a.D = h.size(1);
  a.sm_count = at::cuda::getDeviceProperties(h.device().index())->multiProcessorCount;
  a.stream = at::cuda::getCurrentCUDAStream(h.device().index()).stream();
  a.pingpong = lm_head_schedule() == LmHeadSchedule::pingpong;
  StreamScratch keep(h.device());
  cuda::lm_head_probs_lse(a, &StreamScratch::alloc, &keep);
  return {lse, kept_lse};
#else
  TORCH_CHECK(false, "lm_head_probs_lse: this build has no fused head (needs CUDA and CUTLASS's headers)");
#endif
}

std::pair<at::Tensor, at::Tensor> lm_head_probs_backward(const at::Tensor& probs_NV, const at::Tensor& hidden_ND,
                                                         const at::Tensor& weight_VD, const at::Tensor& targets_N,
                                                         const at::Tensor& reference_N, const at::Tensor& lse_N,
                                                         const at::Tensor& kept_lse_N, const at::Tensor& g_N,
                                                         at::ScalarType weight_grad_dtype,
                                                         const at::Tensor& grad_weight_into) {
  const int64_t N = hidden_ND.size(0), V = weight_VD.size(0);
  TORCH_CHECK(!grad_weight_into.defined() ||
                  (weight_grad_dtype == at::kFloat && grad_weight_into.scalar_type() == at::kFloat &&
                   grad_weight_into.sizes() == weight_VD.sizes() && grad_weight_into.is_contiguous() &&
                   grad_weight_into.device() == weight_VD.device()),
              "lm_head_probs_backward: grad_weight_into must be fp32 ", weight_VD.sizes(),
              ", contiguous, on the weight's device, with weight_grad_dtype fp32; got ",
              grad_weight_into.scalar_type(), " ", grad_weight_into.sizes(), " and ", weight_grad_dtype);
  TORCH_CHECK(hidden_ND.dim() == 2 && weight_VD.dim() == 2 && hidden_ND.size(1) == weight_VD.size(1) &&
                  probs_NV.dim() == 2 && probs_NV.size(0) == N && probs_NV.size(1) == V,
              "lm_head_probs_backward: probs [N, V], hidden [N, D] and weight [V, D] expected, got ", probs_NV.sizes(),
              ", ", hidden_ND.sizes(), " and ", weight_VD.sizes());
  for (const auto* t : {&targets_N, &reference_N, &lse_N, &kept_lse_N, &g_N})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == N, "lm_head_probs_backward: targets, reference, lse, kept_lse and g ",
                "must be [", N, "], got ", t->sizes());
  const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
  const auto valid = targets_N.ge(0).logical_and_(targets_N.lt(V));  // [N]
  const auto live = valid.logical_and(g_N.ne(0));                    // rows with a gradient
  // Rows whose values may have reached the GEMM's clamp (or are not finite): none of their kept
  // probabilities read (a = 0), recomputed below. How many: counted on the device and its copy
  // to pinned host memory queued here, ahead of both GEMMs; the host reads it once they are
  // queued too, so the GPU has them to run while the host waits.
  const auto far = live.logical_and(lse_N.sub(reference_N).le(kProbsMaxLseAboveReference).logical_not());
  HostCount far_count(far.sum());
  const auto t = targets_N.clamp(0, V - 1).unsqueeze(1);                             // [N, 1]
  const auto sum = kept_lse_N.sub(reference_N).exp_();                               // S [N]
  const auto at_target = probs_NV.gather(1, t).squeeze(1).to(at::kFloat);            // [N]
  probs_NV.scatter_(1, t, at::where(valid, at_target - sum, at_target).to(probs_NV.scalar_type()).unsqueeze(1));
  const auto a = at::where(live.logical_and(far.logical_not()), f32(g_N).neg().div_(sum),
                           at::zeros({N}, g_N.options().dtype(at::kFloat)));  // -g / S, [N]
  const bool tensor_cores = hidden_ND.is_cuda() && hidden_ND.scalar_type() != at::kFloat;
  auto grad_h = at::empty_like(hidden_ND);
  auto scaled_h = at::empty_like(hidden_ND);
  scale_rows_out(scaled_h, hidden_ND, a);  // fp32 products, rounded once to hidden's dtype
  // acc += a^T b into an fp32 [V, D] in place (a GEMM with beta = 1 on CUDA: no second [V, D]).
  const auto add_into = [&](at::Tensor& acc, const at::Tensor& a_t, const at::Tensor& b) {
    if (tensor_cores) at::addmm_out(acc, acc, a_t, b, at::kFloat);
    else acc.addmm_(f32(a_t), f32(b));
  };
  const auto weight_grad = [&](at::ScalarType dtype) {
    if (grad_weight_into.defined()) {
      auto acc = grad_weight_into;
      add_into(acc, probs_NV.t(), scaled_h);
      return acc;
    }
    if (!tensor_cores) return at::mm(f32(probs_NV).t(), f32(scaled_h)).to(dtype);
    return dtype == probs_NV.scalar_type() ? at::mm(probs_NV.t(), scaled_h) : at::mm(probs_NV.t(), scaled_h, dtype);
  };
  scale_rows_out(grad_h, tensor_cores ? at::mm(probs_NV, weight_VD, at::kFloat) : at::mm(f32(probs_NV), f32(weight_VD)),
                 a);
  auto grad_w = weight_grad(weight_grad_dtype);
  if (far_count.read() == 0) return {grad_h, grad_w};
  // The far rows (rare: a target's log-prob below about -56) as the default path does them
  // (kernels/logprobs.hpp's formula): the weight's gradient again in fp32 (unless it was already)
  // while their shares are added; their fp32 logits recomputed (as model::lm_logits), dz = g
  // (onehot - exp(z - lse)) in hidden's dtype, then their hidden rows (0 so far) and their
  // shares; kFarRowsChunk at a time.
  if (grad_w.scalar_type() != at::kFloat) {
    grad_w = at::Tensor();  // freed before its fp32 form is made
    grad_w = weight_grad(at::kFloat);
  }
  const auto far_rows = far.nonzero().squeeze(1);  // [F] int64
  constexpr int64_t kFarRowsChunk = 256;
  for (int64_t s = 0; s < far_rows.size(0); s += kFarRowsChunk) {
    const auto rows = far_rows.narrow(0, s, std::min(kFarRowsChunk, far_rows.size(0) - s));
    const auto h = hidden_ND.index_select(0, rows);                                     // [F, D]
    auto z = tensor_cores ? at::mm(h, weight_VD.t(), at::kFloat) : at::mm(f32(h), f32(weight_VD).t());  // [F, V]
    const auto g = f32(g_N.index_select(0, rows)).unsqueeze(1);                         // [F, 1]
    auto dz = z.sub_(f32(lse_N.index_select(0, rows)).unsqueeze(1)).exp_().mul_(g.neg());
    dz.scatter_add_(1, t.index_select(0, rows), g);                                     // + g at the target
    const auto dz16 = dz.to(hidden_ND.scalar_type());
    grad_h.index_copy_(0, rows, (tensor_cores ? at::mm(dz16, weight_VD, at::kFloat) : at::mm(f32(dz16), f32(weight_VD)))
                                    .to(grad_h.scalar_type()));
    add_into(grad_w, dz16.t(), h);
  }
  return {grad_h, grad_w.to(weight_grad_dtype)};
}

at::Tensor lm_head_target_logprobs_ref(const at::Tensor& hidden_ND, const at::Tensor& weight_VD,
                                       const at::Tensor& targets_N, const at::Tensor& lse_N) {
  const int64_t V = weight_VD.size(0);
  const auto valid = targets_N.ge(0).logical_and_(targets_N.lt(V));                 // [N]
  auto rows = weight_VD.index_select(0, targets_N.clamp(0, V - 1)).to(at::kFloat);  // [N, D]
  auto lp = rows.mul_(hidden_ND.to(at::kFloat)).sum(1).sub_(lse_N.to(at::kFloat));   // [N]
  return lp.masked_fill_(valid.logical_not(), 0.0);
}

at::Tensor lm_head_target_logprobs(const at::Tensor& hidden_ND, const at::Tensor& weight_VD,
                                   const at::Tensor& targets_N, const at::Tensor& lse_N) {
  TORCH_CHECK(hidden_ND.dim() == 2 && weight_VD.dim() == 2 && hidden_ND.size(1) == weight_VD.size(1) &&
                  weight_VD.size(0) > 0 && hidden_ND.scalar_type() == weight_VD.scalar_type(),
              "lm_head_target_logprobs: hidden [N, D] and weight [V, D] (V > 0) of one dtype expected, got ",
              hidden_ND.sizes(), " ", hidden_ND.scalar_type(), " and ", weight_VD.sizes(), " ",
              weight_VD.scalar_type());
  const int64_t N = hidden_ND.size(0);
  TORCH_CHECK(targets_N.dim() == 1 && targets_N.size(0) == N && targets_N.scalar_type() == at::kLong &&
                  lse_N.dim() == 1 && lse_N.size(0) == N && lse_N.scalar_type() == at::kFloat,
              "lm_head_target_logprobs: targets [", N, "] int64 and lse [", N, "] fp32 expected, got ",
              targets_N.sizes(), " ", targets_N.scalar_type(), " and ", lse_N.sizes(), " ", lse_N.scalar_type());
  TORCH_CHECK(weight_VD.device() == hidden_ND.device() && targets_N.device() == hidden_ND.device() &&
                  lse_N.device() == hidden_ND.device(),
              "lm_head_target_logprobs: every tensor on ", hidden_ND.device(), ", got weight on ", weight_VD.device(),
              ", targets on ", targets_N.device(), ", lse on ", lse_N.device());
#ifdef KILN_CUDA
  if (hidden_ND.is_cuda() && hidden_ND.scalar_type() == at::kBFloat16 && hidden_ND.size(1) > 0 &&
      hidden_ND.size(1) % 8 == 0) {
    const c10::cuda::CUDAGuard device(hidden_ND.device());
    auto h = aligned_contiguous(hidden_ND), w = aligned_contiguous(weight_VD);
    auto t = targets_N.contiguous(), l = lse_N.contiguous();
    auto out = at::empty({N}, lse_N.options());
    cuda::LmHeadTargetArgs a;
    a.hidden = h.data_ptr();
    a.weight = w.data_ptr();
    a.targets = t.data_ptr<int64_t>();
    a.lse = l.data_ptr<float>();
    a.out = out.data_ptr<float>();
    a.N = N;
    a.D = h.size(1);
    a.V = w.size(0);
    a.stream = at::cuda::getCurrentCUDAStream(h.device().index()).stream();
    cuda::lm_head_target_logprobs(a);
    return out;
  }
#endif
  return lm_head_target_logprobs_ref(hidden_ND, weight_VD, targets_N, lse_N);
}

at::Tensor lm_head_target_logits(const at::Tensor& hidden_ND, const at::Tensor& weight_VD, const at::Tensor& targets_N) {
  return lm_head_target_logprobs(hidden_ND, weight_VD, targets_N,
                                 at::zeros({hidden_ND.size(0)}, hidden_ND.options().dtype(at::kFloat)));
}

std::pair<at::Tensor, at::Tensor> lm_head_probs_lse_ref(const at::Tensor& hidden_ND, const at::Tensor& weight_VD,
                                                        const at::Tensor& reference_N, const at::Tensor& probs_NV) {
  const auto t = hidden_ND.scalar_type();
  auto z = hidden_ND.is_cuda() && (t == at::kBFloat16 || t == at::kHalf)
               ? at::mm(hidden_ND, weight_VD.t(), at::kFloat)
               : at::mm(hidden_ND.to(at::kFloat), weight_VD.to(at::kFloat).t());  // [N, V] fp32 sums
  const auto c = reference_N.to(at::kFloat).unsqueeze(1);                            // [N, 1]
  probs_NV.copy_(z.sub(c).exp_().clamp_max_(18446744073709551616.0));               // 2^64, as the kernel
  return {at::logsumexp(z, {1}), probs_NV.to(at::kFloat).sum(1).log_().add_(c.squeeze(1))};
}

}  // namespace kiln::kernels
