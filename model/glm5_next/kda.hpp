#pragma once
// Kimi Delta Attention (Kimi Linear, arXiv:2510.26692 §3; transformers 5.17's
// Glm5NextTextLinearAttention with its torch reference forms chunk_kimi_delta_attention /
// recurrent_kimi_delta_attention, and fla-core 0.6's naive_recurrent_kda / naive_chunk_kda):
// linear attention with a gated delta rule and a per-channel forget gate.
//
// Per head, with state S [K, V], L2-normalised q_t, k_t, scale 1/sqrt(K):
//   S  <- diag(exp(g_t)) S                       (g_t [K] <= 0: per-channel log decay)
//   S  <- S + k_t (beta_t (v_t - S^T k_t))^T      (delta rule, beta_t in (0, 1))
//   o_t = S^T q_t / sqrt(K)
// The chunked form computes the same outputs C tokens at a time (WY form: a unit lower-
// triangular solve per chunk, then one state update per chunk; in-chunk decays in sub-blocks
// of 16, see kda.cpp); the recurrent form steps token by token (decode). Gate and state math run in fp32 (fp64 for fp64 inputs).
//
// Packed documents never leak into each other: the short convolution's window and the
// recurrent state both start from zero at every document's first token.
//
// Legend: T packed tokens, B sequences (documents), L padded length, D hidden, H heads,
// K head dim (keys = values), W convolution width, C chunk size.
#include <optional>

#include <torch/torch.h>

#include "model/decode_cache.hpp"
#include "model/glm5_next/config.hpp"

namespace kiln::model::glm5_next {

/// Documents of a packed batch laid out as B rows of L = the longest document, for math that
/// runs per sequence (convolutions, recurrences). Built from cu_seqlens [B+1] int64 (read on
/// the host).
struct PaddedDocuments {
  int64_t batch = 0, length = 0, tokens = 0;
  torch::Tensor gather;  ///< [B*L] int64: packed row of each padded slot, `tokens` (a zero row) for padding
  torch::Tensor keep;    ///< [T] int64: the padded slot of each packed token
  torch::Tensor valid;   ///< [B, L] bool: the slot holds a token
  torch::Tensor lengths; ///< [B] int64 (CPU)
  /// Throws std::invalid_argument for a malformed cu_seqlens (not increasing from 0).
  static PaddedDocuments from_cu_seqlens(const torch::Tensor& cu_seqlens, torch::Device device);
  /// x: [T, ...] -> [B, L, ...], zero in padding slots.
  torch::Tensor pad(const torch::Tensor& x) const;
  /// x: [B, L, ...] -> [T, ...].
  torch::Tensor unpad(const torch::Tensor& x) const;
};

/// Output of a KDA recurrence: o [B, L, H, V] and the final state [B, H, K, V], both in the
/// math dtype (fp32, or fp64 for fp64 inputs).
struct KdaRecurrence {
  torch::Tensor out, state;
};

/// The gated delta rule over whole sequences in chunks of `chunk_size` tokens (the training
/// and prefill form). q, k: [B, L, H, K], L2-normalised (q is scaled by 1/sqrt(K) here);
/// v: [B, L, H, V]; g: [B, L, H, K] log decay (<= 0); beta: [B, L, H]; initial_state:
/// [B, H, K, V] or none (zeros). Positions with g = 0 and beta = 0 leave the state unchanged
/// (padding). Differentiable in every input. Throws c10::Error on mismatched shapes.
KdaRecurrence kda_chunked(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& g, const torch::Tensor& beta,
                          const std::optional<torch::Tensor>& initial_state, int64_t chunk_size = 64);
/// The same rule token by token (the decode form); arguments as kda_chunked.
KdaRecurrence kda_recurrent(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& g, const torch::Tensor& beta,
                            const std::optional<torch::Tensor>& initial_state);

/// x / sqrt(sum(x^2, -1) + eps), as fla's l2norm (eps inside the root, not a max).
torch::Tensor l2_normalize(const torch::Tensor& x, double eps = 1e-6);

/// A KDA layer's per-sequence decoding state.
struct KdaState {
  torch::Tensor conv;       ///< [B, 3*H*K, W-1] the last W-1 projected q|k|v rows (model dtype), oldest first
  torch::Tensor recurrent;  ///< [B, H, K, V] fp32 (fp64 for an fp64 model)
};

class KimiDeltaAttentionImpl : public torch::nn::Module {
 public:
  /// rms_norm_eps: the output norm's epsilon (transformers passes the model's rms_norm_eps).
  KimiDeltaAttentionImpl(int64_t hidden, const KdaConfig& c, double rms_norm_eps, int64_t chunk_size = 64);
  /// Parameters the constructor registers: q/k/v projections and their depthwise convolutions,
  /// the forget-gate and output-gate low-rank pairs, dt_bias, A_log, b_proj, o_norm, o_proj.
  static int64_t parameter_count(int64_t hidden, const KdaConfig& c) {
    const int64_t H = c.num_heads, K = c.head_dim, HK = H * K, W = c.conv_kernel;
    return 3 * hidden * HK + 3 * HK * W + 2 * (hidden * K + K * HK) + HK + H + hidden * H + K + HK * hidden;
  }
  /// Packed forward (training): x [T, D], cu_seqlens [B+1] int64 -> [T, D], chunked form.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cu_seqlens);
  /// As forward, and the state each document ends in (its conv window and recurrent state),
  /// ready for decode_step: the prefill of B sequences.
  std::pair<torch::Tensor, KdaState> prefill(const torch::Tensor& x, const torch::Tensor& cu_seqlens);
  /// One new token per sequence (recurrent form): x [B, D] -> [B, D]; `state` advances.
  torch::Tensor decode_step(const torch::Tensor& x, KdaState& state);
  /// Incremental step of an engine (model/decode_cache.hpp): x [N, D] the new tokens of every
  /// slice; `slots` the states of all slots (conv [S, 3HK, W-1], recurrent [S, H, K, V]). A
  /// slice with nothing cached is prefilled (chunked form, as forward) and its slot set to the
  /// state it ends in; a slice with cached tokens steps from its slot's state token by token
  /// (recurrent form), the slot advanced. -> [N, D]. Throws std::invalid_argument for a slice
  /// without a slot in [0, S). Inference only.
  torch::Tensor forward_cached(const torch::Tensor& x, const std::vector<CachedSlice>& slices, KdaState& slots);
  /// A zero state for `batch` sequences (before any token); conv in `dtype`, recurrent fp32
  /// (fp64 when `dtype` is).
  KdaState empty_state(int64_t batch, torch::Dtype dtype, torch::Device device) const;

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};  ///< [H*K, D]
  torch::Tensor q_conv, k_conv, v_conv;        ///< [H*K, 1, W] depthwise causal conv (no bias)
  torch::nn::Linear f_a_proj{nullptr};         ///< [K, D]   forget gate, low rank
  torch::nn::Linear f_b_proj{nullptr};         ///< [H*K, K]
  torch::Tensor dt_bias;                       ///< [H*K] kept fp32
  torch::Tensor A_log;                         ///< [H] kept fp32
  torch::nn::Linear b_proj{nullptr};           ///< [H, D]   beta = sigmoid(b_proj x)
  torch::nn::Linear g_a_proj{nullptr};         ///< [K, D]   output gate, low rank
  torch::nn::Linear g_b_proj{nullptr};         ///< [H*K, K]
  torch::Tensor o_norm;                        ///< [K] gated RMSNorm weight
  torch::nn::Linear o_proj{nullptr};           ///< [D, H*K]

 private:
  // The forget gate's log decay, fp32: x [..., D] -> [..., H, K].
  torch::Tensor forget_gate(const torch::Tensor& x);
  // Gated RMSNorm per head and output projection: core [..., H, K], x [..., D] -> [..., D].
  torch::Tensor output(const torch::Tensor& core, const torch::Tensor& x);
  // Shared by forward and prefill; fills *state when asked.
  torch::Tensor run(const torch::Tensor& x, const torch::Tensor& cu_seqlens, KdaState* state);

  KdaConfig c_;
  double eps_;
  int64_t chunk_size_;
};
TORCH_MODULE(KimiDeltaAttention);

}  // namespace kiln::model::glm5_next
