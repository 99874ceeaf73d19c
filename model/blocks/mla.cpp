#include "model/blocks/mla.hpp"

#include <algorithm>
#include <tuple>

#include "kernels/attention.hpp"
#include "kernels/batch_invariant.hpp"
#include "kernels/mla_decode.hpp"
#include "kernels/mla_rope.hpp"
#include "model/blocks/fusions.hpp"

namespace kiln::model {

namespace {
torch::nn::Linear linear(int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); }

// [B, s_max]: cache row of every position p < s_max of every row of `table` [B, W] (pages of
// `block_size`), 0 at and past lengths [B].
torch::Tensor slots_of(const torch::Tensor& table, const torch::Tensor& lengths, int64_t s_max, int64_t block_size) {
  auto p = torch::arange(s_max, table.options()).view({1, s_max});
  auto slots = table.index_select(1, p.view({-1}).div(block_size, "floor")) * block_size + p.remainder(block_size);
  return slots.masked_fill(p >= lengths.view({-1, 1}), 0);
}
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

int64_t MLAImpl::parameter_count(const MLAOptions& c) {
  const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const int64_t q = c.q_lora_rank ? c.hidden * *c.q_lora_rank + *c.q_lora_rank + *c.q_lora_rank * c.num_heads * qk
                                  : c.hidden * c.num_heads * qk;
  return q + c.hidden * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank +
         c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim) + c.num_heads * c.v_head_dim * c.hidden;
}

torch::Tensor MLAImpl::project(torch::nn::Linear& l, const torch::Tensor& x) {
  return batch_invariant_ ? invariant_linear(x, l->weight) : unsplit_linear(x, l->weight);
}

torch::Tensor MLAImpl::forward(const torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cu_seqlens,
                               int64_t max_seqlen, int64_t position_bound) {
  const int64_t T = x.size(0), H = o_.num_heads, N = o_.qk_nope_head_dim, R = o_.qk_rope_head_dim,
                V = o_.v_head_dim, C = o_.kv_lora_rank;
  // q_a and kv_a read the same x: one function for both (unsplit_linear_pair: x's gradient
  // accumulated by the second GEMM, not added after), the same forward bits.
  torch::Tensor q_low, ckv;  // [T, q_lora_rank] (with q_a), [T, C+R]
  if (q_a && !batch_invariant_) {
    std::tie(q_low, ckv) = unsplit_linear_pair(x, q_a->weight, kv_a->weight);
  } else {
    if (q_a) q_low = project(q_a, x);
    ckv = project(kv_a, x);
  }
  const auto q_in = q_a ? q_a_norm(q_low) : x;  // [T, q_lora_rank] or [T, hidden]
  auto& q_proj = q_a ? q_b : q;
  // Split, not two narrow views: the backward writes both parts' gradients into one [T, C+R]
  // (a narrow's backward zero-fills a whole [T, C+R] each, then the two are added).
  auto ckv_parts = ckv.split_with_sizes({C, R}, -1);
  auto latent = kv_a_norm(ckv_parts[0]);                                                        // [T, C]
  torch::Tensor qf, k, v;
  const int64_t rope_rows = position_bound > 0 ? position_bound : max_seqlen;
  if (x.is_cuda() && rope_rows > 0) {
    // The query's and keys' rope and the concatenations by kiln's kernels (kernels/mla_rope.hpp),
    // the cos/sin rows from the table the rollout engine reads: the same forward bits as the
    // composite below. Positions lie in [0, rope_rows) (forward's contract). With the training
    // fusions, outside the batch-invariant mode (its own projections), q_b and kv_b run inside the
    // rope's functions: the query rotated in place in q_b's output, and a backward that reads dk
    // and dv as they are.
    const auto table = rope_table(rope_rows, R, o_.rope_theta, x.scalar_type(), x.device());
    const bool fused = !batch_invariant_ && training_fusions();  // model/blocks/fusions.hpp
    qf = !fused ? kernels::mla_rope_q(project(q_proj, q_in).view({T, H, N + R}), N, positions, table.cos,
                                                table.sin, o_.rope_interleave)
                          : kernels::mla_project_rope_q(q_in, q_proj->weight, H, N, positions, table.cos, table.sin,
                                                        o_.rope_interleave);  // [T, H, N+R]
    std::tie(k, v) = !fused
                         ? kernels::mla_rope_kv(project(kv_b, latent).view({T, H, N + V}), ckv_parts[1], N, positions,
                                                table.cos, table.sin, o_.rope_interleave)
                         : kernels::mla_project_rope_kv(latent, kv_b->weight, ckv_parts[1], H, N, positions, table.cos,
                                                        table.sin, o_.rope_interleave);  // [T, H, N+R], [T, H, V]
  } else {
    auto kv = project(kv_b, latent).view({T, H, N + V});  // [T, H, N+V]
    auto qs = project(q_proj, q_in).view({T, H, N + R});  // [T, H, N+R]
    auto q_rope = apply_rope(qs.narrow(-1, N, R), positions, o_.rope_theta, o_.rope_interleave);
    auto k_rope = apply_rope(ckv_parts[1].unsqueeze(1), positions, o_.rope_theta, o_.rope_interleave);  // [T, 1, R]
    k = torch::cat({kv.narrow(-1, 0, N), k_rope.expand({T, H, R})}, -1);                         // [T, H, N+R]
    v = kv.narrow(-1, N, V);                                                                    // [T, H, V]
    qf = torch::cat({qs.narrow(-1, 0, N), q_rope}, -1);                                         // [T, H, N+R]
  }
  // Each document attends only to itself: FlashAttention varlen on CUDA, per-document SDPA
  // elsewhere (kernels/attention.hpp); in the mode the batch-invariant kernel.
  auto attn = batch_invariant_ ? invariant_attention(qf, k, v, cu_seqlens, o_.softmax_scale, max_seqlen)
                               : kernels::varlen_attention(qf, k, v, cu_seqlens, o_.softmax_scale, max_seqlen);  // [T, H, V]
  return project(o, attn.reshape({T, H * V}));
}

CachedLayout::CachedLayout(const std::vector<CachedSlice>& slices, int64_t block_size, torch::Device device)
    : slices_(&slices), block_size_(block_size), batch_(int64_t(slices.size())), device_(device) {
  std::vector<int64_t> rows;
  for (const auto& s : slices) {
    decode_ = decode_ && s.count == 1;
    max_length_ = std::max(max_length_, s.cached + s.count);
    for (int64_t j = 0; j < s.count; ++j) {
      const int64_t pos = s.cached + j;
      rows.push_back((*s.blocks)[pos / block_size] * block_size + pos % block_size);
    }
  }
  new_slots_ = torch::tensor(rows, torch::kInt64).to(device);
}

CachedLayout::CachedLayout(const torch::Tensor& positions, const torch::Tensor& block_table, int64_t block_size)
    : block_size_(block_size), device_(positions.device()) {
  if (positions.dim() != 1 || positions.scalar_type() != torch::kInt64 || block_table.dim() != 2 ||
      block_table.scalar_type() != torch::kInt64 || block_table.size(0) != positions.size(0) ||
      block_table.device() != positions.device() || block_size < 1)
    throw std::invalid_argument("CachedLayout: positions must be [B] int64 and block_table [B, W] int64 on the same "
                                "device, block_size >= 1; got positions " + c10::str(positions.sizes()) + " " +
                                c10::toString(positions.scalar_type()) + ", block_table " +
                                c10::str(block_table.sizes()) + " " + c10::toString(block_table.scalar_type()) +
                                ", block_size " + std::to_string(block_size));
  const int64_t B = positions.size(0), BS = block_size;
  batch_ = B;
  max_length_ = std::max<int64_t>(1, block_table.size(1) * BS);
  auto opts = positions.options();
  // The new token's row: its page (block_table[b, pos / BS]) and offset.
  new_slots_ = block_table.gather(1, positions.div(BS, "floor").unsqueeze(1)).squeeze(1) * BS + positions.remainder(BS);
  Padded d;
  d.n_max = 1;
  d.s_max = block_table.size(1) * BS;
  d.query_rows = torch::arange(B, opts);
  d.cached = positions;
  d.counts = torch::ones({B}, opts);
  d.keep = torch::arange(B, opts);
  d.block_table = block_table;
  d.lengths = positions + 1;
  padded_ = std::move(d);
}

const std::vector<CachedSlice>& CachedLayout::slices() const {
  static const std::vector<CachedSlice> none;
  return slices_ ? *slices_ : none;
}

std::pair<torch::Tensor, torch::Tensor> CachedLayout::block_table_padded(int64_t s_max) const {
  const int64_t B = int64_t(slices_->size()), BS = block_size_, nb = std::max<int64_t>(1, (s_max + BS - 1) / BS);
  std::vector<int64_t> table(static_cast<std::size_t>(B * nb), 0), lengths(static_cast<std::size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const auto& s = (*slices_)[std::size_t(b)];
    lengths[std::size_t(b)] = s.cached + s.count;
    const int64_t used = (lengths[std::size_t(b)] + BS - 1) / BS;
    for (int64_t k = 0; k < used; ++k) table[std::size_t(b * nb + k)] = (*s.blocks)[std::size_t(k)];
  }
  auto i64 = [&](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64).to(device_); };
  return {i64(table).view({B, nb}), i64(lengths)};
}

// [B, s_max]: cache row of every position p < s_max of every slice (0 at and past its length),
// computed on the device from the slices' block tables (one small copy per step).
torch::Tensor CachedLayout::key_slots_padded(int64_t s_max) const {
  auto [table, lengths] = block_table_padded(s_max);
  return slots_of(table, lengths, s_max, block_size_);  // [B, s_max]
}

const CachedLayout::Varlen& CachedLayout::varlen() const {
  if (varlen_) return *varlen_;
  if (!slices_) throw std::logic_error("CachedLayout::varlen: a layout of device tensors has the padded form only");
  Varlen v;
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (const auto& s : *slices_) {
    cu_q.push_back(cu_q.back() + s.count);
    cu_k.push_back(cu_k.back() + s.cached + s.count);
    v.max_q = std::max(v.max_q, s.count);
    v.max_k = std::max(v.max_k, s.cached + s.count);
  }
  auto padded = key_slots_padded(v.max_k);  // [B, max_k]
  auto p = torch::arange(v.max_k, torch::TensorOptions().dtype(torch::kInt64).device(device_)).view({1, -1});
  auto lengths = (torch::tensor(cu_k, torch::kInt64).diff()).to(device_).view({-1, 1});
  v.key_slots = padded.masked_select(p < lengths);  // [Tk], row-major: slices in order
  v.cu_q = torch::tensor(cu_q, torch::kInt64);
  v.cu_k = torch::tensor(cu_k, torch::kInt64);
  varlen_ = std::move(v);
  return *varlen_;
}

const CachedLayout::Padded& CachedLayout::padded() const {
  if (padded_) return *padded_;
  Padded d;
  const int64_t B = int64_t(slices_->size());
  for (const auto& s : *slices_) {
    d.n_max = std::max(d.n_max, s.count);
    d.s_max = std::max(d.s_max, s.cached + s.count);
  }
  std::vector<int64_t> query_rows(static_cast<std::size_t>(B * d.n_max), 0), cached(static_cast<std::size_t>(B), 0),
      counts(static_cast<std::size_t>(B), 0), keep;
  for (int64_t b = 0; b < B; ++b) {
    const auto& s = (*slices_)[std::size_t(b)];
    cached[std::size_t(b)] = s.cached;
    counts[std::size_t(b)] = s.count;
    for (int64_t j = 0; j < s.count; ++j) {
      query_rows[std::size_t(b * d.n_max + j)] = s.start + j;
      keep.push_back(b * d.n_max + j);  // slices cover the step's rows in order
    }
  }
  auto i64 = [&](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64).to(device_); };
  std::tie(d.block_table, d.lengths) = block_table_padded(d.s_max);
  d.query_rows = i64(query_rows);
  d.cached = i64(cached);
  d.counts = i64(counts);
  d.keep = i64(keep);
  padded_ = std::move(d);
  return *padded_;
}

const torch::Tensor& CachedLayout::padded_key_slots() const {
  if (!padded_key_slots_) {
    const auto& P = padded();
    padded_key_slots_ = slots_of(P.block_table, P.lengths, P.s_max, block_size_).view({-1});
  }
  return *padded_key_slots_;
}

// The training path's arithmetic on cached latents: expand each sequence's latents through
// kv_b to per-head keys and values (as forward() does for the whole document) and run the
// same FlashAttention kernel, end-aligned causal. Costs a kv_b GEMM over every cached token per
// step, but rollout log-probs then follow the trainer's (same roundings, same kernel). In the
// batch-invariant mode: kernels::bi_linear and kernels::bi_attention, the trainer's bits.
torch::Tensor MLAImpl::cached_expanded(const torch::Tensor& q, const CachedLayout& layout, torch::Tensor& cache) {
  const int64_t H = o_.num_heads, Nd = o_.qk_nope_head_dim, R = o_.qk_rope_head_dim, V = o_.v_head_dim,
                C = o_.kv_lora_rank;
  const auto& L = layout.varlen();
  auto kv = cache.view({-1, C + R}).index_select(0, L.key_slots);                                // [Tk, C+R]
  const int64_t Tk = kv.size(0);
  auto kvb = project(kv_b, kv.narrow(-1, 0, C)).view({Tk, H, Nd + V});                            // [Tk, H, Nd+V]
  auto k = torch::cat({kvb.narrow(-1, 0, Nd), kv.narrow(-1, C, R).unsqueeze(1).expand({Tk, H, R})}, -1);
  auto attn = batch_invariant_
                  ? kernels::bi_attention(q, k, kvb.narrow(-1, Nd, V), L.cu_q, L.cu_k, o_.softmax_scale)
                  : kernels::varlen_attention_cached(q, k, kvb.narrow(-1, Nd, V), L.cu_q, L.cu_k, o_.softmax_scale,
                                                     L.max_q, L.max_k);                           // [N, H, V]
  return project(o, attn.reshape({q.size(0), H * V}));
}

torch::Tensor MLAImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& positions, const CachedLayout& layout,
                                     torch::Tensor& cache) {
  const int64_t N = x.size(0), H = o_.num_heads, Nd = o_.qk_nope_head_dim, R = o_.qk_rope_head_dim,
                V = o_.v_head_dim, C = o_.kv_lora_rank;
  auto qs = (q_a ? project(q_b, q_a_norm(project(q_a, x))) : project(q, x)).view({N, H, Nd + R});  // [N, H, Nd+R]
  auto q_nope = qs.narrow(-1, 0, Nd);
  // Rope from the cached cos/sin table (one kernel on CUDA), the same bits as forward()'s.
  const int64_t max_len = layout.max_length();
  auto q_rope = apply_rope_cached(qs.narrow(-1, Nd, R), positions, max_len, o_.rope_theta, o_.rope_interleave);  // [N, H, R]
  auto ckv = project(kv_a, x);                                                                 // [N, C+R]
  auto latent = kv_a_norm(ckv.narrow(-1, 0, C));                                               // [N, C]
  auto k_rope =
      apply_rope_cached(ckv.narrow(-1, C, R).unsqueeze(1), positions, max_len, o_.rope_theta, o_.rope_interleave).squeeze(1);
  // Write the new entries into their pages.
  auto flat = cache.view({-1, C + R});                                                         // [blocks*BS, C+R]
  flat.index_copy_(0, layout.new_slots(), torch::cat({latent, k_rope}, -1).to(cache.scalar_type()));
  if (batch_invariant_) {  // the trainer's formula, whatever the device (the cache holds the trainer's values)
    TORCH_CHECK(cache.scalar_type() == x.scalar_type(), "MLA forward_cached: the batch-invariant mode needs the cache in ",
                "the model's dtype ", x.scalar_type(), ", got ", cache.scalar_type());
    return cached_expanded(torch::cat({q_nope, q_rope}, -1), layout, cache);
  }
  if (x.is_cuda() && cache.scalar_type() == x.scalar_type() && !layout.on_device_only() &&
      !(absorbed_decode_ && layout.decode())) {
    auto q_full = torch::cat({q_nope, q_rope}, -1);                                            // [N, H, Nd+R]
    if (kernels::varlen_attention_uses_flash(q_full, q_full)) return cached_expanded(q_full, layout, cache);
  }
  // Absorb kv_b: W [H, Nd+V, C] -> key part W_uk [H, Nd, C], value part W_uv [H, V, C].
  auto w = kv_b->weight.view({H, Nd + V, C});
  auto w_uk = w.narrow(1, 0, Nd), w_uv = w.narrow(1, Nd, V);
  auto q_lat = torch::einsum("nhd,hdc->nhc", {q_nope, w_uk});                                 // [N, H, C]
  if (decode_kernel_ && layout.decode() && cache.scalar_type() == x.scalar_type() &&
      kernels::mla_decode_kernel_supports(q_lat, q_rope, cache)) {
    // One token per slice, slices in step order: row b is slice b's token, at position
    // lengths[b] - 1, its entry written above.
    const auto& P = layout.padded();
    auto o_lat = kernels::mla_decode_attention(q_lat, q_rope, cache, P.block_table, P.lengths,
                                               o_.softmax_scale);                                // [N, H, C]
    return project(o, torch::einsum("nhc,hvc->nhv", {o_lat, w_uv}).reshape({N, H * V}));
  }
  // All slices in one padded batch: B slices, up to n_max new tokens and s_max keys each.
  const auto& P = layout.padded();
  const int64_t B = layout.batch(), n_max = P.n_max, s_max = P.s_max;
  auto dev = x.device();
  auto kv = flat.index_select(0, layout.padded_key_slots()).view({B, s_max, C + R}).to(x.scalar_type());    // [B, S, C+R]
  auto lat = kv.narrow(-1, 0, C), kr = kv.narrow(-1, C, R);
  auto ql = q_lat.index_select(0, P.query_rows).view({B, n_max, H, C});                         // [B, n, H, C]
  auto qr = q_rope.index_select(0, P.query_rows).view({B, n_max, H, R});                        // [B, n, H, R]
  auto scores = (torch::einsum("bnhc,bsc->bhns", {ql, lat}) + torch::einsum("bnhr,bsr->bhns", {qr, kr})) *
                o_.softmax_scale;                                                                // [B, H, n, S]
  // Query j of slice b sits at position cached_b + j and sees keys 0..cached_b + j; padded
  // queries see key 0 only (their rows are dropped below).
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(dev);  // made there: no host copy
  auto jpos = torch::arange(n_max, i64).view({1, n_max, 1});
  auto kpos = torch::arange(s_max, i64).view({1, 1, s_max});
  auto qpos = P.cached.view({B, 1, 1}) + jpos;                                                   // [B, n, 1]
  auto padded_q = jpos >= P.counts.view({B, 1, 1});                                              // [B, n, 1]
  auto visible = (kpos <= qpos) | (padded_q & (kpos == 0));                                       // [B, n, S]
  scores = scores.masked_fill(~visible.unsqueeze(1), -std::numeric_limits<float>::infinity());
  auto p = torch::softmax(scores.to(torch::kFloat32), -1).to(x.scalar_type());                  // [B, H, n, S]
  auto o_lat = torch::einsum("bhns,bsc->bnhc", {p, lat});                                        // [B, n, H, C]
  auto out = torch::einsum("bnhc,hvc->bnhv", {o_lat, w_uv}).reshape({B * n_max, H * V});        // [B*n, H*V]
  return project(o, out.index_select(0, P.keep));  // rows 0..N-1
}

}  // namespace kiln::model
