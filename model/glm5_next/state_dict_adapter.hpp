#pragma once
// HF names <-> kiln names for glm5_next: a table of patterns with {} for the layer index
// (kKeyTable), in the layout transformers 5.17's save_pretrained writes for
// Glm5NextForConditionalGeneration (text weights under "model.language_model.", hc_attn_fn,
// q_conv1d, A_log on self_attn, experts one by one), plus one named transform:
//   fuse:  ...layers.{l}.mlp.experts.{e}.gate_proj.weight [F, D] and .up_proj.weight [F, D]
//          -> layers.{l}.moe.experts.w_gate_up_EFD[e] = cat(gate, up) [2F, D];
//          ...experts.{e}.down_proj.weight [D, F] -> w_down_EDF[e];
//   split: the reverse, when saving.
// FP8 weights (float8_e4m3fn with a `<name>_scale_inv` block-scale grid) are dequantised on
// load (model/fp8_blocks.hpp, block from the config, 128x128 by default). The vision tower
// (model.visual.*) is never read. The MTP layers (num_nextn_predict_layers of them) are HF
// layers.{num_hidden_layers + i}: enorm, hnorm, eh_proj, shared_head.norm, and a block named
// as a main sparse-attention MoE layer's (input_layernorm, self_attn.* with its indexer,
// post_attention_layernorm, mlp.*; no hc_* tensors); their copies of the embedding and head
// (embed_tokens, shared_head.head), where stored, must equal the main model's and are not
// written back. Keys of layers past the built ones are not read.
#include <memory>
#include <string>
#include <vector>

#include "messaging/tensor.hpp"
#include "model/checkpoint/safetensors.hpp"
#include "model/key_table.hpp"

namespace kiln::model::glm5_next {

class Glm5NextModelImpl;

/// Every one-to-one rule.
extern const std::vector<KeyRule> kKeyTable;

/// The HF keys the model reads, in load order (per-expert names for experts).
std::vector<std::string> required_hf_keys(Glm5NextModelImpl& model);

/// Copies every tensor the model needs from `src` (shape checked on every copy, cast to the
/// parameter's dtype; FP8 dequantised). Throws checkpoint::CheckpointError listing all missing
/// keys and all unexpected ones (the vision tower's and those of layers past the main and MTP
/// layers built are neither), or naming a tensor whose shape or dtype does not fit, or an MTP
/// layer's embedding or head copy that differs from the main model's.
void load_hf_state_dict(Glm5NextModelImpl& model, const HfTensorSource& src);
/// From a checkpoint directory, or from HF-named tensors in memory (weight sync).
void load_hf_state_dict(Glm5NextModelImpl& model, checkpoint::Checkpoint& ckpt);
void load_hf_state_dict(Glm5NextModelImpl& model, const std::vector<messaging::Tensor>& tensors);

/// The model's weights under HF names (experts split per expert), on CPU, contiguous, in the
/// model's dtypes.
std::vector<messaging::Tensor> to_hf_state_dict(Glm5NextModelImpl& model);

/// Writes the weights (HF names, shards of at most max_shard_bytes) and config.json into
/// `dir`. Throws checkpoint::CheckpointError on I/O failure.
void save_hf_checkpoint(Glm5NextModelImpl& model, const std::string& dir, uint64_t max_shard_bytes);

/// Writes DIR/config.json (Glm5NextConfig::to_hf_json). Throws checkpoint::CheckpointError
/// when it cannot be written.
void save_hf_config(Glm5NextModelImpl& model, const std::string& dir);

/// A model built from DIR/config.json and loaded from DIR's safetensors. Throws
/// std::invalid_argument for the config (field named) and checkpoint::CheckpointError for the
/// weights.
std::shared_ptr<Glm5NextModelImpl> from_hf_dir(const std::string& dir);

}  // namespace kiln::model::glm5_next
