#pragma once
// Manifold-constrained hyper-connections (mHC: Xie et al. 2026, §2.2 eq. 8; transformers 5.17's
// Glm5NextTextHyperConnection and the decoder layer's use of it): the residual stream is S
// streams; before a block (attention or MLP) they collapse to the block's input with weights
// `pre`, after it the block's output is placed into the streams with weights `post` and the old
// streams are mixed by `comb`, a doubly stochastic S x S matrix (Sinkhorn-Knopp projection).
// The model's input is the embedding copied into every stream; its output the mean over
// streams.
// Legend: T tokens, S streams (hc_mult), D hidden.
#include <torch/torch.h>

#include "model/glm5_next/config.hpp"

namespace kiln::model::glm5_next {

/// Sinkhorn-Knopp as transformers runs it: softmax over the last dim, + eps, then a column
/// normalisation, then (iters - 1) times a row and a column normalisation, each dividing by
/// (sum + eps). logits: [..., S, S] -> [..., S, S] in logits' dtype; rows and columns sum to
/// 1 up to eps and the convergence left after `iters` steps (the last step normalises
/// columns). Throws std::invalid_argument for iters < 1.
torch::Tensor sinkhorn(const torch::Tensor& logits, int64_t iters, double eps);

/// The weights of one mHC site for every token.
struct HcWeights {
  torch::Tensor post;       ///< [T, S] fp32 in [0, 2]: how much of the block output each stream gets
  torch::Tensor comb;       ///< [T, S, S] fp32 doubly stochastic: comb[t, j, i] = share of old stream j in new stream i
  torch::Tensor collapsed;  ///< [T, D] the block's input, sum_s pre[t, s] * streams[t, s] (streams' dtype)
};

class HyperConnectionImpl : public torch::nn::Module {
 public:
  /// rms_norm_eps: the epsilon of the streams' unweighted RMS normalisation (transformers uses
  /// the model's rms_norm_eps there, and hc.eps only for the Sinkhorn floor and `pre`).
  HyperConnectionImpl(int64_t hidden, const HyperConnectionConfig& c, double rms_norm_eps);
  /// Parameters the constructor registers (fn [(2 + S) S, S hidden], base [(2 + S) S], scale [3]).
  static int64_t parameter_count(int64_t hidden, const HyperConnectionConfig& c) {
    const int64_t S = c.streams;
    return (2 + S) * S * S * hidden + (2 + S) * S + 3;
  }
  /// streams: [T, S, D] -> the site's weights and collapsed input. The mixing logits are
  /// computed in fp32 (the streams flattened and RMS-normalised without weight, times fn^T).
  HcWeights forward(const torch::Tensor& streams);
  /// After the block: new streams [T, S, D] = post[t, i] * block_out[t] + sum_j comb[t, j, i]
  /// * streams[t, j], in streams' dtype (post and comb rounded to it first, as transformers).
  static torch::Tensor expand(const HcWeights& w, const torch::Tensor& block_out, const torch::Tensor& streams);

  torch::Tensor fn;     ///< [(2+S)*S, S*D] mixing projection (HF hc_{attn,ffn}_fn)
  torch::Tensor base;   ///< [(2+S)*S] biases: pre [S], post [S], comb [S*S]
  torch::Tensor scale;  ///< [3] scales of the pre, post and comb logits

 private:
  HyperConnectionConfig c_;
  double rms_eps_;
};
TORCH_MODULE(HyperConnection);

/// The model's streams from the embeddings: [T, D] -> [T, S, D] (a copy per stream).
torch::Tensor hc_streams_from_embeddings(const torch::Tensor& x, int64_t streams);
/// The model's final collapse (Glm5NextTextHyperHead): the unweighted mean over streams,
/// [T, S, D] -> [T, D].
torch::Tensor hc_head(const torch::Tensor& streams);

}  // namespace kiln::model::glm5_next
