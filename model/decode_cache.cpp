#include "model/decode_cache.hpp"

namespace kiln::model {

PagedCache::PagedCache(int64_t layers_, int64_t width, const DecodeCacheShape& shape, const torch::TensorOptions& options) {
  for (int64_t l = 0; l < layers_; ++l) layers.push_back(torch::zeros({shape.pages, shape.page_size, width}, options));
}

int64_t PagedCache::bytes(int64_t layers, int64_t width, const DecodeCacheShape& shape, torch::Dtype dtype) {
  return layers * shape.pages * shape.page_size * width * int64_t(c10::elementSize(dtype));
}

void PagedCache::copy_page(int64_t from, int64_t to) {
  for (auto& cache : layers) cache[to].copy_(cache[from]);
}

}  // namespace kiln::model
