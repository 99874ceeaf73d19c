#pragma once
// TensorBoard event files: RUN/tensorboard/events.out.tfevents.<time>.<host>.<pid>, one scalar
// per numeric metric per step, next to metrics.jsonl (metrics.hpp). Torch-free.
//
// Format (TensorFlow's tfrecord and event.proto, as tensorboard's EventFileWriter writes it):
// each record is uint64 length (little-endian), uint32 masked CRC32C of those 8 bytes, the
// data, uint32 masked CRC32C of the data; mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. The
// first record is Event{wall_time, file_version: "brain.Event:2"}, then one
// Event{wall_time, step, summary{value{tag, simple_value}...}} per step.
//
// Why hand-written: the protobuf C++ runtime would need event.proto, summary.proto and their
// imports in the tree and a protoc step in the build for four fields (an Event's wall_time,
// step, file_version, summary; a Summary.Value's tag and simple_value); these are encoded
// below in ~40 lines. CRC32C (Castagnoli): Debian 12 packages no C/C++ library for it
// (no libcrc32c; Abseil 20220623 predates absl/crc; isa-l's crc32_iscsi would be a new
// dependency for a table of 256 words), and a few hundred bytes per step need no speed.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kiln::controller::tensorboard {

/// CRC32C (Castagnoli, reflected polynomial 0x82F63B78; "123456789" -> 0xE3069283).
uint32_t crc32c(std::string_view data);
/// TFRecord's masked CRC32C of `data`.
uint32_t masked_crc32c(std::string_view data);
/// `data` framed as one TFRecord.
std::string frame_record(std::string_view data);

/// The records of a TFRecord file, in order, up to the first one cut short or whose CRCs do not
/// match (a writer that died mid-record); `intact` says whether the file ended cleanly.
struct Records {
  std::vector<std::string> data;
  bool intact = true;
};
/// Throws std::runtime_error naming the file when it cannot be opened.
Records read_records(const std::filesystem::path& file);

/// Event protobufs (event.proto): the file's first event, and one step's scalars.
std::string file_version_event(double wall_time);
std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);
/// The step field of an encoded Event (0 when absent, as protobuf reads it); nullopt for bytes
/// that are not an Event this file could have written.
std::optional<int64_t> event_step(std::string_view event);

/// Every number of a metrics.jsonl row as (tag, value), in the row's key order, "step" left
/// out: numbers under their key, booleans as 0/1, numbers inside objects as "key/inner"
/// (staleness_histogram/0); strings and nulls left out.
std::vector<std::pair<std::string, float>> scalars_of(const nlohmann::json& row);

class EventWriter {
 public:
  /// Creates `dir` (RUN/tensorboard) and a new event file in it. `first_step` > 1 (a resume):
  /// events of steps >= first_step are first removed from the files already there (those
  /// steps are trained again), as metrics.jsonl drops their rows. The new file is named with
  /// the time in seconds, or one more than the newest file's when that is not earlier:
  /// TensorBoard reads a directory's files in name order. Throws std::runtime_error naming the
  /// file that cannot be written.
  EventWriter(const std::filesystem::path& dir, int64_t first_step);
  /// One event: the row's scalars (scalars_of) at its "step"; flushed.
  void write(const nlohmann::json& row, double wall_time);
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

}  // namespace kiln::controller::tensorboard
