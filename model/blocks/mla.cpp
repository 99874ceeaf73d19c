#include "model/blocks/mla.hpp"

#include <algorithm>

#include "kernels/attention.hpp"

namespace kiln::model {

namespace {
torch::nn::Linear linear(int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); }
}  // namespace

MLAImpl::MLAImpl(const MLAOptions& opt) : o_(opt) {
  const auto& c = opt;
  const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  if (c.q_lora_rank) {
    q_a = register_module("q_a", linear(c.hidden, *c.q_lora_rank));
    // transformers builds Glm4MoeLiteRMSNorm(q_lora_rank) and kv_a_layernorm with eps 1e-6.
    q_a_norm = register_module("q_a_norm", RMSNorm(*c.q_lora_rank, 1e-6));
    q_b = register_module("q_b", linear(*c.q_lora_rank, c.num_heads * qk));
  } else {
    q = register_module("q", linear(c.hidden, c.num_heads * qk));
  }
  kv_a = register_module("kv_a", linear(c.hidden, c.kv_lora_rank + c.qk_rope_head_dim));
  kv_a_norm = register_module("kv_a_norm", RMSNorm(c.kv_lora_rank, 1e-6));
  kv_b = register_module("kv_b", linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)));
  o = register_module("o", linear(c.num_heads * c.v_head_dim, c.hidden));
}

torch::Tensor MLAImpl::forward(const torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cu_seqlens,
                               int64_t max_seqlen) {
  const int64_t T = x.size(0), H = o_.num_heads, N = o_.qk_nope_head_dim, R = o_.qk_rope_head_dim,
                V = o_.v_head_dim, C = o_.kv_lora_rank;
  auto qs = (q_a ? q_b(q_a_norm(q_a(x))) : q(x)).view({T, H, N + R});  // [T, H, N+R]
  auto q_nope = qs.narrow(-1, 0, N);
  auto q_rope = apply_rope(qs.narrow(-1, N, R), positions, o_.rope_theta, o_.rope_interleave);
  auto ckv = kv_a(x);                                                   // [T, C+R]
  auto latent = kv_a_norm(ckv.narrow(-1, 0, C));                        // [T, C]
  auto k_rope = apply_rope(ckv.narrow(-1, C, R).unsqueeze(1), positions, o_.rope_theta, o_.rope_interleave);  // [T, 1, R]
  auto kv = kv_b(latent).view({T, H, N + V});                           // [T, H, N+V]
  auto k = torch::cat({kv.narrow(-1, 0, N), k_rope.expand({T, H, R})}, -1);  // [T, H, N+R]
  auto v = kv.narrow(-1, N, V);                                         // [T, H, V]
  auto qf = torch::cat({q_nope, q_rope}, -1);                          // [T, H, N+R]
  // Each document attends only to itself: FlashAttention varlen on CUDA, per-document SDPA
  // elsewhere (kernels/attention.hpp).
  auto attn = kernels::varlen_attention(qf, k, v, cu_seqlens, o_.softmax_scale, max_seqlen);  // [T, H, V]
  return o(attn.reshape({T, H * V}));
}

// The training path's arithmetic on cached latents: expand each sequence's latents through
// kv_b to per-head keys and values (as forward() does for the whole document) and run the
// same FlashAttention kernel, end-aligned causal. Costs a kv_b GEMM over every cached token per
// step, but rollout log-probs then follow the trainer's (same roundings, same kernel).
torch::Tensor MLAImpl::cached_expanded(const torch::Tensor& q, const std::vector<CachedSlice>& slices,
                                       torch::Tensor& cache) {
  const int64_t H = o_.num_heads, Nd = o_.qk_nope_head_dim, R = o_.qk_rope_head_dim, V = o_.v_head_dim,
                C = o_.kv_lora_rank, BS = cache.size(1);
  std::vector<int64_t> slots, cu_q{0}, cu_k{0};
  int64_t max_q = 0, max_k = 0;
  for (const auto& s : slices) {
    const int64_t L = s.cached + s.count;
    for (int64_t p = 0; p < L; ++p) slots.push_back((*s.blocks)[p / BS] * BS + p % BS);
    cu_q.push_back(cu_q.back() + s.count);
    cu_k.push_back(cu_k.back() + L);
    max_q = std::max(max_q, s.count);
    max_k = std::max(max_k, L);
  }
  const auto dev = q.device();
  auto kv = cache.view({-1, C + R}).index_select(0, torch::tensor(slots, torch::kInt64).to(dev));  // [Tk, C+R]
  const int64_t Tk = kv.size(0);
  auto kvb = kv_b(kv.narrow(-1, 0, C)).view({Tk, H, Nd + V});                                     // [Tk, H, Nd+V]
  auto k = torch::cat({kvb.narrow(-1, 0, Nd), kv.narrow(-1, C, R).unsqueeze(1).expand({Tk, H, R})}, -1);
  auto attn = kernels::varlen_attention_cached(q, k, kvb.narrow(-1, Nd, V), torch::tensor(cu_q), torch::tensor(cu_k),
                                               o_.softmax_scale, max_q, max_k);                   // [N, H, V]
  return o(attn.reshape({q.size(0), H * V}));
}

torch::Tensor MLAImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& positions,
                                     const std::vector<CachedSlice>& slices, torch::Tensor& cache) {
  const int64_t N = x.size(0), H = o_.num_heads, Nd = o_.qk_nope_head_dim, R = o_.qk_rope_head_dim,
                V = o_.v_head_dim, C = o_.kv_lora_rank, BS = cache.size(1);
  auto qs = (q_a ? q_b(q_a_norm(q_a(x))) : q(x)).view({N, H, Nd + R});                        // [N, H, Nd+R]
  auto q_nope = qs.narrow(-1, 0, Nd);
  auto q_rope = apply_rope(qs.narrow(-1, Nd, R), positions, o_.rope_theta, o_.rope_interleave);  // [N, H, R]
  auto ckv = kv_a(x);                                                                          // [N, C+R]
  auto latent = kv_a_norm(ckv.narrow(-1, 0, C));                                               // [N, C]
  auto k_rope = apply_rope(ckv.narrow(-1, C, R).unsqueeze(1), positions, o_.rope_theta, o_.rope_interleave).squeeze(1);
  // Write the new entries into their pages.
  auto flat = cache.view({-1, C + R});                                                         // [blocks*BS, C+R]
  std::vector<int64_t> new_slots;
  new_slots.reserve(N);
  for (const auto& s : slices)
    for (int64_t j = 0; j < s.count; ++j) {
      int64_t pos = s.cached + j;
      new_slots.push_back((*s.blocks)[pos / BS] * BS + pos % BS);
    }
  auto slot_t = torch::tensor(new_slots, torch::kInt64).to(x.device());
  flat.index_copy_(0, slot_t, torch::cat({latent, k_rope}, -1).to(cache.scalar_type()));
  const bool decode = std::all_of(slices.begin(), slices.end(), [](const CachedSlice& s) { return s.count == 1; });
  if (x.is_cuda() && cache.scalar_type() == x.scalar_type() && !(absorbed_decode_ && decode)) {
    auto q_full = torch::cat({q_nope, q_rope}, -1);                                            // [N, H, Nd+R]
    if (kernels::varlen_attention_uses_flash(q_full, q_full)) return cached_expanded(q_full, slices, cache);
  }
  // Absorb kv_b: W [H, Nd+V, C] -> key part W_uk [H, Nd, C], value part W_uv [H, V, C].
  auto w = kv_b->weight.view({H, Nd + V, C});
  auto w_uk = w.narrow(1, 0, Nd), w_uv = w.narrow(1, Nd, V);
  auto q_lat = torch::einsum("nhd,hdc->nhc", {q_nope, w_uk});                                 // [N, H, C]
  // All slices in one padded batch: B slices, up to n_max new tokens and S_max keys each.
  const int64_t B = int64_t(slices.size());
  int64_t n_max = 0, s_max = 0;
  for (const auto& s : slices) {
    n_max = std::max(n_max, s.count);
    s_max = std::max(s_max, s.cached + s.count);
  }
  std::vector<int64_t> key_slots(B * s_max, 0), query_rows(B * n_max, 0), cached(B), counts(B), lengths(B);
  for (int64_t b = 0; b < B; ++b) {
    const auto& s = slices[b];
    cached[b] = s.cached;
    counts[b] = s.count;
    lengths[b] = s.cached + s.count;
    for (int64_t p = 0; p < lengths[b]; ++p) key_slots[b * s_max + p] = (*s.blocks)[p / BS] * BS + p % BS;
    for (int64_t j = 0; j < s.count; ++j) query_rows[b * n_max + j] = s.start + j;
  }
  auto dev = x.device();
  auto i64 = [&](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64).to(dev); };
  auto kv = flat.index_select(0, i64(key_slots)).view({B, s_max, C + R}).to(x.scalar_type());  // [B, S, C+R]
  auto lat = kv.narrow(-1, 0, C), kr = kv.narrow(-1, C, R);
  auto rows = i64(query_rows);
  auto ql = q_lat.index_select(0, rows).view({B, n_max, H, C});                                  // [B, n, H, C]
  auto qr = q_rope.index_select(0, rows).view({B, n_max, H, R});                                 // [B, n, H, R]
  auto scores = (torch::einsum("bnhc,bsc->bhns", {ql, lat}) + torch::einsum("bnhr,bsr->bhns", {qr, kr})) *
                o_.softmax_scale;                                                                // [B, H, n, S]
  // Query j of slice b sits at position cached_b + j and sees keys 0..cached_b + j; padded
  // queries see key 0 only (their rows are dropped below).
  auto jpos = torch::arange(n_max, torch::kInt64).to(dev).view({1, n_max, 1});
  auto kpos = torch::arange(s_max, torch::kInt64).to(dev).view({1, 1, s_max});
  auto qpos = i64(cached).view({B, 1, 1}) + jpos;                                                 // [B, n, 1]
  auto padded_q = jpos >= i64(counts).view({B, 1, 1});                                            // [B, n, 1]
  auto visible = (kpos <= qpos) | (padded_q & (kpos == 0));                                       // [B, n, S]
  scores = scores.masked_fill(~visible.unsqueeze(1), -std::numeric_limits<float>::infinity());
  auto p = torch::softmax(scores.to(torch::kFloat32), -1).to(x.scalar_type());                  // [B, H, n, S]
  auto o_lat = torch::einsum("bhns,bsc->bnhc", {p, lat});                                        // [B, n, H, C]
  auto out = torch::einsum("bnhc,hvc->bnhv", {o_lat, w_uv}).reshape({B * n_max, H * V});        // [B*n, H*V]
  std::vector<int64_t> keep;
  keep.reserve(N);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < counts[b]; ++j) keep.push_back(b * n_max + j);
  // Slices cover the step's rows in order, so the kept rows are rows 0..N-1.
  return o(out.index_select(0, i64(keep)));
}

}  // namespace kiln::model
