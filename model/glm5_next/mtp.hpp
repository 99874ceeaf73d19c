#pragma once
// GLM-5.3-Flash's multi-token-prediction (MTP) layer: DeepSeek-V3's MTP module (arXiv:2412.19437
// §2.2) as GLM-5.3-Flash's checkpoint lays it out under `layers.{num_hidden_layers}` and the
// public serving code runs it (vLLM's glm5_next_mtp.py on deepseek_mtp.py; SGLang's
// glm5_next_nextn.py / deepseek_nextn.py; README.md lists the sources). At depth d, for each
// packed row t: x = eh_proj(cat(enorm(embed(token t+d)), hnorm(h^{d-1}_t))), then an ordinary
// residual pre-norm block (no hyper-connections, no KDA): x += attn(attn_norm(x)) with NoPE
// sparse attention and its own (full, frozen) KPool indexer; x += moe(mlp_norm(x)) with the
// clamped-SwiGLU MoE. x is h^d, fed to depth d+1 as it is; the prediction of token t+d+1 is
// lm_head(head_norm(x)) (HF shared_head.norm, the main model's lm_head: DeepSeek-V3 shares
// embedding and output head).
// Legend: T rows, D hidden.
#include <torch/torch.h>

#include "model/blocks/basic.hpp"
#include "model/blocks/moe.hpp"
#include "model/glm5_next/config.hpp"
#include "model/glm5_next/sparse_attention.hpp"

namespace kiln::model::glm5_next {

class MtpLayerImpl : public torch::nn::Module {
 public:
  /// Dimensions from the text config (its attention, indexer and MoE); fp32 on CPU, parameters
  /// as the modules make them.
  explicit MtpLayerImpl(const Glm5NextConfig& c);
  /// Parameters the constructor registers.
  static int64_t parameter_count(const Glm5NextConfig& c);
  /// One depth: embedded [T, D] (embeddings of tokens t+d), previous [T, D] (h^{d-1}: the main
  /// model's normed hidden for d = 1, this layer's output at depth d-1 after), cu_seqlens [B+1]
  /// int64 of these rows' documents -> h^d [T, D] (before head_norm). Attention stays inside
  /// each document.
  torch::Tensor forward(const torch::Tensor& embedded, const torch::Tensor& previous, const torch::Tensor& cu_seqlens);

  RMSNorm enorm{nullptr}, hnorm{nullptr};  ///< [D] each
  torch::nn::Linear eh_proj{nullptr};      ///< [D, 2D]: input cat(enorm(e), hnorm(h))
  RMSNorm attn_norm{nullptr};              ///< HF input_layernorm
  SparseAttention attn{nullptr};           ///< NoPE MLA + its own KPool indexer
  RMSNorm mlp_norm{nullptr};               ///< HF post_attention_layernorm
  MoE moe{nullptr};
  RMSNorm head_norm{nullptr};              ///< HF shared_head.norm
};
TORCH_MODULE(MtpLayer);

}  // namespace kiln::model::glm5_next
