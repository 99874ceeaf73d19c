#include "kernels/attention.hpp"

#include <torch/torch.h>

namespace kiln::kernels {

namespace {
void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "varlen_attention: q, k, v must be [T, H, D], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.sizes() == k.sizes(), "varlen_attention: q ", q.sizes(), " and k ", k.sizes(), " differ");
  TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1), "varlen_attention: v ", v.sizes(),
              " does not match q ", q.sizes(), " in T, H");
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "varlen_attention: cu_seqlens must be [B+1] with B >= 1");
}

#ifdef KILN_CUDA
// FlashAttention-2 varlen through ATen, as a C++ autograd function (ATen's flash ops have
// no autograd formula of their own when called directly).
struct FlashVarlenFn : public torch::autograd::Function<FlashVarlenFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& cu32, int64_t max_seqlen, double scale) {
    auto [out, lse, rng, unused, dbg] = at::_flash_attention_forward(q, k, v, cu32, cu32, max_seqlen, max_seqlen, 0.0,
                                                                     /*is_causal=*/true, false, scale);
    ctx->save_for_backward({q, k, v, out, lse, cu32, rng, unused});
    ctx->saved_data["max"] = max_seqlen;
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto s = ctx->get_saved_variables();
    const int64_t mx = ctx->saved_data["max"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    auto [dq, dk, dv] = at::_flash_attention_backward(g[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[5], mx,
                                                      mx, 0.0, /*is_causal=*/true, s[6], s[7], scale);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
#endif
}  // namespace

at::Tensor varlen_attention_cached_ref(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_q, const at::Tensor& cu_k, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.size(0) == v.size(0) && q.size(1) == k.size(1) &&
                  q.size(2) == k.size(2) && cu_q.sizes() == cu_k.sizes(),
              "varlen_attention_cached: q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv] and cu_q, cu_k [B+1] expected");
  auto cq = cu_q.to(torch::kCPU).to(torch::kInt64), ck = cu_k.to(torch::kCPU).to(torch::kInt64);
  const auto *a = cq.data_ptr<int64_t>(), *c = ck.data_ptr<int64_t>();
  std::vector<at::Tensor> outs;
  for (int64_t b = 0; b + 1 < cq.size(0); ++b) {
    const int64_t n = a[b + 1] - a[b], L = c[b + 1] - c[b];
    TORCH_CHECK(n <= L, "varlen_attention_cached: sequence ", b, " has ", n, " queries but ", L, " keys");
    if (n == 0) continue;
    auto qh = q.narrow(0, a[b], n).transpose(0, 1), kh = k.narrow(0, c[b], L).transpose(0, 1);
    auto vh = v.narrow(0, c[b], L).transpose(0, 1);
    auto visible = torch::arange(L, q.options().dtype(torch::kInt64)).view({1, L}) <=
                   torch::arange(n, q.options().dtype(torch::kInt64)).view({n, 1}) + (L - n);  // [n, L]
    outs.push_back(at::scaled_dot_product_attention(qh, kh, vh, visible, 0.0, false, scale).transpose(0, 1));
  }
  return torch::cat(outs, 0);  // [Tq, H, Dv]
}

at::Tensor varlen_attention_cached(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, int64_t max_q,
                                   int64_t max_k) {
  if (!varlen_attention_uses_flash(q, v)) return varlen_attention_cached_ref(q, k, v, cu_q, cu_k, scale);
#ifdef KILN_CUDA
  torch::NoGradGuard no_grad;
  const int64_t Dqk = q.size(-1), Dv = v.size(-1);
  auto vp = Dv == Dqk ? v : torch::nn::functional::pad(v, torch::nn::functional::PadFuncOptions({0, Dqk - Dv}));
  auto out = std::get<0>(at::_flash_attention_forward(
      q.contiguous(), k.contiguous(), vp.contiguous(), cu_q.to(q.device(), torch::kInt32),
      cu_k.to(q.device(), torch::kInt32), max_q, max_k, 0.0, /*is_causal=*/true, false, scale));
  return Dv == Dqk ? out : out.narrow(-1, 0, Dv);
#else
  return varlen_attention_cached_ref(q, k, v, cu_q, cu_k, scale);
#endif
}

bool varlen_attention_uses_flash(const at::Tensor& q, const at::Tensor& v) {
#ifdef KILN_CUDA
  const auto t = q.scalar_type();
  return q.is_cuda() && (t == at::kBFloat16 || t == at::kHalf) && v.scalar_type() == t && q.size(-1) <= 256 &&
         v.size(-1) <= q.size(-1) && q.size(-1) % 8 == 0;
#else
  return false;
#endif
}

at::Tensor varlen_attention_ref(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_seqlens, double scale) {
  check(q, k, v, cu_seqlens);
  auto cu = cu_seqlens.to(torch::kCPU).to(torch::kInt64);
  const auto* c = cu.data_ptr<int64_t>();
  auto qh = q.transpose(0, 1), kh = k.transpose(0, 1), vh = v.transpose(0, 1);  // [H, T, *]
  std::vector<at::Tensor> outs;
  outs.reserve(std::size_t(cu.size(0) - 1));
  for (int64_t b = 0; b + 1 < cu.size(0); ++b) {
    const int64_t s = c[b], n = c[b + 1] - c[b];
    TORCH_CHECK(n >= 0 && s + n <= q.size(0), "varlen_attention: cu_seqlens not increasing within [0, T]");
    if (n == 0) continue;
    outs.push_back(at::scaled_dot_product_attention(qh.narrow(1, s, n), kh.narrow(1, s, n), vh.narrow(1, s, n), {},
                                                    0.0, /*is_causal=*/true, scale));  // [H, n, Dv]
  }
  TORCH_CHECK(c[cu.size(0) - 1] == q.size(0), "varlen_attention: cu_seqlens ends at ", c[cu.size(0) - 1],
              ", not T = ", q.size(0));
  return torch::cat(outs, 1).transpose(0, 1);  // [T, H, Dv]
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                            double scale, int64_t max_seqlen) {
  check(q, k, v, cu_seqlens);
  if (!varlen_attention_uses_flash(q, v)) return varlen_attention_ref(q, k, v, cu_seqlens, scale);
#ifdef KILN_CUDA
  if (max_seqlen <= 0) {
    auto cu = cu_seqlens.to(torch::kCPU).to(torch::kInt64);
    max_seqlen = (cu.narrow(0, 1, cu.size(0) - 1) - cu.narrow(0, 0, cu.size(0) - 1)).max().item<int64_t>();
  }
  auto cu32 = cu_seqlens.to(q.device(), torch::kInt32).contiguous();
  const int64_t Dqk = q.size(-1), Dv = v.size(-1);
  auto vp = Dv == Dqk ? v : torch::nn::functional::pad(v, torch::nn::functional::PadFuncOptions({0, Dqk - Dv}));
  auto out = FlashVarlenFn::apply(q.contiguous(), k.contiguous(), vp.contiguous(), cu32, max_seqlen, scale);
  return Dv == Dqk ? out : out.narrow(-1, 0, Dv);
#else
  return varlen_attention_ref(q, k, v, cu_seqlens, scale);
#endif
}

}  // namespace kiln::kernels
