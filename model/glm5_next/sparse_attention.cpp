#include "model/glm5_next/sparse_attention.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace kiln::model::glm5_next {

namespace {
torch::nn::Linear linear(int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); }

// Host copy of cu_seqlens (the per-document loops below index it).
std::vector<int64_t> offsets(const torch::Tensor& cu_seqlens) {
  auto cu = cu_seqlens.to(torch::kCPU).to(torch::kInt64).contiguous();
  return std::vector<int64_t>(cu.data_ptr<int64_t>(), cu.data_ptr<int64_t>() + cu.numel());
}

// torch.finfo(dtype).min: the additive mask value transformers' eager attention uses.
double lowest(torch::Dtype dt) {
  switch (dt) {
    case torch::kDouble: return std::numeric_limits<double>::lowest();
    case torch::kBFloat16: return double(std::numeric_limits<c10::BFloat16>::lowest());
    case torch::kHalf: return double(std::numeric_limits<c10::Half>::lowest());
    default: return double(std::numeric_limits<float>::lowest());
  }
}
}  // namespace

KPoolIndexerImpl::KPoolIndexerImpl(int64_t hidden, int64_t q_lora_rank, const IndexerConfig& c) : c_(c) {
  wq_b = register_module("wq_b", linear(q_lora_rank, c.n_heads * c.head_dim));
  wk = register_module("wk", linear(hidden, c.head_dim));
  k_norm = register_module("k_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.head_dim}).eps(1e-6)));
  weights_proj = register_module("weights_proj", linear(hidden, c.n_heads));
  // Init as transformers' _init_weights: ape 0, gate 1.
  compress_ape = register_parameter("compress_ape", torch::zeros({c.kpool, c.head_dim}));
  compress_gate = register_parameter("compress_gate", torch::ones({c.head_dim, hidden}));
}

torch::Tensor KPoolIndexerImpl::key_entries(const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  return torch::cat({k_norm(wk(x)), torch::nn::functional::linear(x, compress_gate)}, -1);  // [n, 2E]
}

torch::Tensor KPoolIndexerImpl::select(const torch::Tensor& x, const torch::Tensor& q_resid) {
  auto pos = torch::arange(x.size(0), torch::TensorOptions().dtype(torch::kInt64).device(x.device()));
  return select_queries(x, q_resid, pos, key_entries(x));
}

torch::Tensor KPoolIndexerImpl::select_queries(const torch::Tensor& x, const torch::Tensor& q_resid,
                                               const torch::Tensor& pos, const torch::Tensor& keys) {
  torch::NoGradGuard no_grad;
  const int64_t m = x.size(0), n = keys.size(0), I = c_.n_heads, E = c_.head_dim, kp = c_.kpool, P = n / kp;  // complete pools
  auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(x.device());
  torch::Tensor tokens = torch::empty({m, 0}, i64);
  if (P > 0) {
    auto q = wq_b(q_resid).view({m, I, E}).to(torch::kFloat);                   // [m, I, E]
    auto k = keys.narrow(0, 0, P * kp).narrow(1, 0, E).view({P, kp, E});       // [P, kp, E]
    auto logits = keys.narrow(0, 0, P * kp).narrow(1, E, E).reshape({P, kp, E}).to(torch::kFloat) +
                  compress_ape.to(torch::kFloat);
    auto pool_keys = (torch::softmax(logits, 1).to(k.scalar_type()) * k).sum(1).to(torch::kFloat);  // [P, E]
    auto scores = torch::relu(torch::einsum("nie,pe->nip", {q, pool_keys}) * (1.0 / std::sqrt(double(E))));  // [m, I, P]
    auto w = weights_proj(x).to(torch::kFloat) * (1.0 / std::sqrt(double(I)));  // [m, I]
    auto index_scores = torch::matmul(w.unsqueeze(1), scores).squeeze(1);      // [m, P]
    // A pool is a candidate once its last token is visible to the query.
    auto visible = (torch::arange(P, i64) * kp + kp - 1).view({1, P}) <= pos.view({m, 1});  // [m, P]
    index_scores = index_scores.masked_fill(~visible, std::numeric_limits<float>::lowest());
    const int64_t select_k = std::min(c_.topk / kp, P);
    // Ties (relu leaves many scores at 0) go to the earlier pool: a stable descending sort, so
    // that a query picks the same pools whether later pools exist (packed) or not yet (cached).
    auto chosen = std::get<1>(index_scores.sort(/*stable=*/true, -1, /*descending=*/true)).narrow(1, 0, select_k);  // [m, select_k]
    auto chosen_valid = visible.gather(1, chosen);
    tokens = (chosen.unsqueeze(-1) * kp + torch::arange(kp, i64)).masked_fill(~chosen_valid.unsqueeze(-1), -1).flatten(1);
  }
  auto parts = std::vector<torch::Tensor>{tokens};
  if (c_.always_select_tail && kp > 1) {
    // The query's unfinished pool: tokens (t + 1) - (t + 1) % kp .. t.
    auto count = (pos + 1).remainder(kp);                                      // [m]
    auto offs = torch::arange(kp - 1, i64);                                    // [kp-1]
    auto tail = (pos + 1 - count).view({m, 1}) + offs.view({1, kp - 1});
    parts.push_back(tail.masked_fill(offs.view({1, kp - 1}) >= count.view({m, 1}), -1));
  }
  auto out = torch::cat(parts, 1);
  const int64_t W = width();
  if (out.size(1) < W) out = torch::constant_pad_nd(out, {0, W - out.size(1)}, -1);
  return out.narrow(1, 0, W);                                                  // [m, W]
}

torch::Tensor KPoolIndexerImpl::forward(const torch::Tensor& x, const torch::Tensor& q_resid, const torch::Tensor& cu_seqlens) {
  torch::NoGradGuard no_grad;  // the indexer is not trained by the loss
  auto cu = offsets(cu_seqlens);
  std::vector<torch::Tensor> rows;
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t s = cu[b], n = cu[b + 1] - cu[b];
    rows.push_back(select(x.narrow(0, s, n), q_resid.narrow(0, s, n)));
  }
  return torch::cat(rows, 0);  // [T, W]
}

SparseAttentionImpl::SparseAttentionImpl(int64_t hidden, const AttentionConfig& a, const IndexerConfig& ic,
                                         double rms_norm_eps, bool with_indexer)
    : a_(a) {
  const int64_t H = a.num_heads, N = a.qk_nope_head_dim, V = a.v_head_dim;
  q_a = register_module("q_a", linear(hidden, a.q_lora_rank));
  q_a_norm = register_module("q_a_norm", RMSNorm(a.q_lora_rank, rms_norm_eps));
  q_b = register_module("q_b", linear(a.q_lora_rank, H * N));
  kv_a = register_module("kv_a", linear(hidden, a.kv_lora_rank));
  kv_a_norm = register_module("kv_a_norm", RMSNorm(a.kv_lora_rank, rms_norm_eps));
  kv_b = register_module("kv_b", linear(a.kv_lora_rank, H * (N + V)));
  o = register_module("o", linear(H * V, hidden));
  if (with_indexer) indexer = register_module("indexer", KPoolIndexer(hidden, a.q_lora_rank, ic));
}

SparseAttentionOutput SparseAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cu_seqlens,
                                                   const std::optional<torch::Tensor>& given_topk) {
  const int64_t T = x.size(0), H = a_.num_heads, N = a_.qk_nope_head_dim, V = a_.v_head_dim;
  auto q_resid = q_a_norm(q_a(x));                                               // [T, Q]
  auto q = q_b(q_resid).view({T, H, N});                                         // [T, H, N]
  auto kv = kv_b(kv_a_norm(kv_a(x))).view({T, H, N + V});                        // [T, H, N+V]
  auto k = kv.narrow(-1, 0, N), v = kv.narrow(-1, N, V);
  torch::Tensor topk;
  if (given_topk) topk = *given_topk;
  else if (indexer) topk = indexer(x, q_resid, cu_seqlens);
  else throw std::invalid_argument("a shared sparse-attention layer needs the previous full layer's top-k selection");
  auto cu = offsets(cu_seqlens);
  std::vector<torch::Tensor> outs;
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t s = cu[b], n = cu[b + 1] - cu[b];
    outs.push_back(attend(q.narrow(0, s, n), k.narrow(0, s, n), v.narrow(0, s, n), topk.narrow(0, s, n)));
  }
  return {o(torch::cat(outs, 0)), topk};
}

torch::Tensor SparseAttentionImpl::attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& sel) const {
  const int64_t m = q.size(0), n = k.size(0), H = a_.num_heads, V = a_.v_head_dim;
  // [m, W] positions -> [m, n] mask of the selected keys (-1 selects nothing).
  auto ok = sel.ge(0) & sel.lt(n);
  auto mask = torch::zeros({m, n}, torch::TensorOptions().dtype(torch::kInt32).device(q.device()))
                  .scatter_add_(1, sel.clamp(0, n - 1), ok.to(torch::kInt32))
                  .ne(0);
  auto qd = q.transpose(0, 1), kd = k.transpose(0, 1), vd = v.transpose(0, 1);  // [H, *, *]
  // As transformers' eager path: unselected keys get the dtype's lowest value, softmax in fp32.
  auto bias = torch::zeros({m, n}, qd.options()).masked_fill(~mask, lowest(qd.scalar_type()));
  auto scores = torch::matmul(qd, kd.transpose(-1, -2)) * a_.softmax_scale() + bias;  // [H, m, n]
  auto probs = torch::softmax(scores, -1, torch::kFloat).to(qd.scalar_type());
  return torch::matmul(probs, vd).transpose(0, 1).reshape({m, H * V});           // [m, H*V]
}

SparseAttentionOutput SparseAttentionImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& positions,
                                                          const CachedLayout& layout, torch::Tensor& latent,
                                                          torch::Tensor& index,
                                                          const std::optional<torch::Tensor>& given_topk) {
  const int64_t N = x.size(0), H = a_.num_heads, Nd = a_.qk_nope_head_dim, V = a_.v_head_dim, C = a_.kv_lora_rank;
  auto q_resid = q_a_norm(q_a(x));                                               // [N, Q]
  auto q = q_b(q_resid).view({N, H, Nd});                                        // [N, H, Nd]
  const auto& slots = layout.new_slots();
  latent.view({-1, C}).index_copy_(0, slots, kv_a_norm(kv_a(x)));              // the new tokens' latents
  const bool own = !given_topk.has_value();
  if (own && !indexer) throw std::invalid_argument("a shared sparse-attention layer needs the previous full layer's top-k selection");
  if (own) index.view({-1, index.size(-1)}).index_copy_(0, slots, indexer->key_entries(x));
  const auto& vl = layout.varlen();                                              // every slice's keys, in order
  auto kv = kv_b(latent.view({-1, C}).index_select(0, vl.key_slots)).view({-1, H, Nd + V});  // [Tk, H, Nd+V]
  auto keys = own ? index.view({-1, index.size(-1)}).index_select(0, vl.key_slots) : torch::Tensor();  // [Tk, 2E]
  const auto* cu_q = vl.cu_q.data_ptr<int64_t>();
  const auto* cu_k = vl.cu_k.data_ptr<int64_t>();
  std::vector<torch::Tensor> outs, sels;
  for (int64_t b = 0; b + 1 < vl.cu_q.size(0); ++b) {
    const int64_t qs = cu_q[b], m = cu_q[b + 1] - qs, ks = cu_k[b], n = cu_k[b + 1] - ks;
    auto sel = own ? indexer->select_queries(x.narrow(0, qs, m), q_resid.narrow(0, qs, m), positions.narrow(0, qs, m),
                                             keys.narrow(0, ks, n))
                   : given_topk->narrow(0, qs, m);
    auto kvb = kv.narrow(0, ks, n);
    outs.push_back(attend(q.narrow(0, qs, m), kvb.narrow(-1, 0, Nd), kvb.narrow(-1, Nd, V), sel));
    sels.push_back(sel);
  }
  return {o(torch::cat(outs, 0)), torch::cat(sels, 0)};
}

}  // namespace kiln::model::glm5_next
