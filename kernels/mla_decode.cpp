#include "kernels/mla_decode.hpp"

#include <torch/torch.h>

#ifdef KILN_CUDA
#include "kernels/mla_decode_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& ql, const at::Tensor& qr, const at::Tensor& cache, const at::Tensor& table,
           const at::Tensor& lengths) {
  TORCH_CHECK(ql.dim() == 3 && qr.dim() == 3 && cache.dim() == 3 && table.dim() == 2 && lengths.dim() == 1,
              "mla_decode_attention: q_latent [B, H, C], q_rope [B, H, R], cache [G, Z, C+R], block_table [B, W] "
              "and lengths [B] expected, got ", ql.sizes(), ", ", qr.sizes(), ", ", cache.sizes(), ", ",
              table.sizes(), ", ", lengths.sizes());
  const int64_t B = ql.size(0), H = ql.size(1), C = ql.size(2), R = qr.size(2);
  TORCH_CHECK(qr.size(0) == B && qr.size(1) == H, "mla_decode_attention: q_rope ", qr.sizes(),
              " does not match q_latent ", ql.sizes(), " in B, H");
  TORCH_CHECK(cache.size(2) == C + R, "mla_decode_attention: cache entries of width ", cache.size(2),
              ", but q_latent's C + q_rope's R = ", C + R);
  TORCH_CHECK(table.size(0) == B && lengths.size(0) == B, "mla_decode_attention: block_table ", table.sizes(),
              " and lengths ", lengths.sizes(), " must have B = ", B, " rows");
  TORCH_CHECK(table.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "mla_decode_attention: block_table and lengths must be int64, got ", table.scalar_type(), " and ",
              lengths.scalar_type());
  TORCH_CHECK(ql.scalar_type() == cache.scalar_type() && qr.scalar_type() == cache.scalar_type(),
              "mla_decode_attention: q_latent (", ql.scalar_type(), ") and q_rope (", qr.scalar_type(),
              ") must have the cache's dtype (", cache.scalar_type(), ")");
  const auto dev = cache.device();
  TORCH_CHECK(ql.device() == dev && qr.device() == dev && table.device() == dev && lengths.device() == dev,
              "mla_decode_attention: q_latent (", ql.device(), "), q_rope (", qr.device(), "), block_table (",
              table.device(), ") and lengths (", lengths.device(), ") must be on the cache's device (", dev, ")");
}
}  // namespace

at::Tensor mla_decode_attention_ref(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
                                    const at::Tensor& block_table, const at::Tensor& lengths, double scale) {
  check(q_latent, q_rope, cache, block_table, lengths);
  const int64_t B = q_latent.size(0), C = q_latent.size(2), Z = cache.size(1), W = block_table.size(1), S = W * Z;
  auto p = torch::arange(S, block_table.options()).view({1, S});
  auto rows = block_table.index_select(1, p.view({-1}).div(Z, "floor")) * Z + p.remainder(Z);   // [B, S]
  auto kv = cache.reshape({-1, cache.size(2)}).index_select(0, rows.view({-1})).view({B, S, -1}).to(at::kFloat);
  auto q = torch::cat({q_latent, q_rope}, -1).to(at::kFloat);                                   // [B, H, C+R]
  auto s = torch::einsum("bhd,bsd->bhs", {q, kv}) * scale;                                      // [B, H, S]
  s = s.masked_fill((p >= lengths.view({B, 1})).unsqueeze(1), -std::numeric_limits<float>::infinity());
  auto out = torch::einsum("bhs,bsc->bhc", {torch::softmax(s, -1), kv.narrow(-1, 0, C)});      // [B, H, C]
  return out.to(cache.scalar_type());
}

bool mla_decode_kernel_supports(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache) {
#ifdef KILN_CUDA
  return q_latent.is_cuda() && q_latent.dim() == 3 && q_rope.dim() == 3 && cache.dim() == 3 &&
         cache.scalar_type() == at::kBFloat16 && q_latent.size(1) <= 32 &&
         cuda::mla_decode_widths_supported(q_latent.size(2), q_rope.size(2));
#else
  (void)q_latent;
  (void)q_rope;
  (void)cache;
  return false;
#endif
}

at::Tensor mla_decode_attention(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
                                const at::Tensor& block_table, const at::Tensor& lengths, double scale) {
  check(q_latent, q_rope, cache, block_table, lengths);
  if (!mla_decode_kernel_supports(q_latent, q_rope, cache))
    return mla_decode_attention_ref(q_latent, q_rope, cache, block_table, lengths, scale);
#ifdef KILN_CUDA
  TORCH_CHECK(cache.is_contiguous(), "mla_decode_attention: the cache must be contiguous (a layer's [G, Z, C+R])");
  auto out = at::empty(q_latent.sizes(), q_latent.options());
  cuda::mla_decode_attention(q_latent.contiguous(), q_rope.contiguous(), cache, block_table.contiguous(),
                             lengths.contiguous(), scale, out);
  return out;
#else
  TORCH_CHECK(false, "mla_decode_attention: unreachable without CUDA");
#endif
}

}  // namespace kiln::kernels
