#pragma once
// The transformers-made GLM-4.7-Flash fixture (tests/fixtures/make_glm4_moe_lite_fixture.py).
#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "../scratch.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/blocks/basic.hpp"
#include "model/checkpoint/safetensors.hpp"

namespace kiln::test {

inline std::string fixture_dir() {
  std::string dir = KILN_FIXTURES_DIR;
  return dir.append("/glm4_moe_lite_tiny");
}

/// A tensor of expected.safetensors (copied out of the mapping).
inline torch::Tensor expected(const std::string& name) {
  static auto file = checkpoint::SafetensorsFile::open(fixture_dir() + "/expected.safetensors");
  return messaging::to_torch(file.get(name)).clone();
}

inline model::PackedBatch fixture_batch() {
  return model::PackedBatch{expected("input_ids"), expected("position_ids"), expected("cu_seqlens")};
}

/// A scratch directory under the build tree, emptied first.
inline std::string scratch_dir(const std::string& name) {
  std::filesystem::path p = scratch_path("model-" + name);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

/// Copies the fixture checkpoint (weights, config, index) into a scratch directory.
inline std::string fixture_copy(const std::string& name) {
  auto dst = scratch_dir(name);
  for (const auto& e : std::filesystem::directory_iterator(fixture_dir()))
    if (e.path().filename() != "expected.safetensors") std::filesystem::copy(e.path(), dst);
  return dst;
}

}  // namespace kiln::test
