#pragma once
// HF names <-> kiln names for glm4_moe_lite. A table of patterns with {} for the layer index
// (kKeyTable), plus two named transforms for the grouped experts:
//   fuse:  model.layers.{l}.mlp.experts.{e}.gate_proj.weight [F, D] and .up_proj.weight [F, D]
//          -> layers.{l}.moe.experts.w_gate_up_EFD[e] = cat(gate, up) [2F, D]
//          model.layers.{l}.mlp.experts.{e}.down_proj.weight [D, F] -> w_down_EDF[e]
//   split: the reverse, when saving.
// Checkpoints that already hold transformers' grouped tensors (mlp.experts.gate_up_proj
// [E, 2F, D], mlp.experts.down_proj [E, D, F]) load too. The MTP layer (index
// num_hidden_layers) is never read. Only the keys the model needs are read.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "messaging/tensor.hpp"
#include "model/checkpoint/safetensors.hpp"
#include "model/key_table.hpp"

namespace kiln::model::glm4_moe_lite {

class Glm4MoeLiteModel;

using kiln::model::KeyRule;
/// Every one-to-one rule.
extern const std::vector<KeyRule> kKeyTable;

/// HF tensors an engine may fuse and weight sync keeps in one bucket: SGLang and vLLM run a
/// layer's q_a_proj and kv_a_proj_with_mqa as one GEMM (fused_qkv_a_proj_with_mqa).
extern const std::vector<std::vector<std::string>> kWeightSyncGroups;
/// kWeightSyncGroups under HF names, or translated to kiln names through kKeyTable.
std::vector<std::vector<std::string>> weight_sync_groups(bool hf_names);

/// The HF keys the model reads, in load order (per-expert names for experts).
std::vector<std::string> required_hf_keys(Glm4MoeLiteModel& model);

using kiln::model::HfTensorSource;

/// Copies every tensor the model needs from `src` (shape checked on every copy, cast to the
/// parameter's dtype). A model holding one ep rank's routed experts (expert_slice()) reads only
/// those experts' tensors (a grouped [E, ...] tensor narrowed to them), though every expert's
/// key must be there. Throws checkpoint::CheckpointError listing all missing keys and all
/// unexpected ones (keys of layers >= num_hidden_layers, the MTP layer, are neither read nor
/// reported), or naming a tensor whose shape or dtype does not fit.
void load_hf_state_dict(Glm4MoeLiteModel& model, const HfTensorSource& src);
void load_hf_state_dict(Glm4MoeLiteModel& model, checkpoint::Checkpoint& ckpt);
void load_hf_state_dict(Glm4MoeLiteModel& model, const std::vector<messaging::Tensor>& tensors);

/// Where each HF tensor the model reads is written, for loads of any subset of them (SGLang's
/// update_weights_from_distributed): HF name -> a view of the kiln parameter or buffer it
/// fills, of the HF tensor's shape, in the parameter's dtype and on its device. Per-expert names
/// (mlp.experts.{e}.gate_proj.weight [F, D] -> w_gate_up_EFD[e][0:F], up_proj -> [F:2F],
/// down_proj [D, F] -> w_down_EDF[e]) and transformers' grouped ones (mlp.experts.gate_up_proj
/// [E, 2F, D], mlp.experts.down_proj [E, D, F]) both. Throws std::invalid_argument for a model
/// holding a slice of the experts (an ep rank's; load the full weights instead).
std::map<std::string, torch::Tensor> hf_targets(Glm4MoeLiteModel& model);
/// Whether HF tensor `key` belongs to what the model never builds (layers >= num_hidden_layers:
/// the MTP layer), which loads skip.
bool hf_key_skipped(const Glm4MoeLiteModel& model, const std::string& key);

/// The model's weights under HF names (experts split per expert), on CPU, contiguous. With expert
/// parallel: collective over the ep group (the full experts gathered on every ep rank). Throws
/// std::logic_error for a model holding a slice of the experts without an ep group.
std::vector<messaging::Tensor> to_hf_state_dict(Glm4MoeLiteModel& model);
/// The part of to_hf_state_dict this rank holds, without a collective: with expert parallel
/// over P ranks, ep rank j's experts [j*E/P, (j+1)*E/P) under those global ids, plus every
/// other tensor when `with_dense`; without expert parallel, all of it when `with_dense`.
std::vector<messaging::Tensor> to_hf_state_dict_local(Glm4MoeLiteModel& model, bool with_dense);

}  // namespace kiln::model::glm4_moe_lite
