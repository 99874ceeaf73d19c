// TensorBoard event files: CRC32C against RFC 3720's vectors, and records and events byte for
// byte against what the tensorboard package (2.x: RecordWriter, event_pb2) writes; the writer's
// resume. tests/experiments/check_tensorboard.py reads a run's files with TensorBoard itself.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "../scratch.hpp"
#include "actors/controller/tensorboard.hpp"

using namespace kiln::controller::tensorboard;
namespace fs = std::filesystem;

namespace {
std::string hex(std::string_view bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (char c : bytes) {
    out += d[(static_cast<unsigned char>(c) >> 4) & 15];
    out += d[static_cast<unsigned char>(c) & 15];
  }
  return out;
}

std::vector<int64_t> steps_in(const fs::path& file) {
  std::vector<int64_t> steps;
  for (const auto& r : read_records(file).data) steps.push_back(event_step(r).value());
  return steps;
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}
}  // namespace

TEST_CASE("tensorboard: CRC32C matches RFC 3720's vectors and TFRecord's mask matches tensorboard's") {
  CHECK(crc32c("123456789") == 0xE3069283u);
  CHECK(crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  CHECK(crc32c(std::string(32, '\xff')) == 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending += char(i);
  CHECK(crc32c(ascending) == 0x46DD794Eu);
  CHECK(crc32c("") == 0u);
  CHECK(masked_crc32c("123456789") == 0xc78ab0e5u);  // tensorboard's masked_crc32c
}

TEST_CASE("tensorboard: records and events are byte for byte what the tensorboard package writes") {
  // RecordWriter(io.BytesIO()).write(b"hello") and write(b"")
  CHECK(hex(frame_record("hello")) == "0500000000000000eab2043e68656c6c6fbb1f1c19");
  CHECK(hex(frame_record("")) == "000000000000000029039807d8ea82a2");
  // event_pb2.Event(wall_time=1.5, file_version="brain.Event:2").SerializeToString()
  CHECK(hex(file_version_event(1.5)) == "09000000000000f83f1a0d627261696e2e4576656e743a32");
  // Event(wall_time=1764526000.25, step=3, summary=Summary(value=[Value(tag="reward_mean",
  // simple_value=0.25), Value(tag="staleness_histogram/0", simple_value=1024)]))
  CHECK(hex(scalars_event(1764526000.25, 3, {{"reward_mean", 0.25f}, {"staleness_histogram/0", 1024.0f}})) ==
        "09000010ec214bda4110032a320a120a0b7265776172645f6d65616e150000803e0a1c0a157374616c656e6573735f68697374"
        "6f6772616d2f301500008044");
  CHECK(event_step(scalars_event(2.0, 300, {})) == 300);  // a two-byte varint
  CHECK(event_step(file_version_event(1.5)) == 0);
  CHECK_FALSE(event_step("\x0a\x7f").has_value());  // a length past the end
  CHECK_FALSE(event_step("\x0b").has_value());      // wire type 3 (groups): never written
}

TEST_CASE("tensorboard: reading stops at a record cut short or corrupted and keeps the ones before") {
  const fs::path file = kiln::test::scratch_path("records.tfevents");
  const std::string a = frame_record("first"), b = frame_record("second");
  std::ofstream(file, std::ios::binary) << a << b;
  auto r = read_records(file);
  CHECK(r.intact);
  CHECK(r.data == std::vector<std::string>{"first", "second"});
  std::ofstream(file, std::ios::binary) << a << b.substr(0, b.size() - 1);
  r = read_records(file);
  CHECK_FALSE(r.intact);
  CHECK(r.data == std::vector<std::string>{"first"});
  std::string bad = b;
  bad[14] ^= 1;  // a data byte: its CRC no longer matches
  std::ofstream(file, std::ios::binary) << a << bad;
  r = read_records(file);
  CHECK_FALSE(r.intact);
  CHECK(r.data.size() == 1);
  // A length near 2^64 whose own CRC matches (so only the bounds check stands in the way).
  std::string huge(8, '\xff');
  huge[0] = '\xfc';
  const uint32_t crc = masked_crc32c(huge);
  for (int i = 0; i < 4; ++i) huge += char((crc >> (8 * i)) & 0xff);
  std::ofstream(file, std::ios::binary) << a << huge << "data";
  r = read_records(file);
  CHECK_FALSE(r.intact);
  CHECK(r.data == std::vector<std::string>{"first"});
  CHECK_THROWS_WITH_AS(read_records(file.string() + ".none"), doctest::Contains(".none"), std::runtime_error);
}

TEST_CASE("tensorboard: every number of a metrics row becomes a scalar and step and text do not") {
  nlohmann::json row = {{"step", 4},         {"reward_mean", 0.5},   {"trained_samples", 12},
                        {"skipped_nonfinite", true}, {"skip_reason", "loss is nan"}, {"grad_norm", nullptr},
                        {"staleness_histogram", {{"0", 30}, {"1", 2}}}};
  const std::vector<std::pair<std::string, float>> expected{
      {"reward_mean", 0.5f}, {"skipped_nonfinite", 1.0f}, {"staleness_histogram/0", 30.0f},
      {"staleness_histogram/1", 2.0f}, {"trained_samples", 12.0f}};
  CHECK(scalars_of(row) == expected);
}

TEST_CASE("tensorboard: a resumed writer drops the steps it trains again and its file sorts after the first") {
  const fs::path dir = kiln::test::scratch_path("tb_run");
  fs::path first;
  {
    EventWriter w(dir, 1);
    first = w.path();
    CHECK(first.filename().string().starts_with("events.out.tfevents."));
    for (int64_t s = 1; s <= 4; ++s) w.write({{"step", s}, {"reward_mean", 0.1 * double(s)}}, 100.0 + double(s));
  }
  CHECK(steps_in(first) == std::vector<int64_t>{0, 1, 2, 3, 4});  // file_version, then the steps
  {
    EventWriter w(dir, 3);  // resumed from step 2's checkpoint
    CHECK(w.path() != first);
    w.write({{"step", 3}, {"reward_mean", 0.7}}, 200.0);
  }
  auto files = event_files(dir);
  REQUIRE(files.size() == 2);
  CHECK(files[0] == first);  // TensorBoard reads in name order: the earlier steps first
  CHECK(steps_in(files[0]) == std::vector<int64_t>{0, 1, 2});
  CHECK(steps_in(files[1]) == std::vector<int64_t>{0, 3});
  {
    EventWriter w(dir, 1);  // a run over it from step 1 (run.overwrite): the old scalars go
    w.write({{"step", 1}, {"reward_mean", 0.0}}, 300.0);
  }
  files = event_files(dir);
  REQUIRE(files.size() == 1);
  CHECK(steps_in(files[0]) == std::vector<int64_t>{0, 1});
}
