// Model registry: user packages from a plugin directory come before built-ins; a miss names
// every place it looked.
#include <doctest/doctest.h>

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
    CHECK(m.find("built-in packages (glm4_moe_lite)") != std::string::npos);
  }
}

TEST_CASE("a library without the entry point is refused by name") {
  auto r = Registry::with_builtins();
  CHECK_THROWS_WITH_AS(r.load_plugins(KILN_TEST_BAD_PLUGIN_DIR), doctest::Contains("kiln_register_model_packages"),
                       std::runtime_error);
}
