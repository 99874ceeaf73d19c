#include "model/glm5_next/state_dict_adapter.hpp"

#include <set>

#include "messaging/torch_tensor.hpp"
#include "model/config_json.hpp"
#include "model/fp8_blocks.hpp"
#include "model/glm5_next/model.hpp"

namespace kiln::model::glm5_next {

using checkpoint::CheckpointError;

#define KILN_T "model.language_model."
#define KILN_L KILN_T "layers.{}."
const std::vector<KeyRule> kKeyTable = {
    {KILN_T "embed_tokens.weight", "embed.weight"},
    {KILN_T "norm.weight", "norm.weight"},
    {"lm_head.weight", "lm_head.weight"},
    {KILN_L "hc_attn_fn", "layers.{}.attn_hc.fn"},
    {KILN_L "hc_attn_base", "layers.{}.attn_hc.base"},
    {KILN_L "hc_attn_scale", "layers.{}.attn_hc.scale"},
    {KILN_L "hc_ffn_fn", "layers.{}.ffn_hc.fn"},
    {KILN_L "hc_ffn_base", "layers.{}.ffn_hc.base"},
    {KILN_L "hc_ffn_scale", "layers.{}.ffn_hc.scale"},
    {KILN_L "input_layernorm.weight", "layers.{}.attn_norm.weight"},
    {KILN_L "post_attention_layernorm.weight", "layers.{}.mlp_norm.weight"},
    // Kimi Delta Attention layers
    {KILN_L "self_attn.q_proj.weight", "layers.{}.kda.q_proj.weight"},
    {KILN_L "self_attn.k_proj.weight", "layers.{}.kda.k_proj.weight"},
    {KILN_L "self_attn.v_proj.weight", "layers.{}.kda.v_proj.weight"},
    {KILN_L "self_attn.q_conv1d.weight", "layers.{}.kda.q_conv"},
    {KILN_L "self_attn.k_conv1d.weight", "layers.{}.kda.k_conv"},
    {KILN_L "self_attn.v_conv1d.weight", "layers.{}.kda.v_conv"},
    {KILN_L "self_attn.f_a_proj.weight", "layers.{}.kda.f_a_proj.weight"},
    {KILN_L "self_attn.f_b_proj.weight", "layers.{}.kda.f_b_proj.weight"},
    {KILN_L "self_attn.dt_bias", "layers.{}.kda.dt_bias"},
    {KILN_L "self_attn.A_log", "layers.{}.kda.A_log"},
    {KILN_L "self_attn.b_proj.weight", "layers.{}.kda.b_proj.weight"},
    {KILN_L "self_attn.g_a_proj.weight", "layers.{}.kda.g_a_proj.weight"},
    {KILN_L "self_attn.g_b_proj.weight", "layers.{}.kda.g_b_proj.weight"},
    {KILN_L "self_attn.o_norm.weight", "layers.{}.kda.o_norm"},
    {KILN_L "self_attn.o_proj.weight", "layers.{}.kda.o_proj.weight"},
    // sparse-attention layers
    {KILN_L "self_attn.q_a_proj.weight", "layers.{}.attn.q_a.weight"},
    {KILN_L "self_attn.q_a_layernorm.weight", "layers.{}.attn.q_a_norm.weight"},
    {KILN_L "self_attn.q_b_proj.weight", "layers.{}.attn.q_b.weight"},
    {KILN_L "self_attn.kv_a_proj_with_mqa.weight", "layers.{}.attn.kv_a.weight"},
    {KILN_L "self_attn.kv_a_layernorm.weight", "layers.{}.attn.kv_a_norm.weight"},
    {KILN_L "self_attn.kv_b_proj.weight", "layers.{}.attn.kv_b.weight"},
    {KILN_L "self_attn.o_proj.weight", "layers.{}.attn.o.weight"},
    {KILN_L "self_attn.indexer.wq_b.weight", "layers.{}.attn.indexer.wq_b.weight"},
    {KILN_L "self_attn.indexer.wk.weight", "layers.{}.attn.indexer.wk.weight"},
    {KILN_L "self_attn.indexer.k_norm.weight", "layers.{}.attn.indexer.k_norm.weight"},
    {KILN_L "self_attn.indexer.k_norm.bias", "layers.{}.attn.indexer.k_norm.bias"},
    {KILN_L "self_attn.indexer.weights_proj.weight", "layers.{}.attn.indexer.weights_proj.weight"},
    {KILN_L "self_attn.indexer.index_kpool_compress_ape", "layers.{}.attn.indexer.compress_ape"},
    {KILN_L "self_attn.indexer.index_kpool_compress_gate", "layers.{}.attn.indexer.compress_gate"},
    // dense MLPs
    {KILN_L "mlp.gate_proj.weight", "layers.{}.mlp.gate.weight"},
    {KILN_L "mlp.up_proj.weight", "layers.{}.mlp.up.weight"},
    {KILN_L "mlp.down_proj.weight", "layers.{}.mlp.down.weight"},
    // MoE (routed experts: the fuse below)
    {KILN_L "mlp.gate.weight", "layers.{}.moe.router.weight"},
    {KILN_L "mlp.gate.e_score_correction_bias", "layers.{}.moe.router.e_score_correction_bias"},
    {KILN_L "mlp.shared_experts.gate_proj.weight", "layers.{}.moe.shared.gate.weight"},
    {KILN_L "mlp.shared_experts.up_proj.weight", "layers.{}.moe.shared.up.weight"},
    {KILN_L "mlp.shared_experts.down_proj.weight", "layers.{}.moe.shared.down.weight"},
    // the MTP layers' own tensors (kiln mtp.{i}.* is looked up as layers.{num_hidden_layers + i}.*;
    // their attention, norms and MoE use the rules above)
    {KILN_L "enorm.weight", "layers.{}.enorm.weight"},
    {KILN_L "hnorm.weight", "layers.{}.hnorm.weight"},
    {KILN_L "eh_proj.weight", "layers.{}.eh_proj.weight"},
    {KILN_L "shared_head.norm.weight", "layers.{}.head_norm.weight"},
};

namespace {
const std::string kLayers = KILN_T "layers.";
#undef KILN_L
#undef KILN_T

using Source = TensorSource;

// Where kiln tensor `internal` comes from; the MTP layer mtp.{i} is HF layer num_layers + i.
Source source_of(const std::string& internal, int64_t num_layers) {
  static const KeyTable table(kKeyTable, "glm5_next");
  if (internal.rfind("mtp.", 0) == 0) {
    const auto dot = internal.find('.', 4);
    const int64_t i = std::stoll(internal.substr(4, dot - 4));
    return table.source_of("layers." + std::to_string(num_layers + i) + internal.substr(dot));
  }
  return table.source_of(internal);
}

// The MTP layers' copies of the shared embedding and output head, which some checkpoints
// store (DeepSeek-V3 does; vLLM and SGLang skip them): HF key suffix -> the main model's key.
const std::vector<std::pair<std::string, std::string>> kMtpSharedCopies = {
    {"embed_tokens.weight", "model.language_model.embed_tokens.weight"},
    {"shared_head.head.weight", "lm_head.weight"},
};

std::string expert_key(int64_t layer, int64_t e, const char* proj) {
  return kLayers + std::to_string(layer) + ".mlp.experts." + std::to_string(e) + "." + proj + ".weight";
}

// The HF keys kiln tensor `name` is read from.
std::vector<std::string> hf_keys(const Source& s, int64_t experts) {
  if (s.kind == Source::Kind::direct) return {s.hf};
  std::vector<std::string> keys;
  for (int64_t e = 0; e < experts; ++e) {
    if (s.kind == Source::Kind::gate_up) {
      keys.push_back(expert_key(s.layer, e, "gate_proj"));
      keys.push_back(expert_key(s.layer, e, "up_proj"));
    } else {
      keys.push_back(expert_key(s.layer, e, "down_proj"));
    }
  }
  return keys;
}
}  // namespace

std::vector<std::string> required_hf_keys(Glm5NextModelImpl& model) {
  std::vector<std::string> keys;
  const int64_t L = model.config().num_hidden_layers;
  for (const auto& [name, t] : named_tensors(model))
    for (auto& k : hf_keys(source_of(name, L), model.config().moe.num_experts)) keys.push_back(k);
  return keys;
}

void load_hf_state_dict(Glm5NextModelImpl& model, checkpoint::Checkpoint& ckpt) {
  load_hf_state_dict(model, HfTensorSource::of(ckpt));
}

void load_hf_state_dict(Glm5NextModelImpl& model, const std::vector<messaging::Tensor>& tensors) {
  load_hf_state_dict(model, HfTensorSource::of(tensors));
}

void load_hf_state_dict(Glm5NextModelImpl& model, const HfTensorSource& ckpt) {
  const auto& cfg = model.config();
  const int64_t E = cfg.moe.num_experts, F = cfg.moe.expert_intermediate_size, D = cfg.hidden_size;
  const auto block = cfg.fp8_weight_block.value_or(std::pair<int64_t, int64_t>{128, 128});
  const std::string& where = ckpt.where;
  std::set<std::string> consumed;
  std::vector<std::string> missing;
  auto need = [&](const std::string& k) {
    consumed.insert(k);
    if (!ckpt.contains(k)) missing.push_back(k);
    if (ckpt.contains(k + "_scale_inv")) consumed.insert(k + "_scale_inv");
  };
  const int64_t L = cfg.num_hidden_layers, built = L + model.mtp_layers();
  for (const auto& [name, t] : named_tensors(model))
    for (const auto& k : hf_keys(source_of(name, L), E)) need(k);
  // An MTP layer's copies of the embedding and head: read below, must equal the main model's.
  std::vector<std::pair<std::string, std::string>> shared_copies;
  for (int64_t i = L; i < built; ++i)
    for (const auto& [suffix, main_key] : kMtpSharedCopies) {
      const auto k = kLayers + std::to_string(i) + "." + suffix;
      if (!ckpt.contains(k)) continue;
      consumed.insert(k);
      if (ckpt.contains(k + "_scale_inv")) consumed.insert(k + "_scale_inv");
      shared_copies.emplace_back(k, main_key);
    }
  // Layers past the built ones (MTP layers of a config that declares fewer) are not read.
  std::vector<std::string> unexpected;
  for (const auto& k : ckpt.names())
    if (!consumed.count(k) && k.rfind("model.visual.", 0) != 0 && layer_of(k, kLayers) < built)
      unexpected.push_back(k);
  throw_if_misfit(where, "glm5_next (" + std::to_string(cfg.num_hidden_layers) + " layers)", missing, unexpected);
  // A tensor as stored, FP8 dequantised with its block scales.
  auto raw = [&ckpt, where, block](const std::string& key) {
    auto t = messaging::to_torch(ckpt.get(key));
    if (t.scalar_type() == torch::kFloat8_e4m3fn) {
      if (!ckpt.contains(key + "_scale_inv"))
        throw CheckpointError(where + ": FP8 tensor '" + key + "' has no '" + key + "_scale_inv'");
      try {
        t = dequantize_fp8_blocks(t, messaging::to_torch(ckpt.get(key + "_scale_inv")), block.first, block.second,
                                  torch::kFloat);
      } catch (const std::invalid_argument& e) {
        throw CheckpointError(where + ": tensor '" + key + "': " + e.what());
      }
    }
    return t;
  };
  // kiln's MTP layers share the main model's embedding and head (DeepSeek-V3 §2.2): a copy that
  // differs from the checkpoint's own would be a different model, refused by name (before
  // anything is written).
  for (const auto& [key, main_key] : shared_copies) {
    const auto& mine = main_key == "lm_head.weight" ? model.lm_head->weight : model.embed->weight;
    const auto as_mine = [&](const std::string& k) { return checked(where, k, raw(k), mine.sizes()).to(mine.scalar_type()); };
    if (!torch::equal(as_mine(key), as_mine(main_key)))
      throw CheckpointError(where + ": tensor '" + key + "' differs from '" + main_key +
                            "': kiln's MTP layers share the main model's embedding and output head");
  }
  std::vector<PlannedCopy> plan;
  auto add = [&](torch::Tensor dst, const std::string& key, std::vector<int64_t> shape) {
    plan.push_back({std::move(dst), key, std::move(shape), [raw, key] { return raw(key); }});
  };
  for (auto& [name, param] : named_tensors(model)) {
    auto s = source_of(name, L);
    if (s.kind == Source::Kind::direct) {
      add(param, s.hf, param.sizes().vec());
    } else if (s.kind == Source::Kind::gate_up) {
      for (int64_t e = 0; e < E; ++e) {  // fuse: [2F, D] = cat(gate [F, D], up [F, D])
        add(param[e].narrow(0, 0, F), expert_key(s.layer, e, "gate_proj"), {F, D});
        add(param[e].narrow(0, F, F), expert_key(s.layer, e, "up_proj"), {F, D});
      }
    } else {
      for (int64_t e = 0; e < E; ++e) add(param[e], expert_key(s.layer, e, "down_proj"), {D, F});
    }
  }
  copy_all_or_nothing(where, plan);
}

std::vector<messaging::Tensor> to_hf_state_dict(Glm5NextModelImpl& model) {
  const int64_t E = model.config().moe.num_experts, F = model.config().moe.expert_intermediate_size;
  std::vector<messaging::Tensor> out;
  auto add = [&](const std::string& key, const torch::Tensor& t) {
    out.push_back(messaging::from_torch(key, t.detach().to(torch::kCPU).contiguous()));
  };
  const int64_t L = model.config().num_hidden_layers;
  for (const auto& [name, t] : named_tensors(model)) {
    auto s = source_of(name, L);
    if (s.kind == Source::Kind::direct) add(s.hf, t);
    for (int64_t e = 0; s.kind == Source::Kind::gate_up && e < E; ++e) {  // split
      add(expert_key(s.layer, e, "gate_proj"), t[e].narrow(0, 0, F));
      add(expert_key(s.layer, e, "up_proj"), t[e].narrow(0, F, F));
    }
    for (int64_t e = 0; s.kind == Source::Kind::down && e < E; ++e) add(expert_key(s.layer, e, "down_proj"), t[e]);
  }
  return out;
}

void save_hf_checkpoint(Glm5NextModelImpl& model, const std::string& dir, uint64_t max_shard_bytes) {
  checkpoint::write_checkpoint(dir, to_hf_state_dict(model), max_shard_bytes);
  save_hf_config(model, dir);
}

void save_hf_config(Glm5NextModelImpl& model, const std::string& dir) {
  try {
    config_json::write_config_json(dir, model.config().to_hf_json());
  } catch (const std::runtime_error& e) {
    throw CheckpointError(e.what());
  }
}

std::shared_ptr<Glm5NextModelImpl> from_hf_dir(const std::string& dir) {
  auto j = config_json::read_config_json(dir);
  auto model = std::make_shared<Glm5NextModelImpl>(Glm5NextConfig::from_hf_json(j, dir + "/config.json"));
  auto ckpt = checkpoint::Checkpoint::open(dir);
  load_hf_state_dict(*model, ckpt);
  return model;
}

}  // namespace kiln::model::glm5_next
