#include "model/key_table.hpp"

#include <sstream>

#include "model/checkpoint/safetensors.hpp"

namespace kiln::model {

std::string fill_pattern(const std::string& pattern, const std::string& layer) {
  auto p = pattern.find("{}");
  return p == std::string::npos ? pattern : pattern.substr(0, p) + layer + pattern.substr(p + 2);
}

std::regex pattern_regex(const std::string& pattern) {
  std::string r;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern.compare(i, 2, "{}") == 0) {
      r += "(\\d+)";
      ++i;
    } else if (pattern[i] == '.') {
      r += "\\.";
    } else {
      r += pattern[i];
    }
  }
  return std::regex(r);
}

int64_t layer_of(const std::string& key, const std::string& prefix) {
  if (key.compare(0, prefix.size(), prefix) != 0) return -1;
  auto end = key.find('.', prefix.size());
  try {
    return std::stoll(key.substr(prefix.size(), end - prefix.size()));
  } catch (...) {
    return -1;
  }
}

torch::Tensor checked(const std::string& where, const std::string& key, const torch::Tensor& t, at::IntArrayRef shape) {
  if (t.sizes() != shape) {
    std::ostringstream s;
    s << where << ": tensor '" << key << "' has shape " << t.sizes() << ", the model needs " << shape;
    throw checkpoint::CheckpointError(s.str());
  }
  if (!t.is_floating_point())
    throw checkpoint::CheckpointError(where + ": tensor '" + key + "' has integer dtype " +
                                      std::string(c10::toString(t.scalar_type())) + ", expected a floating-point weight");
  return t;
}

}  // namespace kiln::model
