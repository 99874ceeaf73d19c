#pragma once
// Which model to build, and where: one type for the experiment file's [model] section and
// for every init message that builds a model in another process (rollout.init, ref.init,
// trainer.init). Torch-free, so that configuration and messaging code can hold it.
#include <string>

#include <msgpack.hpp>

namespace kiln::model {

struct ModelSpec {
  std::string package = "glm4_moe_lite";  ///< registry name (model/registry.hpp)
  std::string flavor = "debug";           ///< named size of the package
  std::string checkpoint;                 ///< HF checkpoint directory; overrides flavor when set
  std::string device = "cpu";             ///< "cpu", "cuda" or "cuda:N"
  std::string dtype = "fp32";             ///< "fp32" | "bf16" (bf16 training keeps fp32 master weights)
  MSGPACK_DEFINE_MAP(package, flavor, checkpoint, device, dtype);
};

}  // namespace kiln::model
