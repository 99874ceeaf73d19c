#pragma once
// HF names <-> kiln names for glm5_next: a table of patterns with {} for the layer index
// (kKeyTable), in the layout transformers 5.17's save_pretrained writes for
// Glm5NextForConditionalGeneration (text weights under "model.language_model.", hc_attn_fn,
// q_conv1d, A_log on self_attn, experts one by one), plus one named transform:
//   fuse:  ...layers.{l}.mlp.experts.{e}.gate_proj.weight [F, D] and .up_proj.weight [F, D]
//          -> layers.{l}.moe.experts.w_gate_up_EFD[e] = cat(gate, up) [2F, D];
//          ...experts.{e}.down_proj.weight [D, F] -> w_down_EDF[e].
// FP8 weights (float8_e4m3fn with a `<name>_scale_inv` block-scale grid) are dequantised on
// load (model/fp8_blocks.hpp, block from the config, 128x128 by default). The vision tower
// (model.visual.*) and the MTP layer (layers.{num_hidden_layers}) are never read.
#include <string>
#include <vector>

#include "model/checkpoint/safetensors.hpp"
#include "model/key_table.hpp"

namespace kiln::model::glm5_next {

class Glm5NextModelImpl;

/// Every one-to-one rule.
extern const std::vector<KeyRule> kKeyTable;

/// The HF keys the model reads, in load order (per-expert names for experts).
std::vector<std::string> required_hf_keys(Glm5NextModelImpl& model);

/// Copies every tensor the model needs from `ckpt` (shape checked on every copy, cast to the
/// parameter's dtype). Throws checkpoint::CheckpointError listing all missing keys and all
/// unexpected ones, or naming a tensor whose shape or dtype does not fit.
void load_hf_state_dict(Glm5NextModelImpl& model, checkpoint::Checkpoint& ckpt);

}  // namespace kiln::model::glm5_next
