#pragma once
// glm5_next's decoding state (model/decode_cache.hpp): per Kimi Delta Attention layer, each
// sequence's short-convolution window and recurrent state in its slot; per sparse-attention
// layer, each token's NoPE latent (kv_a_norm(kv_a(x)), no rotary part) in pages, and on a layer
// with a full indexer each token's indexer key entry (its key and its pooling logits, from which
// the KPool pooled keys are formed, sparse_attention.hpp). A shared-indexer layer keeps no
// indexer entry: it reuses the previous layer's selection.
// Legend: G pages, Z page size, S slots, H KDA heads, K KDA head dim, W conv width,
// C kv_lora_rank, E indexer head dim.
#include <vector>

#include <torch/torch.h>

#include "model/decode_cache.hpp"
#include "model/glm5_next/config.hpp"
#include "model/glm5_next/kda.hpp"

namespace kiln::model::glm5_next {

class Glm5NextDecodeCache : public DecodeCache {
 public:
  struct Layer {
    KdaState kda;            ///< linear-attention layers: conv [S, 3HK, W-1] (model dtype), recurrent [S, H, K, K] fp32
    torch::Tensor latent;    ///< sparse-attention layers: [G, Z, C] (model dtype)
    torch::Tensor index;     ///< sparse layers with a full indexer: [G, Z, 2E] (model dtype)
  };
  /// Zeroed, in `options` (the model's dtype and device; KDA's recurrent state fp32, fp64 for
  /// an fp64 model).
  Glm5NextDecodeCache(const Glm5NextConfig& c, const DecodeCacheShape& shape, const torch::TensorOptions& options);
  /// Bytes of such a cache for a model of `dtype`.
  static int64_t bytes(const Glm5NextConfig& c, const DecodeCacheShape& shape, torch::Dtype dtype);
  void copy_page(int64_t from, int64_t to) override;
  void copy_slot(int64_t from, int64_t to) override;
  bool has_slot_state() const override { return has_kda_; }
  int64_t page_size() const { return page_size_; }

  std::vector<Layer> layers;  ///< one per decoder layer

 private:
  bool has_kda_ = false;
  int64_t page_size_ = 0;
};

}  // namespace kiln::model::glm5_next
