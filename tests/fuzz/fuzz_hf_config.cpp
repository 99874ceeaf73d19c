// Fuzz harness: an HF config.json for glm4_moe_lite (model/glm4_moe_lite/config.cpp), the
// whole input as the file. Properties: parsing never crashes and refuses with nothing but
// std::invalid_argument; a config it accepts passes validate() and round-trips through
// to_hf_json().
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "fuzz_util.hpp"
#include "model/glm4_moe_lite/config.hpp"

using kiln::model::glm4_moe_lite::Glm4MoeLiteConfig;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;  // not JSON: from_hf_dir refuses it before the reader sees it
  Glm4MoeLiteConfig c;
  try {
    c = Glm4MoeLiteConfig::from_hf_json(j, "fuzz");
  } catch (const std::invalid_argument&) {
    return 0;
  }
  // Outside the try: an exception here is a broken property, and libFuzzer reports it.
  c.validate();
  auto back = Glm4MoeLiteConfig::from_hf_json(c.to_hf_json(), "round trip");
  KILN_FUZZ_CHECK(back.to_hf_json() == c.to_hf_json(), "an accepted config.json round-trips through to_hf_json()");
  return 0;
}
