// A user model package as a plugin: a "toy_lm" package, and one that shadows the built-in
// "glm4_moe_lite" (user packages are looked up first).
#include "model/glm4_moe_lite/model.hpp"
#include "model/registry.hpp"

extern "C" void kiln_register_model_packages(kiln::model::Registry& registry) {
  using namespace kiln::model;
  ModelPackage toy;
  toy.name = "toy_lm";
  toy.hf_model_type = "glm4_moe_lite";
  toy.description = "a user package reusing the glm4_moe_lite blocks at toy size";
  toy.flavors = {"toy"};
  toy.build_flavor = [](const std::string& flavor) -> std::shared_ptr<CausalLM> {
    if (flavor != "toy") throw std::invalid_argument("toy_lm has no flavor '" + flavor + "' (flavors: toy)");
    auto c = glm4_moe_lite::flavors::debug();
    c.num_hidden_layers = 2;
    c.moe_layers = {false, true};
    return std::make_shared<glm4_moe_lite::Glm4MoeLiteModel>(c);
  };
  toy.from_hf_dir = [](const std::string& dir) -> std::shared_ptr<CausalLM> { return glm4_moe_lite::from_hf_dir(dir); };
  registry.add(toy);
  ModelPackage shadow = toy;
  shadow.name = "glm4_moe_lite";
  shadow.description = "user override of the built-in glm4_moe_lite";
  registry.add(shadow);
}
