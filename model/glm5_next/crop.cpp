#include "model/glm5_next/crop.hpp"

#include <nlohmann/json.hpp>
#include <regex>
#include <stdexcept>
#include <vector>

#include "messaging/torch_tensor.hpp"
#include "model/checkpoint/safetensors.hpp"
#include "model/config_json.hpp"
#include "model/fp8_blocks.hpp"
#include "model/glm5_next/config.hpp"
#include "model/key_table.hpp"

namespace kiln::model::glm5_next {

CropResult crop_checkpoint(const std::string& from_dir, const std::string& to_dir, int64_t layers,
                           uint64_t max_shard_bytes) {
  const auto source_json = config_json::read_config_json(from_dir);
  auto cfg = Glm5NextConfig::from_hf_json(source_json, from_dir + "/config.json");
  const int64_t L = cfg.num_hidden_layers;
  if (layers < 1 || layers > L)
    throw std::invalid_argument("cropping '" + from_dir + "': layers must be in [1, " + std::to_string(L) + "] (its num_hidden_layers), got " +
                                std::to_string(layers));
  const auto block = cfg.fp8_weight_block.value_or(std::pair<int64_t, int64_t>{128, 128});
  cfg.num_hidden_layers = layers;
  cfg.layer_types.resize(std::size_t(layers));
  cfg.indexer_types.resize(std::size_t(layers));
  cfg.moe_layers.resize(std::size_t(layers));
  cfg.fp8_weight_block.reset();
  cfg.validate();  // e.g. a cut that leaves a shared indexer layer first is refused here

  auto ckpt = checkpoint::Checkpoint::open(from_dir);
  const std::string where = "checkpoint '" + from_dir + "'";
  // A copier that goes by the index would silently drop a tensor the index forgot.
  if (const auto missed = ckpt.unindexed(); !missed.empty()) {
    std::string list;
    for (std::size_t i = 0; i < missed.size() && i < 5; ++i)
      list += (i ? ", '" : "'") + missed[i].first + "' (in " + missed[i].second + ")";
    if (missed.size() > 5) list += " and " + std::to_string(missed.size() - 5) + " more";
    throw checkpoint::CheckpointError(where + ": its shards hold " + std::to_string(missed.size()) +
                                      " tensor(s) that model.safetensors.index.json does not list: " + list +
                                      "; the crop would drop them (add them to the index's weight_map)");
  }
  static const std::regex layer_re("(^|\\.)layers\\.(\\d+)\\.");
  CropResult result;
  std::vector<messaging::Tensor> out;
  for (const auto& key : ckpt.names()) {
    const std::string scale_suffix = "_scale_inv";
    if (key.size() > scale_suffix.size() && key.compare(key.size() - scale_suffix.size(), scale_suffix.size(), scale_suffix) == 0 &&
        ckpt.contains(key.substr(0, key.size() - scale_suffix.size())))
      continue;  // consumed with its weight
    std::string name = key;
    std::smatch m;
    if (std::regex_search(key, m, layer_re)) {
      const int64_t i = std::stoll(m[2]);
      if (i >= layers && i < L) continue;  // a dropped main layer
      if (i >= L) {                        // an MTP layer: renumbered after the kept ones
        const auto at = std::size_t(m.position(2));
        name = key.substr(0, at) + std::to_string(layers + (i - L)) + key.substr(at + m[2].length());
      }
    }
    auto t = messaging::to_torch(ckpt.get(key));
    if (t.scalar_type() == torch::kFloat8_e4m3fn) {
      if (!ckpt.contains(key + scale_suffix))
        throw checkpoint::CheckpointError(where + ": FP8 tensor '" + key + "' has no '" + key + scale_suffix + "'");
      try {
        t = dequantize_fp8_blocks(t, messaging::to_torch(ckpt.get(key + scale_suffix)), block.first, block.second,
                                  torch::kBFloat16);
      } catch (const std::invalid_argument& e) {
        throw checkpoint::CheckpointError(where + ": tensor '" + key + "': " + e.what());
      }
      ++result.fp8_dequantised;
      checked(where, key, t, t.sizes());  // finite after dequantisation too
      out.push_back(messaging::from_torch(name, t));
    } else {
      // A NaN or infinite weight is refused by name, not copied into the cropped checkpoint.
      if (at::isFloatingType(t.scalar_type())) checked(where, key, t, t.sizes());
      auto copy = ckpt.get(key);  // bytes as stored
      copy.name = name;
      out.push_back(std::move(copy));
    }
  }
  checkpoint::write_checkpoint(to_dir, out, max_shard_bytes);
  // config.json: the source's, with the text config replaced by the cropped one.
  auto j = source_json;
  auto cropped = cfg.to_hf_json();
  if (j.contains("text_config")) j["text_config"] = cropped["text_config"];
  else
    for (auto it = cropped["text_config"].begin(); it != cropped["text_config"].end(); ++it) j[it.key()] = it.value();
  j.erase("quantization_config");
  j["dtype"] = "bfloat16";
  try {
    config_json::write_config_json(to_dir, j);
  } catch (const std::runtime_error& e) {
    throw checkpoint::CheckpointError(e.what());
  }
  result.tensors_written = int64_t(out.size());
  return result;
}

}  // namespace kiln::model::glm5_next
