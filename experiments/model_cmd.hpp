#pragma once
// `kiln model`: inspect the model registry and convert checkpoints through kiln.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::experiments {

/// Prints every model package (user plugins first, then built-ins) with its flavors.
int run_model_list(const std::string& plugin_dir);
/// Loads the HF checkpoint `from` with package `package` and writes it back to `to` through
/// kiln's adapter (config.json + safetensors shards of at most shard_mib MiB).
int run_model_resave(const std::string& package, const std::string& from, const std::string& to, int shard_mib,
                     const std::string& plugin_dir);

/// Cuts the GLM-5.3-Flash (glm5_next) checkpoint `from` to its first `layers` layers plus its
/// MTP layer(s), FP8 weights written as bf16 (model/glm5_next/crop.hpp), into `to`.
int run_model_crop(const std::string& from, const std::string& to, int64_t layers, int shard_mib);

/// Loads the HF checkpoint `from`, runs a packed forward over `docs` (token ids) and writes
/// logits [T, V] and routed_experts [T, L, K] to `out` (safetensors), for comparing kiln's
/// forward with another implementation on the same weights.
int run_model_logits(const std::string& package, const std::string& from, const std::vector<std::vector<int64_t>>& docs,
                     const std::string& out, const std::string& plugin_dir);

}  // namespace kiln::experiments
