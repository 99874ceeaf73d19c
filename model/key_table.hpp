#pragma once
// The pieces every HF adapter's key table is made of: patterns with {} for the layer index,
// their regular expressions, the layer of an HF key, and the checked read of one tensor.
#include <regex>
#include <string>

#include <torch/torch.h>

namespace kiln::model {

/// One one-to-one rule of an adapter's table.
struct KeyRule {
  const char* hf;        ///< HF name pattern, {} = layer index
  const char* internal;  ///< kiln name pattern
};

/// `pattern` with its {} replaced by `layer` (unchanged without a {}).
std::string fill_pattern(const std::string& pattern, const std::string& layer);
/// A regex matching `pattern` whole, {} captured as (\d+), dots literal.
std::regex pattern_regex(const std::string& pattern);
/// The layer index of `key` = PREFIX{i}.rest (e.g. prefix "model.layers."), or -1.
int64_t layer_of(const std::string& key, const std::string& prefix);
/// `t` (HF tensor `key` of `where`) if it has `shape` and a floating dtype; throws
/// checkpoint::CheckpointError "WHERE: tensor 'KEY' has shape [..], the model needs [..]".
torch::Tensor checked(const std::string& where, const std::string& key, const torch::Tensor& t, at::IntArrayRef shape);

}  // namespace kiln::model
