#include "model/glm5_next/decode_cache.hpp"

namespace kiln::model::glm5_next {

namespace {
torch::Dtype state_dtype(torch::Dtype model) { return model == torch::kDouble ? torch::kDouble : torch::kFloat; }
}  // namespace

Glm5NextDecodeCache::Glm5NextDecodeCache(const Glm5NextConfig& c, const DecodeCacheShape& shape,
                                         const torch::TensorOptions& options)
    : page_size_(shape.page_size) {
  const int64_t HK = c.kda.num_heads * c.kda.head_dim, K = c.kda.head_dim;
  const auto dtype = options.dtype().toScalarType();
  for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
    Layer l;
    if (c.layer_types[i] == LayerType::linear_attention) {
      l.kda.conv = torch::zeros({shape.slots, 3 * HK, c.kda.conv_kernel - 1}, options);
      l.kda.recurrent = torch::zeros({shape.slots, c.kda.num_heads, K, K}, options.dtype(state_dtype(dtype)));
      has_kda_ = true;
    } else {
      l.latent = torch::zeros({shape.pages, shape.page_size, c.attention.kv_lora_rank}, options);
      if (c.indexer_types[i] == IndexerType::full)
        l.index = torch::zeros({shape.pages, shape.page_size, 2 * c.indexer.head_dim}, options);
    }
    layers.push_back(std::move(l));
  }
}

int64_t Glm5NextDecodeCache::bytes(const Glm5NextConfig& c, const DecodeCacheShape& shape, torch::Dtype dtype) {
  const int64_t HK = c.kda.num_heads * c.kda.head_dim, K = c.kda.head_dim, tokens = shape.pages * shape.page_size;
  const int64_t size = int64_t(c10::elementSize(dtype)), state_size = int64_t(c10::elementSize(state_dtype(dtype)));
  int64_t total = 0;
  for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
    if (c.layer_types[i] == LayerType::linear_attention) {
      total += shape.slots * (3 * HK * (c.kda.conv_kernel - 1) * size + c.kda.num_heads * K * K * state_size);
    } else {
      total += tokens * c.attention.kv_lora_rank * size;
      if (c.indexer_types[i] == IndexerType::full) total += tokens * 2 * c.indexer.head_dim * size;
    }
  }
  return total;
}

void Glm5NextDecodeCache::copy_page(int64_t from, int64_t to) {
  for (auto& l : layers)
    for (auto* t : {&l.latent, &l.index})
      if (t->defined()) (*t)[to].copy_((*t)[from]);
}

void Glm5NextDecodeCache::copy_slot(int64_t from, int64_t to) {
  for (auto& l : layers)
    for (auto* t : {&l.kda.conv, &l.kda.recurrent})
      if (t->defined()) (*t)[to].copy_((*t)[from]);
}

}  // namespace kiln::model::glm5_next
