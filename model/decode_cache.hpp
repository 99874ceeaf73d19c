#pragma once
// The decoding state a model keeps between CausalLM::forward_cached calls. The rollout engine
// owns it and addresses it in two ways only: pages of `page_size` token positions (a
// sequence's pages are CachedSlice::blocks, as many as its tokens need) and slots (one per
// sequence decoding at once, CachedSlice::slot). What a page row or a slot holds is the model
// package's business (CausalLM::make_decode_cache): MLA's latent per token and layer for
// glm4_moe_lite (PagedCache below); for glm5_next also the Kimi Delta Attention state per
// sequence and layer in a slot (model/glm5_next/decode_cache.hpp).
// Legend: G pages, Z page size (tokens), S slots, F a per-token entry's width.
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace kiln::model {

/// One sequence's share of an incremental (cached) step: rows [start, start + count) of the
/// step's tokens are its new tokens; `cached` of its tokens went through the model before
/// (their entries are in the cache); `blocks` is its page table (page ids in order, enough for
/// cached + count tokens); `slot` its slot (-1: none, for a cache without slot state).
struct CachedSlice {
  int64_t start = 0, count = 0, cached = 0;
  const std::vector<int64_t>* blocks = nullptr;
  int64_t slot = -1;
};

/// How much an engine asks a cache to hold.
struct DecodeCacheShape {
  int64_t pages = 0;      ///< G
  int64_t page_size = 0;  ///< Z token positions per page
  int64_t slots = 0;      ///< S sequences decoding at once
};

class DecodeCache {
 public:
  virtual ~DecodeCache() = default;
  /// Copies page `from` onto page `to` in every per-token tensor: the copy-on-write of a shared
  /// prompt's partial last page.
  virtual void copy_page(int64_t from, int64_t to) = 0;
  /// Copies slot `from` onto slot `to`: a sequence that shares another's prompt takes its
  /// per-sequence state after that prompt. No-op for a cache without slot state.
  virtual void copy_slot(int64_t from, int64_t to) = 0;
  /// Whether slots hold state. Then a sequence's state is more than its pages: it advances with
  /// every token, so a prompt can be shared only from a sequence that has just been prefilled.
  virtual bool has_slot_state() const = 0;
};

/// Per-token entries of several layers in pages: one [G, Z, F] tensor per layer, zeroed.
class PagedCache : public DecodeCache {
 public:
  PagedCache(int64_t layers, int64_t width, const DecodeCacheShape& shape, const torch::TensorOptions& options);
  /// Bytes such a cache takes: layers * G * Z * F * dtype size.
  static int64_t bytes(int64_t layers, int64_t width, const DecodeCacheShape& shape, torch::Dtype dtype);
  void copy_page(int64_t from, int64_t to) override;
  void copy_slot(int64_t, int64_t) override {}
  bool has_slot_state() const override { return false; }
  std::vector<torch::Tensor> layers;  ///< [G, Z, F] each
};

}  // namespace kiln::model
