#pragma once
// NoPE multi-latent attention with DeepSeek sparse attention (DSA) and its KPool indexer, as
// transformers 5.17's Glm5NextTextAttention / Glm5NextTextIndexer (DeepSeek-V3.2's DSA with
// keys pooled in groups; cross-layer sharing of the selection, arXiv:2603.12201).
//
// Per document, without positions (NoPE): the indexer scores pools of `kpool` consecutive
// tokens (a complete pool's key is a learned softmax-weighted mix of its tokens' keys), keeps
// the top topk/kpool pools whose last token the query can see, expands them to token
// positions and appends the query's unfinished tail pool; attention is restricted to those
// tokens. When the context is shorter than topk every visible pool is kept and attention is
// dense causal. The indexer runs without gradient (the RL loss does not train it).
// Legend: T packed tokens, n one document's tokens, D hidden, Q q_lora_rank, C kv_lora_rank,
// H heads, N qk_nope_head_dim, V v_head_dim, I indexer heads, E indexer head dim, P pools,
// W = topk (+ kpool - 1 with the tail) selected positions per query.
#include <optional>

#include <torch/torch.h>

#include "model/blocks/basic.hpp"
#include "model/blocks/mla.hpp"
#include "model/glm5_next/config.hpp"

namespace kiln::model::glm5_next {

class KPoolIndexerImpl : public torch::nn::Module {
 public:
  KPoolIndexerImpl(int64_t hidden, int64_t q_lora_rank, const IndexerConfig& c);
  /// Parameters the constructor registers (wq_b, wk, k_norm's weight and bias, weights_proj,
  /// compress_ape, compress_gate).
  static int64_t parameter_count(int64_t hidden, int64_t q_lora_rank, const IndexerConfig& c) {
    return q_lora_rank * c.n_heads * c.head_dim + hidden * c.head_dim + 2 * c.head_dim + hidden * c.n_heads +
           c.kpool * c.head_dim + c.head_dim * hidden;
  }
  /// x: [T, D] the layer's normed input, q_resid: [T, Q] the attention's normed compressed
  /// query, cu_seqlens: [B+1] int64 -> [T, W] int64: for each query, positions within its own
  /// document (0-based) it may attend to, -1 for none; pools in descending score, then the
  /// tail. No gradient.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& q_resid, const torch::Tensor& cu_seqlens);
  /// Each token's key entry, what a cache keeps so that later queries can pool it: x [n, D] ->
  /// [n, 2E] = k_norm(wk(x)) | x compress_gate^T, in x's dtype. No gradient.
  torch::Tensor key_entries(const torch::Tensor& x);
  /// The selections of m queries of one document: x [m, D], q_resid [m, Q], pos [m] int64 their
  /// positions in the document, keys [n, 2E] the key entries of the document's first n tokens
  /// (n > every pos) -> [m, W] as forward. No gradient.
  torch::Tensor select_queries(const torch::Tensor& x, const torch::Tensor& q_resid, const torch::Tensor& pos,
                               const torch::Tensor& keys);
  /// Width of forward's result: topk, plus kpool - 1 with always_select_tail.
  int64_t width() const { return c_.topk + (c_.always_select_tail ? c_.kpool - 1 : 0); }

  torch::nn::Linear wq_b{nullptr};          ///< [I*E, Q]
  torch::nn::Linear wk{nullptr};            ///< [E, D]
  torch::nn::LayerNorm k_norm{nullptr};     ///< [E] weight and bias, eps 1e-6
  torch::nn::Linear weights_proj{nullptr};  ///< [I, D]
  torch::Tensor compress_ape;               ///< [kpool, E] per-slot bias of the pooling logits
  torch::Tensor compress_gate;              ///< [E, D] pooling logits from the hidden state

 private:
  // One document: x [n, D], q_resid [n, Q] -> [n, W].
  torch::Tensor select(const torch::Tensor& x, const torch::Tensor& q_resid);
  IndexerConfig c_;
};
TORCH_MODULE(KPoolIndexer);

struct SparseAttentionOutput {
  torch::Tensor out;           ///< [T, D]
  torch::Tensor topk_indices;  ///< [T, W] int64: the selection used (own or shared), positions within each document
};

class SparseAttentionImpl : public torch::nn::Module {
 public:
  /// with_indexer: false for a `shared` layer (it uses the previous layer's selection).
  SparseAttentionImpl(int64_t hidden, const AttentionConfig& a, const IndexerConfig& ic, double rms_norm_eps,
                      bool with_indexer);
  /// Parameters the constructor registers (the MLA-style projections and norms, and the
  /// indexer's when with_indexer).
  static int64_t parameter_count(int64_t hidden, const AttentionConfig& a, const IndexerConfig& ic, bool with_indexer) {
    const int64_t H = a.num_heads, N = a.qk_nope_head_dim, V = a.v_head_dim;
    return hidden * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * H * N + hidden * a.kv_lora_rank + a.kv_lora_rank +
           a.kv_lora_rank * H * (N + V) + H * V * hidden +
           (with_indexer ? KPoolIndexerImpl::parameter_count(hidden, a.q_lora_rank, ic) : 0);
  }
  /// x: [T, D], cu_seqlens: [B+1] int64; given_topk: [T, W] a selection to use instead of
  /// the indexer's (the previous full layer's on a shared layer, where it is required; a
  /// replayed one on a full layer). Throws std::invalid_argument for a shared layer without a
  /// selection.
  SparseAttentionOutput forward(const torch::Tensor& x, const torch::Tensor& cu_seqlens,
                                const std::optional<torch::Tensor>& given_topk = std::nullopt);

  /// Incremental step over a paged cache (model/decode_cache.hpp; layout as MLAImpl's): x [N, D]
  /// the new tokens of every slice (the layer's normed input), positions [N] int64 within each
  /// sequence. Writes the new tokens' latents into `latent` [G, Z, C] and, on a layer with an
  /// indexer (unless given_topk), their key entries into `index` [G, Z, 2E]; attends each new
  /// token over its sequence's cached and new tokens with the same math as forward (keys and
  /// values expanded through kv_b). given_topk: [N, W] the selection to use (a shared layer's,
  /// required there). Returns out [N, D] and the selection used [N, W]. Inference only.
  SparseAttentionOutput forward_cached(const torch::Tensor& x, const torch::Tensor& positions, const CachedLayout& layout,
                                       torch::Tensor& latent, torch::Tensor& index,
                                       const std::optional<torch::Tensor>& given_topk = std::nullopt);

  torch::nn::Linear q_a{nullptr};   ///< [Q, D]
  RMSNorm q_a_norm{nullptr};        ///< [Q], eps rms_norm_eps
  torch::nn::Linear q_b{nullptr};   ///< [H*N, Q]
  torch::nn::Linear kv_a{nullptr};  ///< [C, D]  (HF kv_a_proj_with_mqa; no rotary part)
  RMSNorm kv_a_norm{nullptr};       ///< [C], eps rms_norm_eps
  torch::nn::Linear kv_b{nullptr};  ///< [H*(N+V), C]
  torch::nn::Linear o{nullptr};     ///< [D, H*V]
  KPoolIndexer indexer{nullptr};    ///< null on a shared layer

 private:
  // One document's attention: q [m, H, N] queries, k [n, H, N] / v [n, H, V] its keys, sel
  // [m, W] each query's selected key positions -> [m, H*V].
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& sel) const;
  AttentionConfig a_;
};
TORCH_MODULE(SparseAttention);

}  // namespace kiln::model::glm5_next
