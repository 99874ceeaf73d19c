#include "model/glm5_next/kda.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace kiln::model::glm5_next {

namespace {
torch::nn::Linear linear(int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); }

// The dtype the gate and state math runs in: fp64 for fp64 inputs (gradient checks), else fp32.
torch::Dtype math_dtype(const torch::Tensor& t) { return t.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat; }
}  // namespace

PaddedDocuments PaddedDocuments::from_cu_seqlens(const torch::Tensor& cu_seqlens, torch::Device device) {
  auto cu = cu_seqlens.to(torch::kCPU).to(torch::kInt64).contiguous();
  if (cu.dim() != 1 || cu.size(0) < 2)
    throw std::invalid_argument("cu_seqlens must be [B+1] with B >= 1, got " + std::to_string(cu.dim()) + " dims");
  const auto* c = cu.data_ptr<int64_t>();
  const int64_t B = cu.size(0) - 1;
  if (c[0] != 0) throw std::invalid_argument("cu_seqlens[0] must be 0, got " + std::to_string(c[0]));
  int64_t L = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (c[b + 1] <= c[b])
      throw std::invalid_argument("cu_seqlens must be strictly increasing: document " + std::to_string(b) + " spans [" +
                                  std::to_string(c[b]) + ", " + std::to_string(c[b + 1]) + ")");
    L = std::max(L, c[b + 1] - c[b]);
  }
  const int64_t T = c[B];
  std::vector<int64_t> gather(static_cast<std::size_t>(B * L), T), keep(static_cast<std::size_t>(T)),
      lengths(static_cast<std::size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    lengths[std::size_t(b)] = c[b + 1] - c[b];
    for (int64_t i = 0; i < c[b + 1] - c[b]; ++i) {
      gather[std::size_t(b * L + i)] = c[b] + i;
      keep[std::size_t(c[b] + i)] = b * L + i;
    }
  }
  PaddedDocuments d;
  d.batch = B;
  d.length = L;
  d.tokens = T;
  d.gather = torch::tensor(gather, torch::kInt64).to(device);
  d.keep = torch::tensor(keep, torch::kInt64).to(device);
  d.valid = (d.gather != T).view({B, L});
  d.lengths = torch::tensor(lengths, torch::kInt64);
  return d;
}

torch::Tensor PaddedDocuments::pad(const torch::Tensor& x) const {
  TORCH_CHECK(x.size(0) == tokens, "PaddedDocuments::pad: expected ", tokens, " rows, got ", x.size(0));
  auto rest = x.sizes().slice(1).vec();
  auto zero_shape = rest;
  zero_shape.insert(zero_shape.begin(), 1);
  auto shape = rest;
  shape.insert(shape.begin(), {batch, length});
  return torch::cat({x, torch::zeros(zero_shape, x.options())}).index_select(0, gather).view(shape);  // [B, L, ...]
}

torch::Tensor PaddedDocuments::unpad(const torch::Tensor& x) const {
  auto rest = x.sizes().slice(2).vec();
  rest.insert(rest.begin(), batch * length);
  return x.reshape(rest).index_select(0, keep);  // [T, ...]
}

torch::Tensor l2_normalize(const torch::Tensor& x, double eps) { return x / torch::sqrt((x * x).sum(-1, true) + eps); }

namespace {
void check_kda_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
                      const torch::Tensor& beta, const std::optional<torch::Tensor>& s0) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && g.sizes() == q.sizes(), "kda: q, k, g must be [B, L, H, K] alike, got ",
              q.sizes(), ", ", k.sizes(), ", ", g.sizes());
  TORCH_CHECK(v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3), "kda: v must be [B, L, H, V], got ", v.sizes());
  TORCH_CHECK(beta.sizes() == q.sizes().slice(0, 3), "kda: beta must be [B, L, H], got ", beta.sizes());
  TORCH_CHECK(!s0 || (s0->dim() == 4 && s0->size(0) == q.size(0) && s0->size(1) == q.size(2) && s0->size(2) == q.size(3) &&
                      s0->size(3) == v.size(3)),
              "kda: initial state must be [B, H, K, V]");
}
}  // namespace

namespace {
// Within each chunk, for j <= s: kk[s, j] = sum_d k_s[d] k_j[d] exp(G_s[d] - G_j[d]) and
// qk[s, j] likewise with q_s; 0 above the diagonal. q, k, G: [B, H, N, C, K], G the in-chunk
// cumulative log decay (non-increasing along C). Sub-blocks of 16 tokens: a diagonal block
// takes the per-channel decays explicitly ([16, 16, K], masked before exp); a block pair a > b
// factors exp(G_s - G_j) = exp(G_s - G_r) exp(G_r - G_j) around r, block b's last token, where
// both exponents are <= 0, and is two matmuls. Memory: T x 16 x K per head instead of T x C x K.
std::pair<torch::Tensor, torch::Tensor> intra_chunk_products(const torch::Tensor& q, const torch::Tensor& k,
                                                             const torch::Tensor& G) {
  const int64_t C = G.size(3), K = G.size(4);
  const int64_t c = (C > 16 && C % 16 == 0) ? 16 : C, M = C / c;
  auto lead = G.sizes().slice(0, 3).vec();  // [B, H, N]
  auto blocks = [&](const torch::Tensor& t) {
    auto shape = lead;
    shape.insert(shape.end(), {M, c, K});
    return t.reshape(shape);  // [B, H, N, M, c, K]
  };
  auto qb = blocks(q), kb = blocks(k), Gb = blocks(G);
  auto after = torch::triu(torch::ones({c, c}, torch::TensorOptions().dtype(torch::kBool).device(G.device())), 1);
  // The difference is masked before exp so that no inf (nor its zero gradient times inf) appears.
  auto decay = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(after.unsqueeze(-1), -std::numeric_limits<double>::infinity()).exp();
  auto kk_diag = (kb.unsqueeze(-2) * kb.unsqueeze(-3) * decay).sum(-1);  // [B, H, N, M, c, c]
  auto qk_diag = (qb.unsqueeze(-2) * kb.unsqueeze(-3) * decay).sum(-1);
  if (M == 1) return {kk_diag.squeeze(3), qk_diag.squeeze(3)};
  std::vector<torch::Tensor> kk_rows, qk_rows;
  for (int64_t a = 0; a < M; ++a) {
    std::vector<torch::Tensor> kk_row, qk_row;
    auto Ga = Gb.select(3, a);                                     // [B, H, N, c, K]
    for (int64_t b = 0; b < a; ++b) {
      auto Gr = Gb.select(3, b).narrow(-2, c - 1, 1);              // [B, H, N, 1, K] block b's last token
      auto right = kb.select(3, b) * (Gr - Gb.select(3, b)).exp();  // exponents <= 0
      auto to_a = (Ga - Gr).exp();                                  // exponents <= 0
      kk_row.push_back(torch::matmul(kb.select(3, a) * to_a, right.transpose(-1, -2)));  // [.., c, c]
      qk_row.push_back(torch::matmul(qb.select(3, a) * to_a, right.transpose(-1, -2)));
    }
    kk_row.push_back(kk_diag.select(3, a));
    qk_row.push_back(qk_diag.select(3, a));
    if (a + 1 < M) {
      auto zeros = torch::zeros(lead, G.options()).unsqueeze(-1).unsqueeze(-1).expand({-1, -1, -1, c, (M - a - 1) * c});
      kk_row.push_back(zeros);
      qk_row.push_back(zeros);
    }
    kk_rows.push_back(torch::cat(kk_row, -1));  // [.., c, C]
    qk_rows.push_back(torch::cat(qk_row, -1));
  }
  return {torch::cat(kk_rows, -2), torch::cat(qk_rows, -2)};  // [B, H, N, C, C]
}
}  // namespace

KdaRecurrence kda_chunked(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                          const torch::Tensor& g_in, const torch::Tensor& beta_in,
                          const std::optional<torch::Tensor>& initial_state, int64_t chunk_size) {
  check_kda_inputs(q_in, k_in, v_in, g_in, beta_in, initial_state);
  TORCH_CHECK(chunk_size >= 1, "kda_chunked: chunk_size must be >= 1, got ", chunk_size);
  const auto md = math_dtype(q_in);
  const int64_t B = q_in.size(0), L = q_in.size(1), H = q_in.size(2), K = q_in.size(3), V = v_in.size(3);
  const int64_t C = chunk_size, pad = (C - L % C) % C, N = (L + pad) / C;
  // [B, L, H, X] -> [B, H, N, C, X], zero-padded to whole chunks (g = beta = 0: no effect).
  auto chunks = [&](const torch::Tensor& t) {
    auto x = torch::constant_pad_nd(t.to(md).transpose(1, 2), {0, 0, 0, pad});  // [B, H, L+pad, X]
    return x.view({B, H, N, C, x.size(-1)});
  };
  auto q = chunks(q_in) * (1.0 / std::sqrt(double(K)));
  auto k = chunks(k_in), v = chunks(v_in);
  auto G = chunks(g_in).cumsum(-2);                                                    // [B, H, N, C, K] cumulative log decay
  auto beta = torch::constant_pad_nd(beta_in.to(md).transpose(1, 2), {0, pad}).view({B, H, N, C, 1});
  auto opts = torch::TensorOptions().dtype(torch::kBool).device(q.device());
  auto not_before = torch::triu(torch::ones({C, C}, opts));  // [s, j]: j >= s
  auto pair = intra_chunk_products(q, k, G);
  auto& kk = pair.first;   // [B, H, N, C, C]: k_s . k_j decayed from j to s (j <= s)
  auto& qk = pair.second;  // [B, H, N, C, C]: q_s . k_j decayed, zero above the diagonal
  // delta_s = beta_s (v_s - S_0^T (e^{G_s} k_s) - sum_{j<s} kk_sj delta_j): (I + strict(beta kk)) delta = U - W S_0.
  auto M = (beta * kk).masked_fill(not_before, 0) + torch::eye(C, q.options());
  auto U = torch::linalg_solve_triangular(M, beta * v, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);  // [.., C, V]
  auto W = torch::linalg_solve_triangular(M, beta * G.exp() * k, false, true, true);                              // [.., C, K]
  auto S = initial_state ? initial_state->to(md) : torch::zeros({B, H, K, V}, q.options());
  std::vector<torch::Tensor> outs;
  for (int64_t n = 0; n < N; ++n) {
    auto Gn = G.select(2, n);                                                        // [B, H, C, K]
    auto delta = U.select(2, n) - torch::matmul(W.select(2, n), S);                  // [B, H, C, V]
    outs.push_back(torch::matmul(q.select(2, n) * Gn.exp(), S) + torch::matmul(qk.select(2, n), delta));
    auto last = Gn.narrow(-2, C - 1, 1);                                             // [B, H, 1, K]
    S = last.squeeze(-2).exp().unsqueeze(-1) * S +
        torch::matmul((k.select(2, n) * (last - Gn).exp()).transpose(-1, -2), delta);  // [B, H, K, V]
  }
  auto out = torch::stack(outs, 2).view({B, H, N * C, V}).narrow(2, 0, L).transpose(1, 2);  // [B, L, H, V]
  return {out, S};
}

KdaRecurrence kda_recurrent(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                            const torch::Tensor& g_in, const torch::Tensor& beta_in,
                            const std::optional<torch::Tensor>& initial_state) {
  check_kda_inputs(q_in, k_in, v_in, g_in, beta_in, initial_state);
  const auto md = math_dtype(q_in);
  const int64_t B = q_in.size(0), L = q_in.size(1), H = q_in.size(2), K = q_in.size(3), V = v_in.size(3);
  auto q = q_in.to(md) * (1.0 / std::sqrt(double(K)));
  auto k = k_in.to(md), v = v_in.to(md), g = g_in.to(md), beta = beta_in.to(md);
  auto S = initial_state ? initial_state->to(md) : torch::zeros({B, H, K, V}, q.options());
  std::vector<torch::Tensor> outs;
  for (int64_t t = 0; t < L; ++t) {
    auto k_t = k.select(1, t);                                           // [B, H, K]
    S = S * g.select(1, t).exp().unsqueeze(-1);                          // decay each key channel
    auto delta = (v.select(1, t) - (S * k_t.unsqueeze(-1)).sum(-2)) * beta.select(1, t).unsqueeze(-1);  // [B, H, V]
    S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2);
    outs.push_back((S * q.select(1, t).unsqueeze(-1)).sum(-2));          // [B, H, V]
  }
  return {torch::stack(outs, 1), S};  // [B, L, H, V]
}

KimiDeltaAttentionImpl::KimiDeltaAttentionImpl(int64_t hidden, const KdaConfig& c, double rms_norm_eps, int64_t chunk_size)
    : c_(c), eps_(rms_norm_eps), chunk_size_(chunk_size) {
  const int64_t H = c.num_heads, K = c.head_dim, HK = H * K, W = c.conv_kernel;
  q_proj = register_module("q_proj", linear(hidden, HK));
  k_proj = register_module("k_proj", linear(hidden, HK));
  v_proj = register_module("v_proj", linear(hidden, HK));
  // Depthwise conv init as torch.nn.Conv1d's (fan-in W).
  const double bound = 1.0 / std::sqrt(double(W));
  q_conv = register_parameter("q_conv", torch::empty({HK, 1, W}).uniform_(-bound, bound));
  k_conv = register_parameter("k_conv", torch::empty({HK, 1, W}).uniform_(-bound, bound));
  v_conv = register_parameter("v_conv", torch::empty({HK, 1, W}).uniform_(-bound, bound));
  f_a_proj = register_module("f_a_proj", linear(hidden, K));
  f_b_proj = register_module("f_b_proj", linear(K, HK));
  dt_bias = register_parameter("dt_bias", torch::zeros({HK}));
  A_log = register_parameter("A_log", torch::zeros({H}));
  b_proj = register_module("b_proj", linear(hidden, H));
  g_a_proj = register_module("g_a_proj", linear(hidden, K));
  g_b_proj = register_module("g_b_proj", linear(K, HK));
  o_norm = register_parameter("o_norm", torch::ones({K}));
  o_proj = register_module("o_proj", linear(HK, hidden));
}

torch::Tensor KimiDeltaAttentionImpl::forget_gate(const torch::Tensor& x) {
  const auto md = math_dtype(x);
  auto shape = x.sizes().slice(0, x.dim() - 1).vec();
  shape.insert(shape.end(), {c_.num_heads, c_.head_dim});
  auto f = (f_b_proj(f_a_proj(x)).to(md) + dt_bias.to(md)).view(shape);  // [..., H, K]
  auto a = A_log.to(md).exp().unsqueeze(-1);                                                 // [H, 1]
  if (c_.lower_bound) return *c_.lower_bound * torch::sigmoid(a * f);  // in (lower_bound, 0)
  return -a * torch::nn::functional::softplus(f);
}

torch::Tensor KimiDeltaAttentionImpl::output(const torch::Tensor& core, const torch::Tensor& x) {
  const auto md = math_dtype(x);
  auto shape = x.sizes().slice(0, x.dim() - 1).vec();
  shape.insert(shape.end(), {c_.num_heads, c_.head_dim});
  auto gate = g_b_proj(g_a_proj(x)).view(shape).to(md);                       // [..., H, K]
  auto c = core.to(x.scalar_type()).to(md);                                   // rounded as transformers does
  auto normed = c * torch::rsqrt(c.pow(2).mean(-1, true) + eps_) * o_norm.to(md) * torch::sigmoid(gate);
  return o_proj(normed.to(x.scalar_type()).flatten(-2));                      // [..., D]
}

torch::Tensor KimiDeltaAttentionImpl::run(const torch::Tensor& x, const torch::Tensor& cu_seqlens, KdaState* state) {
  const int64_t H = c_.num_heads, K = c_.head_dim, HK = H * K, W = c_.conv_kernel;
  const auto md = math_dtype(x);
  auto docs = PaddedDocuments::from_cu_seqlens(cu_seqlens, x.device());
  const int64_t B = docs.batch, L = docs.length;
  auto xp = docs.pad(x);                                                      // [B, L, D], zero past each document
  auto qkv = torch::cat({q_proj(xp), k_proj(xp), v_proj(xp)}, -1);           // [B, L, 3HK]
  auto w = torch::cat({q_conv, k_conv, v_conv}, 0);                          // [3HK, 1, W]
  // Causal depthwise conv in the weights' dtype (fp32 in a bf16 model, as transformers keeps
  // conv1d): W-1 zeros on the left of every document, so no window reaches into the one before.
  auto conv = torch::conv1d(qkv.transpose(1, 2).to(w.scalar_type()), w, {}, 1, W - 1, 1, 3 * HK).narrow(-1, 0, L);
  auto act = torch::silu(conv).to(qkv.scalar_type()).transpose(1, 2).split(HK, -1);  // 3 x [B, L, HK]
  auto q = l2_normalize(act[0].to(md).view({B, L, H, K}));
  auto k = l2_normalize(act[1].to(md).view({B, L, H, K}));
  auto v = act[2].to(md).view({B, L, H, K});
  auto valid = docs.valid.to(md);                                             // [B, L]
  // Padding slots (after a document's end) keep the state as it is: g = 0, beta = 0.
  auto g = forget_gate(xp) * valid.view({B, L, 1, 1});                        // [B, L, H, K]
  auto beta = torch::sigmoid(b_proj(xp).to(md)) * valid.unsqueeze(-1);       // [B, L, H]
  auto r = kda_chunked(q, k, v, g, beta, std::nullopt, chunk_size_);
  if (state) {
    // The last W-1 projected rows of each document (zeros before its start), oldest first.
    auto padded = torch::constant_pad_nd(qkv, {0, 0, W - 1, 0});             // [B, L+W-1, 3HK]
    auto idx = (docs.lengths.view({B, 1}) + torch::arange(W - 1, torch::kInt64).view({1, W - 1})).to(x.device());
    state->conv = padded.gather(1, idx.unsqueeze(-1).expand({B, W - 1, 3 * HK})).transpose(1, 2).contiguous();
    state->recurrent = r.state;
  }
  return output(docs.unpad(r.out), x);                                         // [T, D]
}

torch::Tensor KimiDeltaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cu_seqlens) {
  return run(x, cu_seqlens, nullptr);
}

std::pair<torch::Tensor, KdaState> KimiDeltaAttentionImpl::prefill(const torch::Tensor& x, const torch::Tensor& cu_seqlens) {
  KdaState s;
  auto y = run(x, cu_seqlens, &s);
  return {y, s};
}

KdaState KimiDeltaAttentionImpl::empty_state(int64_t batch, torch::Dtype dtype, torch::Device device) const {
  const int64_t HK = c_.num_heads * c_.head_dim;
  auto o = torch::TensorOptions().device(device);
  return {torch::zeros({batch, 3 * HK, c_.conv_kernel - 1}, o.dtype(dtype)),
          torch::zeros({batch, c_.num_heads, c_.head_dim, c_.head_dim}, o.dtype(dtype == torch::kDouble ? torch::kDouble : torch::kFloat))};
}

torch::Tensor KimiDeltaAttentionImpl::decode_step(const torch::Tensor& x, KdaState& state) {
  const int64_t H = c_.num_heads, K = c_.head_dim, HK = H * K, B = x.size(0);
  TORCH_CHECK(x.dim() == 2 && state.conv.size(0) == B && state.recurrent.size(0) == B, "decode_step: x [B, D] with a state of B = ",
              state.conv.size(0), " sequences, got x ", x.sizes());
  const auto md = math_dtype(x);
  auto qkv = torch::cat({q_proj(x), k_proj(x), v_proj(x)}, -1);                 // [B, 3HK]
  auto window = torch::cat({state.conv.to(qkv.scalar_type()), qkv.unsqueeze(-1)}, -1);  // [B, 3HK, W]
  auto w = torch::cat({q_conv, k_conv, v_conv}, 0).squeeze(1);                        // [3HK, W]
  auto act = torch::silu((window.to(w.scalar_type()) * w).sum(-1)).to(qkv.scalar_type()).split(HK, -1);  // 3 x [B, HK]
  state.conv = window.narrow(-1, 1, window.size(-1) - 1).contiguous();
  auto q = l2_normalize(act[0].to(md).view({B, 1, H, K}));
  auto k = l2_normalize(act[1].to(md).view({B, 1, H, K}));
  auto v = act[2].to(md).view({B, 1, H, K});
  auto g = forget_gate(x).unsqueeze(1);                                         // [B, 1, H, K]
  auto beta = torch::sigmoid(b_proj(x).to(md)).unsqueeze(1);                    // [B, 1, H]
  auto r = kda_recurrent(q, k, v, g, beta, state.recurrent);
  state.recurrent = r.state;
  return output(r.out.squeeze(1), x);                                           // [B, D]
}

torch::Tensor KimiDeltaAttentionImpl::forward_cached(const torch::Tensor& x, const std::vector<CachedSlice>& slices,
                                                    KdaState& slots) {
  const int64_t S = slots.recurrent.size(0);
  for (const auto& s : slices)
    if (s.slot < 0 || s.slot >= S)
      throw std::invalid_argument("KDA forward_cached: a slice (rows " + std::to_string(s.start) + ".." +
                                  std::to_string(s.start + s.count) + ") has slot " + std::to_string(s.slot) +
                                  ", the cache has slots [0, " + std::to_string(S) + ")");
  auto dev = x.device();
  auto index = [&](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64).to(dev); };
  auto out = torch::empty({x.size(0), o_proj->weight.size(0)}, x.options());  // [N, D]
  // Prefills: one chunked pass over every new sequence, each ending state into its slot.
  std::vector<int64_t> rows, cu{0}, fresh;
  int64_t most = 0;  // the most new tokens of a slice that continues
  for (const auto& s : slices) {
    if (s.cached > 0) {
      most = std::max(most, s.count);
      continue;
    }
    for (int64_t j = 0; j < s.count; ++j) rows.push_back(s.start + j);
    cu.push_back(cu.back() + s.count);
    fresh.push_back(s.slot);
  }
  if (!rows.empty()) {
    auto r = index(rows);
    auto [y, st] = prefill(x.index_select(0, r), torch::tensor(cu, torch::kInt64));
    out.index_copy_(0, r, y);
    auto f = index(fresh);
    slots.conv.index_copy_(0, f, st.conv.to(slots.conv.scalar_type()));
    slots.recurrent.index_copy_(0, f, st.recurrent);
  }
  // Continuations: token j of every slice that has one, from its slot's state.
  for (int64_t j = 0; j < most; ++j) {
    std::vector<int64_t> step_rows, step_slots;
    for (const auto& s : slices)
      if (s.cached > 0 && s.count > j) {
        step_rows.push_back(s.start + j);
        step_slots.push_back(s.slot);
      }
    auto r = index(step_rows), sl = index(step_slots);
    KdaState st{slots.conv.index_select(0, sl), slots.recurrent.index_select(0, sl)};
    out.index_copy_(0, r, decode_step(x.index_select(0, r), st));
    slots.conv.index_copy_(0, sl, st.conv.to(slots.conv.scalar_type()));
    slots.recurrent.index_copy_(0, sl, st.recurrent);
  }
  return out;
}

}  // namespace kiln::model::glm5_next
