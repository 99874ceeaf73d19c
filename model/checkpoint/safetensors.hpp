#pragma once
// safetensors files (https://github.com/huggingface/safetensors, format as written by its
// reference implementation) and sharded checkpoints with model.safetensors.index.json.
// Reading memory-maps the file: a tensor is a view into the mapping (no copy, and bytes that
// are never asked for are never read from disk). No LibTorch here.
//
// Layout: u64 little-endian N | N bytes of JSON header | data. Header: {"name": {"dtype":
// "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}},
// offsets relative to the start of the data.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "messaging/tensor.hpp"

namespace kiln::checkpoint {

using messaging::DType;
using messaging::Tensor;

/// Any fault in a checkpoint: the message names the file and, where it applies, the tensor.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Header entry of one tensor.
struct TensorInfo {
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  ///< byte offsets into the data section
};

/// Largest header accepted (the reference implementation's limit), bytes.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

class SafetensorsFile {
 public:
  /// Maps `path` and validates the header: size within the file and below kMaxHeaderBytes,
  /// valid JSON, known dtypes, non-negative dims, end - begin == numel * item size, and the
  /// tensors' data_offsets, sorted, cover the data section exactly (the first begins at 0,
  /// each where the one before ends, the last at the end of the file: no gap, no overlap, no
  /// trailing byte). Throws CheckpointError naming the file, the tensors and their offsets.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return infos_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return infos_.count(name) > 0; }
  /// View of tensor `name` into the mapping (owner keeps the file mapped). Throws
  /// CheckpointError if absent.
  Tensor get(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<const void> mapping_;  // the whole file, mmap'ed read-only
  const std::byte* data_ = nullptr;      // start of the data section
  std::map<std::string, TensorInfo> infos_;
  std::map<std::string, std::string> metadata_;
};

/// Where write_safetensors writes `path` until it is whole: `path` + ".partial".
inline constexpr const char* kPartialSuffix = ".partial";
inline std::string partial_path(const std::string& path) { return path + kPartialSuffix; }

/// Writes `tensors` (named by Tensor::name; names must be unique) to `path` in
/// safetensors format, data in the given order, 8-byte-aligned header: into partial_path(path),
/// renamed over `path` once whole. Throws CheckpointError on I/O failure (the partial file
/// removed, `path` as it was) or duplicate names.
void write_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

/// A checkpoint directory: model.safetensors, or shards listed in
/// model.safetensors.index.json ("weight_map": name -> file). Shards are opened on first use.
class Checkpoint {
 public:
  /// Reads the index (or finds the single file). Throws CheckpointError if neither exists
  /// or the index is malformed. Shards are not opened yet.
  static Checkpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  /// Every tensor name the index (or single file) lists.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return weight_map_.count(name) > 0; }
  /// Header entry; opens the shard. Throws CheckpointError (missing name, missing shard).
  TensorInfo info(const std::string& name);
  /// View of a tensor; opens its shard on first use. Throws CheckpointError naming the
  /// tensor and file (missing tensor, missing or corrupt shard, index naming a file that
  /// does not hold the tensor).
  Tensor get(const std::string& name);
  /// Tensors a shard holds that the index does not list, as (tensor, shard file) pairs, sorted:
  /// opens every shard the index names. A reader that goes by the index (transformers, kiln's
  /// load, `kiln model crop`) never sees them; a copier checks this list to refuse an incomplete
  /// index instead of dropping them. Empty for a single-file checkpoint. Throws what opening a
  /// shard throws.
  std::vector<std::pair<std::string, std::string>> unindexed();
  /// Shard files opened so far (tests use it to prove what was never read).
  std::vector<std::string> opened_files() const;

 private:
  SafetensorsFile& shard(const std::string& file);
  std::string dir_;
  std::map<std::string, std::string> weight_map_;  // tensor -> file (relative to dir_)
  std::map<std::string, std::shared_ptr<SafetensorsFile>> shards_;
};

/// Writes `tensors` into `dir` as model-0000i-of-0000n.safetensors shards of at most
/// `max_shard_bytes` each (a larger tensor gets a shard of its own) plus
/// model.safetensors.index.json, as transformers' save_pretrained lays them out. Shards and
/// index of an earlier save in `dir` are removed first. Do not write into the checkpoint the
/// tensors are read from (their memory maps would be overwritten).
void write_checkpoint(const std::string& dir, const std::vector<Tensor>& tensors, uint64_t max_shard_bytes);

}  // namespace kiln::checkpoint
