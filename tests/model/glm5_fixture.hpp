#pragma once
// The transformers-made GLM-5.3-Flash fixture (tests/fixtures/make_glm5_next_fixture.py):
// expected tensors and the checkpoint's weights, by HF name.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "messaging/torch_tensor.hpp"
#include "model/checkpoint/safetensors.hpp"

namespace kiln::test::glm5 {

inline std::string fixture_dir() {
  std::string dir = KILN_FIXTURES_DIR;  // appended, not "a" + b: GCC 12's -Wrestrict false positive
  dir += "/glm5_next_tiny";
  return dir;
}

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

/// Checks loss_of's autograd gradients (already in each probe's .grad()) against central finite
/// differences (step 1e-6, fp64) at the first, middle and last entry of each probe: within
/// 1e-6 of max(1, |fd|).
inline void check_finite_differences(const std::function<torch::Tensor()>& loss_of,
                                     const std::vector<std::pair<std::string, torch::Tensor>>& probes) {
  for (const auto& [name, p] : probes) {
    CAPTURE(name);
    auto flat = p.detach().view({-1});
    auto grad = p.grad().view({-1});
    for (int64_t i : {int64_t(0), flat.numel() / 2, flat.numel() - 1}) {
      CAPTURE(i);
      const double h = 1e-6, orig = flat[i].item<double>();
      torch::NoGradGuard ng;
      flat[i] = orig + h;
      const double up = loss_of().item<double>();
      flat[i] = orig - h;
      const double down = loss_of().item<double>();
      flat[i] = orig;
      const double fd = (up - down) / (2 * h);
      CHECK(std::abs(fd - grad[i].item<double>()) <= 1e-6 * std::max(1.0, std::abs(fd)));
    }
  }
}

}  // namespace kiln::test::glm5
