#include "model/glm4_moe_lite/state_dict_adapter.hpp"

#include <map>
#include <regex>
#include <set>

#include "messaging/torch_tensor.hpp"
#include "model/blocks/moe_ep.hpp"
#include "model/key_table.hpp"
#include "model/glm4_moe_lite/model.hpp"

namespace kiln::model::glm4_moe_lite {

using checkpoint::CheckpointError;

const std::vector<KeyRule> kKeyTable = {
    {"model.embed_tokens.weight", "embed.weight"},
    {"model.norm.weight", "norm.weight"},
    {"lm_head.weight", "lm_head.weight"},
    {"model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"},
    {"model.layers.{}.post_attention_layernorm.weight", "layers.{}.mlp_norm.weight"},
    {"model.layers.{}.self_attn.q_proj.weight", "layers.{}.attn.q.weight"},
    {"model.layers.{}.self_attn.q_a_proj.weight", "layers.{}.attn.q_a.weight"},
    {"model.layers.{}.self_attn.q_a_layernorm.weight", "layers.{}.attn.q_a_norm.weight"},
    {"model.layers.{}.self_attn.q_b_proj.weight", "layers.{}.attn.q_b.weight"},
    {"model.layers.{}.self_attn.kv_a_proj_with_mqa.weight", "layers.{}.attn.kv_a.weight"},
    {"model.layers.{}.self_attn.kv_a_layernorm.weight", "layers.{}.attn.kv_a_norm.weight"},
    {"model.layers.{}.self_attn.kv_b_proj.weight", "layers.{}.attn.kv_b.weight"},
    {"model.layers.{}.self_attn.o_proj.weight", "layers.{}.attn.o.weight"},
    {"model.layers.{}.mlp.gate_proj.weight", "layers.{}.mlp.gate.weight"},
    {"model.layers.{}.mlp.up_proj.weight", "layers.{}.mlp.up.weight"},
    {"model.layers.{}.mlp.down_proj.weight", "layers.{}.mlp.down.weight"},
    {"model.layers.{}.mlp.gate.weight", "layers.{}.moe.router.weight"},
    {"model.layers.{}.mlp.gate.e_score_correction_bias", "layers.{}.moe.router.e_score_correction_bias"},
    {"model.layers.{}.mlp.shared_experts.gate_proj.weight", "layers.{}.moe.shared.gate.weight"},
    {"model.layers.{}.mlp.shared_experts.up_proj.weight", "layers.{}.moe.shared.up.weight"},
    {"model.layers.{}.mlp.shared_experts.down_proj.weight", "layers.{}.moe.shared.down.weight"},
};

const std::vector<std::vector<std::string>> kWeightSyncGroups = {
    {"model.layers.{}.self_attn.q_a_proj.weight", "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight"},
};

std::vector<std::vector<std::string>> weight_sync_groups(bool hf_names) {
  if (hf_names) return kWeightSyncGroups;
  std::vector<std::vector<std::string>> out;
  for (const auto& group : kWeightSyncGroups) {
    out.emplace_back();
    for (const auto& hf : group)
      for (const auto& rule : kKeyTable)
        if (hf == rule.hf) out.back().push_back(rule.internal);
  }
  return out;
}

namespace {
using Source = TensorSource;

Source source_of(const std::string& internal) {
  static const KeyTable table(kKeyTable, "glm4_moe_lite");
  return table.source_of(internal);
}

std::string expert_key(int64_t layer, int64_t e, const char* proj) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e) + "." + proj + ".weight";
}
std::string grouped_key(int64_t layer, const char* proj) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts." + proj;
}

std::vector<std::pair<std::string, torch::Tensor>> kiln_tensors(Glm4MoeLiteModel& model) { return named_tensors(model); }

}  // namespace

std::vector<std::string> required_hf_keys(Glm4MoeLiteModel& model) {
  std::vector<std::string> keys;
  const int64_t E = model.config().moe.num_experts;
  for (const auto& [name, t] : kiln_tensors(model)) {
    auto s = source_of(name);
    if (s.kind == Source::Kind::direct) keys.push_back(s.hf);
    for (int64_t e = 0; s.kind == Source::Kind::gate_up && e < E; ++e) {
      keys.push_back(expert_key(s.layer, e, "gate_proj"));
      keys.push_back(expert_key(s.layer, e, "up_proj"));
    }
    for (int64_t e = 0; s.kind == Source::Kind::down && e < E; ++e) keys.push_back(expert_key(s.layer, e, "down_proj"));
  }
  return keys;
}

std::map<std::string, torch::Tensor> hf_targets(Glm4MoeLiteModel& model) {
  const auto slice = model.expert_slice();
  if (slice.ranks > 1)
    throw std::invalid_argument("glm4_moe_lite: the model holds the routed experts of ep rank " +
                                std::to_string(slice.rank) + " of " + std::to_string(slice.ranks) +
                                " only: HF tensors load into a model holding all of them");
  const int64_t F = model.config().moe.expert_intermediate_size;
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : kiln_tensors(model)) {
    auto s = source_of(name);
    if (s.kind == Source::Kind::direct) {
      out[s.hf] = t;
    } else if (s.kind == Source::Kind::gate_up) {  // [E, 2F, D]: gate rows [0, F), up rows [F, 2F)
      out[grouped_key(s.layer, "gate_up_proj")] = t;
      for (int64_t e = 0; e < t.size(0); ++e) {
        out[expert_key(s.layer, e, "gate_proj")] = t[e].narrow(0, 0, F);
        out[expert_key(s.layer, e, "up_proj")] = t[e].narrow(0, F, F);
      }
    } else {  // [E, D, F]
      out[grouped_key(s.layer, "down_proj")] = t;
      for (int64_t e = 0; e < t.size(0); ++e) out[expert_key(s.layer, e, "down_proj")] = t[e];
    }
  }
  return out;
}

bool hf_key_skipped(const Glm4MoeLiteModel& model, const std::string& key) {
  return layer_of(key, "model.layers.") >= model.config().num_hidden_layers;
}

void load_hf_state_dict(Glm4MoeLiteModel& model, checkpoint::Checkpoint& ckpt) {
  load_hf_state_dict(model, HfTensorSource::of(ckpt));
}

void load_hf_state_dict(Glm4MoeLiteModel& model, const std::vector<messaging::Tensor>& tensors) {
  load_hf_state_dict(model, HfTensorSource::of(tensors));
}

void load_hf_state_dict(Glm4MoeLiteModel& model, const HfTensorSource& ckpt) {
  const auto& cfg = model.config();
  const int64_t E = cfg.moe.num_experts, F = cfg.moe.expert_intermediate_size, D = cfg.hidden_size;
  // Plan first: which HF keys each kiln tensor needs, and which are missing.
  std::set<std::string> consumed;
  std::vector<std::string> missing;
  auto need = [&](const std::string& k) {
    consumed.insert(k);
    if (!ckpt.contains(k)) missing.push_back(k);
  };
  auto grouped = [&](int64_t layer, const char* proj) { return ckpt.contains(grouped_key(layer, proj)); };
  for (const auto& [name, t] : kiln_tensors(model)) {
    auto s = source_of(name);
    if (s.kind == Source::Kind::direct) need(s.hf);
    else if (s.kind == Source::Kind::gate_up && grouped(s.layer, "gate_up_proj")) need(grouped_key(s.layer, "gate_up_proj"));
    else if (s.kind == Source::Kind::down && grouped(s.layer, "down_proj")) need(grouped_key(s.layer, "down_proj"));
    else
      for (int64_t e = 0; e < E; ++e) {
        if (s.kind == Source::Kind::gate_up) {
          need(expert_key(s.layer, e, "gate_proj"));
          need(expert_key(s.layer, e, "up_proj"));
        } else {
          need(expert_key(s.layer, e, "down_proj"));
        }
      }
  }
  std::vector<std::string> unexpected;
  for (const auto& k : ckpt.names())
    if (!consumed.count(k) && !hf_key_skipped(model, k)) unexpected.push_back(k);
  throw_if_misfit(ckpt.where, "glm4_moe_lite (" + std::to_string(cfg.num_hidden_layers) + " layers)", missing, unexpected);
  // The routed experts this model holds: [e0, e0 + El) (all E unless built as an ep rank's
  // share); every expert's key was checked above, only these are read.
  const auto slice = model.expert_slice();
  const int64_t El = E / slice.ranks, e0 = slice.rank * El;
  std::vector<PlannedCopy> plan;
  auto add = [&](torch::Tensor dst, const std::string& key, std::vector<int64_t> shape, int64_t first = 0,
                 int64_t count = -1) {
    plan.push_back({std::move(dst), key, std::move(shape), [&ckpt, key] { return messaging::to_torch(ckpt.get(key)); },
                    first, count});
  };
  for (auto& [name, param] : kiln_tensors(model)) {
    auto s = source_of(name);
    if (s.kind == Source::Kind::direct) {
      add(param, s.hf, param.sizes().vec());
    } else if (s.kind == Source::Kind::gate_up) {
      if (grouped(s.layer, "gate_up_proj"))  // [E, 2F, D] -> this model's [El, 2F, D]
        add(param, grouped_key(s.layer, "gate_up_proj"), {E, 2 * F, D}, e0, El);
      else
        for (int64_t e = e0; e < e0 + El; ++e) {  // fuse: [2F, D] = cat(gate [F, D], up [F, D])
          add(param[e - e0].narrow(0, 0, F), expert_key(s.layer, e, "gate_proj"), {F, D});
          add(param[e - e0].narrow(0, F, F), expert_key(s.layer, e, "up_proj"), {F, D});
        }
    } else {
      if (grouped(s.layer, "down_proj"))  // [E, D, F] -> [El, D, F]
        add(param, grouped_key(s.layer, "down_proj"), {E, D, F}, e0, El);
      else
        for (int64_t e = e0; e < e0 + El; ++e) add(param[e - e0], expert_key(s.layer, e, "down_proj"), {D, F});
    }
  }
  copy_all_or_nothing(ckpt.where, plan);
}

namespace {
// HF tensors of the model: the non-expert ones when `with_dense`; the routed experts split per
// expert, either whole (`gather`: with expert parallel every ep rank's slice gathered, a
// collective) or this rank's slice only, under their global ids.
std::vector<messaging::Tensor> hf_tensors(Glm4MoeLiteModel& model, bool with_dense, bool gather) {
  const int64_t F = model.config().moe.expert_intermediate_size;
  auto* ep = model.expert_parallel();
  std::vector<messaging::Tensor> out;
  auto add = [&](const std::string& key, const torch::Tensor& t) {
    out.push_back(messaging::from_torch(key, t.detach().to(torch::kCPU).contiguous()));
  };
  if (model.expert_slice().ranks > 1 && !model.expert_parallel())
    throw std::logic_error("glm4_moe_lite: the model holds the routed experts of rank " +
                           std::to_string(model.expert_slice().rank) + " of " +
                           std::to_string(model.expert_slice().ranks) +
                           " only and has no ep group to gather the others over (set_expert_parallel first)");
  for (const auto& [name, local] : kiln_tensors(model)) {
    auto s = source_of(name);
    if (s.kind == Source::Kind::direct) {
      if (with_dense) add(s.hf, local);
      continue;
    }
    // Expert parallel: the full [E, ...] tensor from every ep rank's slice (collective, in
    // kiln_tensors order on every rank), or this rank's experts [first, first + El).
    const bool whole = gather && ep;
    const torch::Tensor t = whole ? gather_experts(local, *ep) : local;
    const int64_t first = ep && !whole ? ep->rank() * local.size(0) : 0;
    for (int64_t e = 0; s.kind == Source::Kind::gate_up && e < t.size(0); ++e) {  // split
      add(expert_key(s.layer, first + e, "gate_proj"), t[e].narrow(0, 0, F));
      add(expert_key(s.layer, first + e, "up_proj"), t[e].narrow(0, F, F));
    }
    for (int64_t e = 0; s.kind == Source::Kind::down && e < t.size(0); ++e)
      add(expert_key(s.layer, first + e, "down_proj"), t[e]);
  }
  return out;
}
}  // namespace

std::vector<messaging::Tensor> to_hf_state_dict(Glm4MoeLiteModel& model) { return hf_tensors(model, true, true); }

std::vector<messaging::Tensor> to_hf_state_dict_local(Glm4MoeLiteModel& model, bool with_dense) {
  return hf_tensors(model, with_dense, false);
}

}  // namespace kiln::model::glm4_moe_lite
