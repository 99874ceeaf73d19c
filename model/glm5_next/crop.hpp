#pragma once
// Cropping a GLM-5.3-Flash checkpoint to its first N layers plus its MTP layer(s), in bf16: the
// validation crop (5 main layers + MTP, ~25B parameters) of the 45-layer FP8 release.
#include <cstdint>
#include <string>

namespace kiln::model::glm5_next {

struct CropResult {
  int64_t tensors_written = 0;
  int64_t fp8_dequantised = 0;  ///< FP8 weights written as bf16 (their _scale_inv dropped)
};

/// Reads the checkpoint in `from_dir` (config.json + safetensors) and writes into `to_dir`:
/// every tensor outside the decoder layers as is; the tensors of layers 0..layers-1 as is; the
/// MTP layers (indices num_hidden_layers.. of the source) renumbered to follow the kept ones
/// (layers.{num_hidden_layers + m} -> layers.{layers + m}); the other layers dropped. FP8
/// e4m3 weights with a `<name>_scale_inv` are dequantised to bf16 (block from the config's
/// quantization_config); every other tensor passes through bit for bit. config.json is the
/// source's with num_hidden_layers = layers, the per-layer lists cut to match and no
/// quantization_config. A key's layer is read from its first "layers.{i}." segment. Throws
/// std::invalid_argument for `layers` outside [1, num_hidden_layers] or a bad config, and
/// checkpoint::CheckpointError for unreadable or inconsistent tensors (an FP8 weight without
/// its scale, named).
CropResult crop_checkpoint(const std::string& from_dir, const std::string& to_dir, int64_t layers,
                           uint64_t max_shard_bytes);

}  // namespace kiln::model::glm5_next
