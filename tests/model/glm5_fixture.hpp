#pragma once
// The transformers-made GLM-5.3-Flash fixture (tests/fixtures/make_glm5_next_fixture.py):
// expected tensors and the checkpoint's weights, by HF name.
#include <torch/torch.h>

#include <string>

#include "messaging/torch_tensor.hpp"
#include "model/checkpoint/safetensors.hpp"

namespace kiln::test::glm5 {

inline std::string fixture_dir() { return std::string(KILN_FIXTURES_DIR) + "/glm5_next_tiny"; }

/// A tensor of expected.safetensors (copied out of the mapping).
inline torch::Tensor expected(const std::string& name) {
  static auto file = checkpoint::SafetensorsFile::open(fixture_dir() + "/expected.safetensors");
  return messaging::to_torch(file.get(name)).clone();
}

/// A weight of the fixture checkpoint, by its name under "model.language_model." (copied).
inline torch::Tensor weight(const std::string& name) {
  static auto ckpt = checkpoint::Checkpoint::open(fixture_dir());
  return messaging::to_torch(ckpt.get("model.language_model." + name)).clone();
}

/// Largest |a - b|.
inline double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace kiln::test::glm5
