// Device-to-device weight sync (actors/weight_sync/device_sync.hpp) on the debug model: every
// tensor lands, mismatched models are refused by name, and a copy
// that another write clobbers fails the post-copy check naming the tensor. Runs on the CPU
// here and on the GPU when one is present.
#include <doctest/doctest.h>

#include "../test_util.hpp"
#include "actors/weight_sync/device_sync.hpp"
#include "model/glm4_moe_lite/model.hpp"

using namespace kiln;

namespace {
std::shared_ptr<model::glm4_moe_lite::Glm4MoeLiteModel> debug_model(int64_t seed, torch::Device dev) {
  torch::manual_seed(seed);
  auto m = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(model::glm4_moe_lite::flavors::debug());
  m->to(dev);
  m->to_dtype(torch::kBFloat16);
  return m;
}
std::vector<torch::Device> devices() {
  std::vector<torch::Device> d{torch::kCPU};
  if (test::have_gpu()) d.emplace_back(torch::kCUDA);
  return d;
}
}  // namespace

TEST_CASE("device weight sync copies every tensor into the engine and checks it") {
  for (auto dev : devices()) {
    CAPTURE(dev);
    auto trainer = debug_model(1, dev), engine = debug_model(2, dev);
    auto st = weight_sync::copy_weights_device(*trainer, *engine, /*bucket_bytes=*/4096, true,
                                               trainer->weight_sync_groups(/*hf_names=*/false));
    CHECK(st.verified);
    CHECK(st.buckets > 1);
    CHECK(st.tensors == int64_t(trainer->named_parameters().size() + trainer->named_buffers().size()));
    auto e = engine->named_parameters();
    for (const auto& p : trainer->named_parameters()) CHECK(torch::equal(p.value(), e[p.key()]));
  }
}

TEST_CASE("a clobbered engine tensor fails the check by name, and mismatched models are refused") {
  for (auto dev : devices()) {
    CAPTURE(dev);
    auto trainer = debug_model(1, dev), engine = debug_model(2, dev);
    // The engine ties lm_head to the embedding (same storage): copying lm_head after embed
    // overwrites the embedding the trainer sent, which the post-copy check must name.
    {
      torch::NoGradGuard ng;
      engine->lm_head->weight.set_data(engine->embed->weight.data());
    }
    CHECK_THROWS_WITH_AS(weight_sync::copy_weights_device(*trainer, *engine, uint64_t(1) << 30, true),
                         doctest::Contains("differs from the trainer's for embed.weight"), std::runtime_error);
    auto small = std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>([] {
      auto c = model::glm4_moe_lite::flavors::debug();
      c.vocab_size = 80;
      return c;
    }());
    small->to(dev);
    CHECK_THROWS_WITH_AS(weight_sync::copy_weights_device(*trainer, *small, 4096, true),
                         doctest::Contains("'embed.weight' is [96, 64] in the trainer, [80, 64] in the engine"),
                         std::invalid_argument);
  }
}
