#pragma once
// The pieces every HF adapter's key table is made of: patterns with {} for the layer index,
// their regular expressions, the layer of an HF key, and the checked read of one tensor.
#include <functional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "messaging/tensor.hpp"
#include "model/checkpoint/safetensors.hpp"

namespace kiln::model {

/// One one-to-one rule of an adapter's table.
struct KeyRule {
  const char* hf;        ///< HF name pattern, {} = layer index
  const char* internal;  ///< kiln name pattern
};

/// Where one kiln tensor's bytes live in an HF checkpoint: one HF tensor (direct), or the
/// per-expert tensors a grouped expert tensor of `layer` is fused from (gate_up: kiln
/// layers.{l}.moe.experts.w_gate_up_EFD; down: w_down_EDF, as blocks/moe.hpp names them).
struct TensorSource {
  enum class Kind { direct, gate_up, down } kind = Kind::direct;
  std::string hf;      ///< direct: the HF key
  int64_t layer = -1;  ///< experts: the layer index
};

/// Where HF-named tensors come from: a checkpoint directory, or tensors in memory (weight sync).
struct HfTensorSource {
  std::string where;  ///< for error messages ("checkpoint '/x'", "weight update v3")
  std::function<std::vector<std::string>()> names;
  std::function<bool(const std::string&)> contains;
  std::function<messaging::Tensor(const std::string&)> get;
  /// The tensors of `ckpt` (held by reference: it must outlive the source), "checkpoint 'DIR'".
  static HfTensorSource of(checkpoint::Checkpoint& ckpt);
  /// `tensors` by name (held by reference), "weight update".
  static HfTensorSource of(const std::vector<messaging::Tensor>& tensors);
};

/// A package's table of rules, compiled once.
class KeyTable {
 public:
  /// `package` names the table in the error for a kiln tensor without a rule.
  KeyTable(const std::vector<KeyRule>& rules, std::string package);
  /// Where kiln tensor `internal` comes from. Throws std::logic_error for a tensor without a
  /// rule (every tensor a model registers must have one: a miss is a kiln bug).
  TensorSource source_of(const std::string& internal) const;

 private:
  std::vector<std::pair<std::regex, const KeyRule*>> rules_;
  std::string package_;
};

/// A module's parameters and buffers by their kiln names, parameters first.
std::vector<std::pair<std::string, torch::Tensor>> named_tensors(torch::nn::Module& m);

/// Throws checkpoint::CheckpointError "WHERE does not fit WHAT: missing N key(s): ...;
/// unexpected M key(s): ..." when either list is non-empty.
void throw_if_misfit(const std::string& where, const std::string& what, const std::vector<std::string>& missing,
                     const std::vector<std::string>& unexpected);

/// `pattern` with its {} replaced by `layer` (unchanged without a {}).
std::string fill_pattern(const std::string& pattern, const std::string& layer);
/// A regex matching `pattern` whole, {} captured as (\d+), dots literal.
std::regex pattern_regex(const std::string& pattern);
/// The layer index of `key` = PREFIX{i}.rest (e.g. prefix "model.layers."), or -1.
int64_t layer_of(const std::string& key, const std::string& prefix);
/// True when no element of floating tensor `t` is NaN or infinite; reads it once, in chunks of
/// 16M elements (no temporary as large as a whole expert tensor).
bool all_finite(const torch::Tensor& t);
/// `t` (HF tensor `key` of `where`) if it has `shape`, a floating dtype and only finite values;
/// throws checkpoint::CheckpointError "WHERE: tensor 'KEY' has shape [..], the model needs [..]",
/// or "... holds N non-finite values (NaN or infinity) ..." (a NaN weight would turn every
/// logit, log-prob and gradient it touches into NaN). The finiteness check reads the tensor once
/// (aminmax over chunks of 16M elements; no copy of a whole tensor).
torch::Tensor checked(const std::string& where, const std::string& key, const torch::Tensor& t, at::IntArrayRef shape);

/// One copy of a load: HF tensor `key` (read by `read`, as stored; `shape` the shape it must
/// have) into `dst`, rows [first, first + count) of its dim 0 when count >= 0 (a grouped expert
/// tensor of which the model holds a slice).
struct PlannedCopy {
  torch::Tensor dst;
  std::string key;
  std::vector<int64_t> shape;
  std::function<torch::Tensor()> read;
  int64_t first = 0, count = -1;
};
/// Runs a load's copies so that a refused tensor leaves the model as it was: every source is
/// read and `checked` (shape, dtype, finite values) before any destination is written, then each
/// is read again and copied. Sources are views of an mmap'd checkpoint or of a received update,
/// so the second read costs no more than the page cache (an FP8 tensor is dequantised twice).
/// Throws what `read` or `checked` throw, having written nothing.
void copy_all_or_nothing(const std::string& where, const std::vector<PlannedCopy>& plan);

}  // namespace kiln::model
