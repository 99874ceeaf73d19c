// Model registry: user packages from a plugin directory come before built-ins; a miss names
// every place it looked.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/registry.hpp"

using namespace kiln::model;

TEST_CASE("built-in glm4_moe_lite builds its flavors") {
  auto r = Registry::with_builtins();
  const auto& p = r.find("glm4_moe_lite");
  CHECK(r.origin("glm4_moe_lite") == "built-in");
  auto m = p.build_flavor("debug");
  auto out = m->forward(PackedBatch::from_documents({{3, 4, 5}, {6, 7}}));
  CHECK((out.hidden.sizes() == torch::IntArrayRef({5, 64})));
  CHECK_THROWS_WITH_AS(p.build_flavor("huge"), doctest::Contains("flavors: glm47_flash, debug"), std::invalid_argument);
}

TEST_CASE("built-in glm5_next builds its flavors and reads an HF directory the way its adapter does") {
  auto r = Registry::with_builtins();
  const auto& p = r.find("glm5_next");
  CHECK(r.origin("glm5_next") == "built-in");
  CHECK(p.hf_model_type == "glm5_next");
  torch::manual_seed(1);
  auto m = r.build(ModelSpec{"glm5_next", "debug", "", "cpu", "fp32"});
  const auto batch = PackedBatch::from_documents({{3, 4, 5}, {6, 7}});
  ForwardOptions ask;
  ask.return_routed_experts = true;
  ask.return_topk_indices = true;
  auto out = m->forward(batch, ask);
  CHECK((out.hidden.sizes() == torch::IntArrayRef({5, 64})));
  CHECK((out.routed_experts.sizes() == torch::IntArrayRef({5, 3, 2})));  // 3 MoE layers, top-2
  CHECK((out.topk_indices.sizes() == torch::IntArrayRef({5, 2, 5})));    // 2 sparse layers, topk 4 + tail 1
  CHECK(m->num_moe_layers() == 3);
  CHECK(m->vocab_size() == 96);
  // Random weights: the routed experts are drawn, not left zero (they would give no gradient).
  CHECK(m->named_parameters()["layers.1.moe.experts.w_gate_up_EFD"].abs().sum().item<double>() > 0);
  CHECK_THROWS_WITH_AS(p.build_flavor("huge"), doctest::Contains("flavors: glm53_flash, glm53_flash_5l, debug"),
                       std::invalid_argument);
  // From the fixture directory: the same logits as a second load, and hf_state_dict round-trips.
  auto a = r.build("glm5_next", "", KILN_FIXTURES_DIR "/glm5_next_tiny");
  auto b = r.build("glm5_next", "debug", "");
  b->load_hf_tensors(a->hf_state_dict());
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(a->logits(a->forward(batch)), b->logits(b->forward(batch))));
  // glm4_moe_lite has no sparse-attention layers to replay.
  auto glm4 = r.build("glm4_moe_lite", "debug", "");
  ForwardOptions replay;
  replay.replay_topk_indices = out.topk_indices;
  CHECK_THROWS_WITH_AS(glm4->forward(batch, replay), doctest::Contains("glm4_moe_lite has no sparse-attention layers"),
                       std::invalid_argument);
}

TEST_CASE("a checkpoint of another package's model_type is refused naming that package, one its reader takes is not") {
  auto r = Registry::with_builtins();
  CHECK_THROWS_WITH_AS(r.build("glm4_moe_lite", "", KILN_FIXTURES_DIR "/glm5_next_tiny"),
                       doctest::Contains("is a \"glm5_next\" checkpoint (config.json model_type); model package "
                                         "glm4_moe_lite reads \"glm4_moe_lite\" ones: use package glm5_next"),
                       std::invalid_argument);
  // glm5_next's reader also takes a root model_type of "glm5_next_text", which no package declares.
  const auto dir = std::filesystem::temp_directory_path() / ("kiln_registry_type_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::copy(KILN_FIXTURES_DIR "/glm5_next_tiny", dir);
  std::ifstream in(dir / "config.json");
  auto j = nlohmann::json::parse(in);
  in.close();
  j["model_type"] = "glm5_next_text";
  std::ofstream(dir / "config.json") << j.dump(2);
  CHECK_NOTHROW(r.build("glm5_next", "", dir.string()));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a plugin's packages are found first, shadowing a built-in of the same name") {
  auto r = Registry::with_builtins();
  CHECK(r.load_plugins(KILN_TEST_PLUGIN_DIR) == 1);
  CHECK(r.origin("toy_lm").find("kiln_test_model_plugin.so") != std::string::npos);
  CHECK(r.origin("glm4_moe_lite").find("kiln_test_model_plugin.so") != std::string::npos);
  auto toy = r.find("toy_lm").build_flavor("toy");
  CHECK(toy->num_moe_layers() == 1);
  CHECK(r.find("glm4_moe_lite").description == "user override of the built-in glm4_moe_lite");
}

TEST_CASE("a miss names the plugin directory and the built-ins it looked in") {
  auto r = Registry::with_builtins();
  r.load_plugins(KILN_TEST_PLUGIN_DIR);
  try {
    r.find("llama9");
    FAIL("found a package that does not exist");
  } catch (const std::invalid_argument& e) {
    std::string m = e.what();
    CHECK(m.find("no model package 'llama9'") != std::string::npos);
    CHECK(m.find(KILN_TEST_PLUGIN_DIR) != std::string::npos);
    CHECK(m.find("toy_lm") != std::string::npos);
    CHECK(m.find("built-in packages (glm4_moe_lite, glm5_next)") != std::string::npos);
  }
}

TEST_CASE("a library without the entry point is refused by name") {
  auto r = Registry::with_builtins();
  CHECK_THROWS_WITH_AS(r.load_plugins(KILN_TEST_BAD_PLUGIN_DIR), doctest::Contains("kiln_register_model_packages"),
                       std::runtime_error);
}
