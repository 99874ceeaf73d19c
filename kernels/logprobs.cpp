#include "kernels/logprobs.hpp"

#include <torch/torch.h>

#include "kernels/alignment.hpp"

#ifdef KILN_CUDA
#include "kernels/logprobs_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& z, const at::Tensor& targets) {
  TORCH_CHECK(z.dim() == 2 && targets.dim() == 1 && targets.size(0) == z.size(0),
              "logprob kernels: z must be [n, V] and targets [n], got ", z.sizes(), " and ", targets.sizes());
}
bool half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }
// The kernels take fp32 or 16-bit logits and write 16-bit outputs of the model's dtype.
bool use_cuda(const at::Tensor& z, at::ScalarType out) {
#ifdef KILN_CUDA
  return z.is_cuda() && half(out) && (z.scalar_type() == at::kFloat || z.scalar_type() == out);
#else
  return false;
#endif
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_chunk_forward_ref(const at::Tensor& z_in,
                                                                                     const at::Tensor& targets,
                                                                                     bool with_entropy,
                                                                                     const at::Tensor& keep,
                                                                                     KeptStats* kept) {
  check(z_in, targets);
  if (keep.defined()) {
    const_cast<at::Tensor&>(keep).copy_(z_in);
    if (kept) {
      auto zk = keep.to(at::kFloat);
      kept->lse = zk.logsumexp(-1);
      if (with_entropy) kept->mean_z = ((zk - kept->lse.unsqueeze(1)).exp() * zk).sum(-1);
    }
  }
  auto z = z_in.to(at::kFloat);
  auto l = z.logsumexp(-1);                                                     // [n]
  auto valid = targets >= 0;
  auto picked = z.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1);
  auto logp = torch::where(valid, picked - l, torch::zeros_like(l));
  at::Tensor ent, mean_z;
  if (with_entropy) {
    mean_z = ((z - l.unsqueeze(1)).exp() * z).sum(-1);                          // E_p[z]
    ent = l - mean_z;
  }
  return {logp, l, ent, mean_z};
}

at::Tensor logprob_chunk_backward_ref(const at::Tensor& z_in, const at::Tensor& targets, const at::Tensor& lse,
                                      const at::Tensor& g_lp, const at::Tensor& g_ent, const at::Tensor& mean_z,
                                      at::ScalarType out_dtype) {
  check(z_in, targets);
  auto z = z_in.to(at::kFloat);
  auto p = (z - lse.unsqueeze(1)).exp();
  auto g = g_lp.unsqueeze(1);
  auto dz = -p * g;                                                             // onehot(y) - p, scaled
  dz.scatter_add_(1, targets.clamp_min(0).unsqueeze(1), g);
  if (g_ent.defined()) dz -= g_ent.unsqueeze(1) * p * (z - mean_z.unsqueeze(1));
  return dz.to(out_dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_chunk_forward(const at::Tensor& z,
                                                                                 const at::Tensor& targets,
                                                                                 bool with_entropy,
                                                                                 const at::Tensor& keep,
                                                                                 KeptStats* kept) {
  const auto model_dtype = keep.defined() ? keep.scalar_type() : (half(z.scalar_type()) ? z.scalar_type() : at::kBFloat16);
  if (!use_cuda(z, model_dtype) || (keep.defined() && (!keep.is_contiguous() || keep.sizes() != z.sizes())) ||
      !aligned16(z) || (keep.defined() && !aligned16(keep)))  // the kernels' vector loads and stores
    return logprob_chunk_forward_ref(z, targets, with_entropy, keep, kept);
#ifdef KILN_CUDA
  check(z, targets);
  auto fopt = z.options().dtype(at::kFloat);
  const int64_t n = z.size(0);
  auto logp = torch::empty({n}, fopt), lse = torch::empty({n}, fopt);
  at::Tensor ent, mean_z;
  if (with_entropy) {
    ent = torch::empty({n}, fopt);
    mean_z = torch::empty({n}, fopt);
  }
  auto zc = z.contiguous();
  auto tc = targets.to(z.device(), at::kLong).contiguous();
  at::Tensor kc = keep, klse, kmz;
  if (keep.defined()) {
    klse = torch::empty({n}, fopt);
    if (with_entropy) kmz = torch::empty({n}, fopt);
  }
  cuda::logprob_forward(zc, tc, logp, lse, with_entropy ? &ent : nullptr, with_entropy ? &mean_z : nullptr,
                        keep.defined() ? &kc : nullptr, keep.defined() ? &klse : nullptr,
                        keep.defined() && with_entropy ? &kmz : nullptr, model_dtype);
  if (kept && keep.defined()) *kept = KeptStats{klse, kmz};
  return {logp, lse, ent, mean_z};
#else
  return logprob_chunk_forward_ref(z, targets, with_entropy, keep, kept);
#endif
}

at::Tensor logprob_chunk_backward(const at::Tensor& z, const at::Tensor& targets, const at::Tensor& lse,
                                  const at::Tensor& g_lp, const at::Tensor& g_ent, const at::Tensor& mean_z,
                                  at::ScalarType out_dtype, const at::Tensor& out) {
  if (out.defined())
    TORCH_CHECK(out.sizes() == z.sizes() && out.scalar_type() == out_dtype && out.is_contiguous() &&
                    out.device() == z.device(),
                "logprob_chunk_backward: out must be a contiguous ", z.sizes(), " ", out_dtype, " tensor on ",
                z.device(), ", got ", out.sizes(), " ", out.scalar_type(), " on ", out.device());
  if (!use_cuda(z, out_dtype)) {
    auto dz = logprob_chunk_backward_ref(z, targets, lse, g_lp, g_ent, mean_z, out_dtype);
    return out.defined() ? out.copy_(dz) : dz;
  }
#ifdef KILN_CUDA
  check(z, targets);
  // The kernel's 16-byte loads and vector stores need 16-byte aligned rows: a view that starts
  // elsewhere is copied (z) or written through a fresh tensor (out).
  auto zc = aligned16(z) ? z.contiguous() : z.clone(at::MemoryFormat::Contiguous);
  const bool into_out = out.defined() && aligned16(out);
  auto dz = into_out ? out : torch::empty(zc.sizes(), zc.options().dtype(out_dtype));
  auto tc = targets.to(z.device(), at::kLong).contiguous();
  auto lc = lse.to(at::kFloat).contiguous(), gc = g_lp.to(at::kFloat).contiguous();
  at::Tensor ge, mz;
  if (g_ent.defined()) {
    ge = g_ent.to(at::kFloat).contiguous();
    mz = mean_z.to(at::kFloat).contiguous();
  }
  cuda::logprob_backward(zc, tc, lc, gc, g_ent.defined() ? &ge : nullptr, g_ent.defined() ? &mz : nullptr, dz);
  return out.defined() && !into_out ? out.copy_(dz) : dz;
#else
  return logprob_chunk_backward_ref(z, targets, lse, g_lp, g_ent, mean_z, out_dtype);
#endif
}

}  // namespace kiln::kernels
