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

torch::Tensor KPoolIndexerImpl::select(const torch::Tensor& x, const torch::Tensor& q_resid) {
  const int64_t n = x.size(0), I = c_.n_heads, E = c_.head_dim, kp = c_.kpool, P = n / kp;  // complete pools
  auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(x.device());
  auto pos = torch::arange(n, i64);                                              // [n] query positions
  torch::Tensor tokens = torch::empty({n, 0}, i64);
  if (P > 0) {
    auto q = wq_b(q_resid).view({n, I, E}).to(torch::kFloat);                   // [n, I, E]
    auto k = k_norm(wk(x)).narrow(0, 0, P * kp).view({P, kp, E});               // [P, kp, E]
    auto logits = torch::nn::functional::linear(x, compress_gate).narrow(0, 0, P * kp).view({P, kp, E}).to(torch::kFloat) +
                  compress_ape.to(torch::kFloat);
    auto pool_keys = (torch::softmax(logits, 1).to(k.scalar_type()) * k).sum(1).to(torch::kFloat);  // [P, E]
    auto scores = torch::relu(torch::einsum("nie,pe->nip", {q, pool_keys}) * (1.0 / std::sqrt(double(E))));  // [n, I, P]
    auto w = weights_proj(x).to(torch::kFloat) * (1.0 / std::sqrt(double(I)));  // [n, I]
    auto index_scores = torch::matmul(w.unsqueeze(1), scores).squeeze(1);      // [n, P]
    // A pool is a candidate once its last token is visible to the query.
    auto visible = (torch::arange(P, i64) * kp + kp - 1).view({1, P}) <= pos.view({n, 1});  // [n, P]
    index_scores = index_scores.masked_fill(~visible, std::numeric_limits<float>::lowest());
    const int64_t select_k = std::min(c_.topk / kp, P);
    auto chosen = std::get<1>(index_scores.topk(select_k, -1));                // [n, select_k]
    auto chosen_valid = visible.gather(1, chosen);
    tokens = (chosen.unsqueeze(-1) * kp + torch::arange(kp, i64)).masked_fill(~chosen_valid.unsqueeze(-1), -1).flatten(1);
  }
  auto parts = std::vector<torch::Tensor>{tokens};
  if (c_.always_select_tail && kp > 1) {
    // The query's unfinished pool: tokens (t + 1) - (t + 1) % kp .. t.
    auto count = (pos + 1).remainder(kp);                                      // [n]
    auto offs = torch::arange(kp - 1, i64);                                    // [kp-1]
    auto tail = (pos + 1 - count).view({n, 1}) + offs.view({1, kp - 1});
    parts.push_back(tail.masked_fill(offs.view({1, kp - 1}) >= count.view({n, 1}), -1));
  }
  auto out = torch::cat(parts, 1);
  const int64_t W = width();
  if (out.size(1) < W) out = torch::constant_pad_nd(out, {0, W - out.size(1)}, -1);
  return out.narrow(1, 0, W);                                                  // [n, W]
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
  const double scale = a_.softmax_scale();
  std::vector<torch::Tensor> outs;
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t s = cu[b], n = cu[b + 1] - cu[b];
    // [n, W] positions -> [n, n] mask of the selected keys (-1 selects nothing).
    auto sel = topk.narrow(0, s, n);
    auto ok = sel.ge(0) & sel.lt(n);
    auto mask = torch::zeros({n, n}, torch::TensorOptions().dtype(torch::kInt32).device(x.device()))
                    .scatter_add_(1, sel.clamp(0, n - 1), ok.to(torch::kInt32))
                    .ne(0);
    auto qd = q.narrow(0, s, n).transpose(0, 1), kd = k.narrow(0, s, n).transpose(0, 1),
         vd = v.narrow(0, s, n).transpose(0, 1);                                  // [H, n, *]
    // As transformers' eager path: unselected keys get the dtype's lowest value, softmax in fp32.
    auto bias = torch::zeros({n, n}, qd.options()).masked_fill(~mask, lowest(qd.scalar_type()));
    auto scores = torch::matmul(qd, kd.transpose(-1, -2)) * scale + bias;       // [H, n, n]
    auto probs = torch::softmax(scores, -1, torch::kFloat).to(qd.scalar_type());
    outs.push_back(torch::matmul(probs, vd).transpose(0, 1).reshape({n, H * V}));  // [n, H*V]
  }
  return {o(torch::cat(outs, 0)), topk};
}

}  // namespace kiln::model::glm5_next
