#include "model/key_table.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <sstream>

#include "model/checkpoint/safetensors.hpp"

namespace kiln::model {

HfTensorSource HfTensorSource::of(checkpoint::Checkpoint& ckpt) {
  return {"checkpoint '" + ckpt.dir() + "'", [&ckpt] { return ckpt.names(); },
          [&ckpt](const std::string& k) { return ckpt.contains(k); },
          [&ckpt](const std::string& k) { return ckpt.get(k); }};
}

HfTensorSource HfTensorSource::of(const std::vector<messaging::Tensor>& tensors) {
  auto by_name = std::make_shared<std::map<std::string, const messaging::Tensor*>>();
  for (const auto& t : tensors) (*by_name)[t.name] = &t;
  return {"weight update",
          [by_name] {
            std::vector<std::string> n;
            for (const auto& [k, t] : *by_name) n.push_back(k);
            return n;
          },
          [by_name](const std::string& k) { return by_name->count(k) > 0; },
          [by_name](const std::string& k) { return *by_name->at(k); }};
}

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

// aminmax propagates a NaN into both results, and an infinity shows as the min or the max.
// 8-bit floats (no aminmax kernel) go through fp32 a chunk at a time.
bool all_finite(const torch::Tensor& t) {
  const auto flat = t.reshape({-1});
  constexpr int64_t kChunk = int64_t(1) << 24;
  const bool narrow_float = t.element_size() == 1;
  for (int64_t i = 0; i < flat.numel(); i += kChunk) {
    auto part = flat.narrow(0, i, std::min(kChunk, flat.numel() - i));
    if (narrow_float) part = part.to(torch::kFloat32);
    const auto [lo, hi] = torch::aminmax(part);
    if (!std::isfinite(lo.item<double>()) || !std::isfinite(hi.item<double>())) return false;
  }
  return true;
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
  if (!all_finite(t)) {
    const int64_t bad = (~torch::isfinite(t.to(torch::kFloat32))).sum().item<int64_t>();
    throw checkpoint::CheckpointError(where + ": tensor '" + key + "' holds " + std::to_string(bad) + " non-finite value" +
                                      (bad == 1 ? "" : "s") + " (NaN or infinity) of " + std::to_string(t.numel()) +
                                      ": refusing to load it");
  }
  return t;
}

void copy_all_or_nothing(const std::string& where, const std::vector<PlannedCopy>& plan) {
  for (const auto& c : plan) (void)checked(where, c.key, c.read(), c.shape);
  torch::NoGradGuard no_grad;
  for (const auto& c : plan) {
    auto t = c.read();
    c.dst.copy_(c.count >= 0 ? t.narrow(0, c.first, c.count) : t);
  }
}

KeyTable::KeyTable(const std::vector<KeyRule>& rules, std::string package) : package_(std::move(package)) {
  for (const auto& r : rules) rules_.emplace_back(pattern_regex(r.internal), &r);
}

TensorSource KeyTable::source_of(const std::string& internal) const {
  static const std::regex gate_up("layers\\.(\\d+)\\.moe\\.experts\\.w_gate_up_EFD");
  static const std::regex down("layers\\.(\\d+)\\.moe\\.experts\\.w_down_EDF");
  std::smatch m;
  if (std::regex_match(internal, m, gate_up)) return {TensorSource::Kind::gate_up, "", std::stoll(m[1])};
  if (std::regex_match(internal, m, down)) return {TensorSource::Kind::down, "", std::stoll(m[1])};
  for (const auto& [re, rule] : rules_)
    if (std::regex_match(internal, m, re))
      return {TensorSource::Kind::direct, fill_pattern(rule->hf, m.size() > 1 ? m[1].str() : ""), -1};
  throw std::logic_error(package_ + " adapter: no HF name for kiln tensor '" + internal + "'");
}

std::vector<std::pair<std::string, torch::Tensor>> named_tensors(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  for (auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

void throw_if_misfit(const std::string& where, const std::string& what, const std::vector<std::string>& missing,
                     const std::vector<std::string>& unexpected) {
  if (missing.empty() && unexpected.empty()) return;
  // The first names of each list: a checkpoint of another model misses hundreds.
  constexpr std::size_t kShown = 32;
  auto names = [&](const std::vector<std::string>& keys) {
    std::string out;
    for (std::size_t i = 0; i < keys.size() && i < kShown; ++i) out += " " + keys[i];
    if (keys.size() > kShown) out += " ... (" + std::to_string(keys.size() - kShown) + " more)";
    return out;
  };
  std::string msg = where + " does not fit " + what + ":";
  if (!missing.empty()) msg += " missing " + std::to_string(missing.size()) + " key(s):" + names(missing) + ";";
  if (!unexpected.empty()) msg += " unexpected " + std::to_string(unexpected.size()) + " key(s):" + names(unexpected);
  throw checkpoint::CheckpointError(msg);
}

}  // namespace kiln::model
