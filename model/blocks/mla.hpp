#pragma once
// Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434 §2.1), matching transformers'
// Glm4MoeLiteAttention: queries through a low-rank q_a -> norm -> q_b (or q directly), keys and
// values from a shared compressed latent kv_a -> norm -> kv_b plus one shared rotary key.
// Attention is causal within each packed document and never across documents.
// Legend: T tokens, H heads, D hidden, C kv_lora_rank, N qk_nope, R qk_rope, V v_head.
#include <optional>

#include "model/blocks/basic.hpp"
#include "model/decode_cache.hpp"

namespace kiln::model {

struct MLAOptions {
  int64_t hidden = 0, num_heads = 0;
  std::optional<int64_t> q_lora_rank;
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  double rope_theta = 10000.0;
  bool rope_interleave = true;
  double softmax_scale = 0;  ///< 1/sqrt(N+R) for rope_type default
};


/// Where a cached step's tokens and keys sit in the paged cache, as index tensors on the
/// model's device. Built once per step (CachedLayout(slices, block_size, device)) and shared by
/// every layer, whose caches are laid out alike; each form is made on first use. Legend: B
/// slices, N new tokens in all, Tk cached + new tokens in all, n_max / s_max the most new /
/// total tokens of one slice.
class CachedLayout {
 public:
  CachedLayout(const std::vector<CachedSlice>& slices, int64_t block_size, torch::Device device);
  /// A decode step given on the device only, of static shape (the inputs of a captured CUDA
  /// graph; no host data, no host sync): B sequences adding one token each, sequence b's at
  /// position positions[b] (= its tokens cached before), its pages in block_table[b]. The
  /// padded form has s_max = W * block_size keys per sequence (those past its position are
  /// masked); varlen() is refused. positions: [B] int64; block_table: [B, W] int64 page ids,
  /// W * block_size > every position. Throws std::invalid_argument on other shapes or dtypes.
  CachedLayout(const torch::Tensor& positions, const torch::Tensor& block_table, int64_t block_size);
  /// The slices (empty for a layout of device tensors).
  const std::vector<CachedSlice>& slices() const;
  /// B: sequences in the step.
  int64_t batch() const { return batch_; }
  /// Built from device tensors only (the constructor above): only the padded form exists.
  bool on_device_only() const { return slices_ == nullptr; }
  /// Every slice adds one token (a decode step).
  bool decode() const { return decode_; }
  /// Above every position of the step's tokens: the most cached + new tokens of a slice, or
  /// W * block_size for a layout of device tensors.
  int64_t max_length() const { return max_length_; }
  /// [N] int64: the cache rows (block * block_size + offset) the new tokens are written to.
  const torch::Tensor& new_slots() const { return new_slots_; }

  /// Varlen form (the training kernels): each slice's rows 0..L-1, slices in order.
  struct Varlen {
    torch::Tensor key_slots;  ///< [Tk] int64 cache rows
    torch::Tensor cu_q, cu_k;  ///< [B+1] int64 (host): offsets of the new tokens / the keys
    int64_t max_q = 0, max_k = 0;
  };
  const Varlen& varlen() const;

  /// Padded form (latent-space attention): B x s_max keys, B x n_max queries.
  struct Padded {
    int64_t n_max = 0, s_max = 0;
    torch::Tensor query_rows;  ///< [B*n_max] int64 rows of the step's tokens (0 for padding)
    torch::Tensor cached, counts;  ///< [B] int64
    torch::Tensor keep;        ///< [N] int64: the padded rows that are real tokens, in step order
    /// The page tables the rows above come from: [B, W] int64 page ids (W * block_size >=
    /// s_max; entries past a slice's pages are 0 or, for a layout of device tensors, as given),
    /// and lengths [B] int64 = cached + count (the keys each slice's last token sees).
    torch::Tensor block_table, lengths;
  };
  const Padded& padded() const;
  /// [B*s_max] int64: the padded form's cache rows of every key (row 0 past a slice's length),
  /// made on first use (the decode kernel reads the block table instead).
  const torch::Tensor& padded_key_slots() const;

 private:
  // The slices' page tables [B, ceil(s_max / block_size)] and lengths [B], on the device.
  std::pair<torch::Tensor, torch::Tensor> block_table_padded(int64_t s_max) const;
  torch::Tensor key_slots_padded(int64_t s_max) const;  // [B, s_max], from the block tables
  const std::vector<CachedSlice>* slices_ = nullptr;
  int64_t block_size_;
  int64_t batch_ = 0, max_length_ = 1;
  torch::Device device_;
  bool decode_ = true;
  torch::Tensor new_slots_;
  mutable std::optional<Varlen> varlen_;
  mutable std::optional<Padded> padded_;
  mutable std::optional<torch::Tensor> padded_key_slots_;
};

/// With set_batch_invariant(true) (the true on-policy mode, blocks/batch_invariant.hpp): every
/// projection is invariant_linear, the norms invariant_rms_norm (their own switches), forward's
/// attention invariant_attention, and forward_cached always takes the expanded form
/// (cached_expanded: kv_b over the cached latents by kernels::bi_linear, kernels::bi_attention
/// end-aligned), on every device and whatever set_absorbed_decode says: the engine then runs
/// the trainer's formula with the same bits per token.
class MLAImpl : public torch::nn::Module, public BatchInvariantSwitch {
 public:
  explicit MLAImpl(const MLAOptions& opt);
  /// Parameters the constructor registers for `opt` (the projections and the two norms).
  static int64_t parameter_count(const MLAOptions& opt);
  /// x: [T, D], positions: [T] int64, cu_seqlens: [B+1] int64 -> [T, D]. max_seqlen: the
  /// longest document, or 0 to read it off cu_seqlens. position_bound: every position lies in
  /// [0, position_bound) (0: in [0, max_seqlen), each document numbered from 0); on CUDA the
  /// rope reads the rows of a cos/sin table that long (model::rope_table; with neither bound
  /// known, the composite computes cos/sin per position).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cu_seqlens,
                        int64_t max_seqlen = 0, int64_t position_bound = 0);

  /// Incremental step against a paged latent cache, attention in latent space (DeepSeek-V2
  /// §2.1.2 weight absorption): kv_b's key half is absorbed into the query, its value half into
  /// the output, so cached latents are never expanded to per-head keys and values.
  /// x: [N, D] new tokens of all slices; positions: [N]; cache: [blocks, block_size, C+R]
  /// holding per token the normed latent [C] then the roped shared key [R]; the new tokens'
  /// entries are written into it. Each slice attends causally to its cached and new tokens.
  /// -> [N, D]. Inference only (no autograd through the cache).
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& positions, const CachedLayout& layout,
                               torch::Tensor& cache);
  /// On CUDA in bf16/fp16, forward_cached does not absorb by default: it expands the cached
  /// latents through kv_b and runs the training path's FlashAttention kernel
  /// (cached_expanded), so that rollout log-probs match training's (at the cost of a kv_b GEMM
  /// over every cached token per step); elsewhere the absorbed latent-space form above. With
  /// set_absorbed_decode(true), steps in which every slice adds one token (decode) take the
  /// absorbed form on CUDA too, reading each cached latent instead of expanding it; prefill
  /// keeps FlashAttention. Absorbed decode rounds differently from training (bf16 products in
  /// another order): rollout log-probs then differ from the trainer's by more. A layout of
  /// device tensors only (CachedLayout::on_device_only, a captured decode step) always takes
  /// the absorbed form.
  void set_absorbed_decode(bool on) { absorbed_decode_ = on; }
  /// Decode steps that take the absorbed form compute its attention with
  /// kernels::mla_decode_attention (each cached latent read once, in place from its page, by a
  /// CUDA kernel) instead of gathering every slice's padded latents into a new tensor and
  /// reading them with two batched GEMMs; only where that kernel takes the inputs
  /// (kernels::mla_decode_kernel_supports: CUDA, bf16 cache and activations, its widths), the
  /// gather elsewhere. Same math, other roundings (fp32 online softmax over chunks, the
  /// probabilities rounded to bf16 per tile). Off until set.
  void set_decode_kernel(bool on) { decode_kernel_ = on; }
  /// Width of one cache entry: kv_lora_rank + qk_rope_head_dim.
  int64_t cache_width() const { return o_.kv_lora_rank + o_.qk_rope_head_dim; }

  torch::nn::Linear q{nullptr};     ///< [H*(N+R), D], when q_lora_rank is null
 private:
  torch::Tensor cached_expanded(const torch::Tensor& q, const CachedLayout& layout, torch::Tensor& cache);
  torch::Tensor project(torch::nn::Linear& l, const torch::Tensor& x);  ///< l(x), invariant_linear in the mode
  bool absorbed_decode_ = false;
  bool decode_kernel_ = false;

 public:
  torch::nn::Linear q_a{nullptr};   ///< [Q, D]
  RMSNorm q_a_norm{nullptr};        ///< [Q]
  torch::nn::Linear q_b{nullptr};   ///< [H*(N+R), Q]
  torch::nn::Linear kv_a{nullptr};  ///< [C+R, D]  (HF kv_a_proj_with_mqa)
  RMSNorm kv_a_norm{nullptr};       ///< [C]
  torch::nn::Linear kv_b{nullptr};  ///< [H*(N+V), C]
  torch::nn::Linear o{nullptr};     ///< [D, H*V]

 private:
  MLAOptions o_;
};
TORCH_MODULE(MLA);

}  // namespace kiln::model
