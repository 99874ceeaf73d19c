// safetensors reader/writer and sharded checkpoints (torch-free; also run under ASan+UBSan).
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "../scratch.hpp"
#include "model/checkpoint/safetensors.hpp"

using namespace kiln::checkpoint;
namespace fs = std::filesystem;

namespace {
std::string scratch(const std::string& name) {
  fs::path p = kiln::test::scratch_path("ckpt-" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

Tensor filled(const std::string& name, DType dt, std::vector<int64_t> shape, uint8_t seed) {
  auto t = Tensor::zeros(name, dt, std::move(shape));
  for (std::size_t i = 0; i < t.nbytes; ++i) t.mutable_data()[i] = std::byte(uint8_t(seed + i * 7));
  return t;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}
// A file with a hand-written header and `data_bytes` bytes of data.
std::string file_with_header(const std::string& dir, const std::string& header, std::size_t data_bytes) {
  std::string s(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s[i] = char((n >> (8 * i)) & 0xff);
  s += header;
  s += std::string(data_bytes, '\x01');
  auto path = dir + "/hand.safetensors";
  write_all(path, s);
  return path;
}
void check_open_fails(const std::string& path, const std::string& needle) {
  try {
    SafetensorsFile::open(path);
    FAIL("expected CheckpointError containing: " << needle);
  } catch (const CheckpointError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
    CHECK(std::string(e.what()).find(path) != std::string::npos);  // names the file
  }
}
}  // namespace

TEST_CASE("safetensors round-trips every dtype, empty and scalar tensors, and metadata") {
  auto dir = scratch("rt");
  std::vector<Tensor> ts;
  uint8_t seed = 1;
  for (auto dt : kiln::messaging::kAllDTypes) ts.push_back(filled(std::string(dtype_name(dt)), dt, {3, 5}, seed++));
  ts.push_back(filled("empty", DType::bfloat16, {0, 4}, 0));
  ts.push_back(filled("scalar", DType::float32, {}, 9));
  write_safetensors(dir + "/a.safetensors", ts, {{"format", "pt"}, {"who", "kiln"}});
  auto f = SafetensorsFile::open(dir + "/a.safetensors");
  CHECK(f.metadata().at("who") == "kiln");
  REQUIRE(f.tensors().size() == ts.size());
  for (const auto& t : ts) {
    CAPTURE(t.name);
    auto g = f.get(t.name);
    CHECK(g.dtype == t.dtype);
    CHECK(g.shape == t.shape);
    REQUIRE(g.nbytes == t.nbytes);
    CHECK(std::memcmp(g.data, t.data, t.nbytes) == 0);
  }
  CHECK_THROWS_AS(f.get("nope"), CheckpointError);
}

TEST_CASE("bad safetensors files give errors naming the file and the fault") {
  auto dir = scratch("bad");
  SUBCASE("truncated file") {
    write_safetensors(dir + "/t.safetensors", {filled("w", DType::float32, {64}, 3)});
    auto bytes = read_all(dir + "/t.safetensors");
    write_all(dir + "/t.safetensors", bytes.substr(0, bytes.size() - 10));
    check_open_fails(dir + "/t.safetensors", "point past the end");
  }
  SUBCASE("shorter than the length prefix") {
    write_all(dir + "/s.safetensors", "abc");
    check_open_fails(dir + "/s.safetensors", "too short");
  }
  SUBCASE("header length beyond the file") {
    std::string s(8, '\0');
    s[0] = char(0xff);
    s[1] = char(0xff);
    write_all(dir + "/h.safetensors", s + "{}");
    check_open_fails(dir + "/h.safetensors", "only 2 bytes follow");
  }
  SUBCASE("header pointing past the end") {
    auto p = file_with_header(dir, R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
    check_open_fails(p, "point past the end");
  }
  SUBCASE("overlapping tensors, both named with their offsets") {
    auto p = file_with_header(
        dir, R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16);
    check_open_fails(p, "tensors 'a' (data_offsets [0, 16]) and 'b' (data_offsets [8, 16]) overlap");
  }
  SUBCASE("byte length that does not fit dtype and shape") {
    auto p = file_with_header(dir, R"({"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,4]}})", 4);
    check_open_fails(p, "which need 8");
  }
  SUBCASE("unknown dtype") {
    auto p = file_with_header(dir, R"({"w":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", 8);
    check_open_fails(p, "unsupported dtype 'C64'");
  }
  SUBCASE("negative dimension") {
    auto p = file_with_header(dir, R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4);
    check_open_fails(p, "negative");
  }
  SUBCASE("header that is not JSON") {
    auto p = file_with_header(dir, "{not json", 0);
    check_open_fails(p, "not valid JSON");
  }
}

TEST_CASE("a header length one byte short is refused, not loaded with every tensor shifted by a byte") {
  auto dir = scratch("short-length");
  // Padded header, as writers pad to 8 bytes: without its last space it is still valid JSON.
  auto p = file_with_header(dir, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}  )", 16);
  auto bytes = read_all(p);
  bytes[0] = char(uint8_t(bytes[0]) - 1);
  write_all(p, bytes);
  check_open_fails(p, "the last tensor 'b' (data_offsets [8, 16]) ends at data byte 16, but the data section is 17 bytes");
}

TEST_CASE("the tensors must cover the data section exactly: gaps, overlaps, a late start and trailing bytes are named") {
  auto dir = scratch("coverage");
  SUBCASE("a gap between two tensors") {
    auto p = file_with_header(
        dir, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16);
    check_open_fails(p, "tensor 'b' (data_offsets [12, 16]) leaves data bytes [8, 12) unused after 'a' (data_offsets [0, 8])");
  }
  SUBCASE("the first tensor does not start at 0") {
    auto p = file_with_header(dir, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8);
    check_open_fails(p, "tensor 'a' (data_offsets [4, 8]) leaves data bytes [0, 4) unused after the start of the data section");
  }
  SUBCASE("two tensors at the same offsets") {
    auto p = file_with_header(
        dir, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
    check_open_fails(p, "overlap");
  }
  SUBCASE("bytes after the last tensor") {
    auto p = file_with_header(dir, R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 20);
    check_open_fails(p, "the last tensor 'a' (data_offsets [0, 16]) ends at data byte 16, but the data section is 20 bytes");
  }
  SUBCASE("data but no tensors") {
    auto p = file_with_header(dir, R"({"__metadata__":{"format":"pt"}})", 4);
    check_open_fails(p, "the header lists no tensors, but the data section is 4 bytes");
  }
}

TEST_CASE("empty tensors may sit anywhere in the data section, and an empty file of tensors opens") {
  auto dir = scratch("coverage-ok");
  auto p = file_with_header(dir,
                            R"({"z0":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                            R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                            R"("z1":{"dtype":"BF16","shape":[3,0],"data_offsets":[8,8]},)"
                            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                            R"("z2":{"dtype":"I64","shape":[0],"data_offsets":[16,16]}})",
                            16);
  CHECK(SafetensorsFile::open(p).tensors().size() == 5);
  auto empty = file_with_header(dir, "{}", 0);
  CHECK(SafetensorsFile::open(empty).tensors().empty());
}

TEST_CASE("sharded checkpoints: index, lazy shards, missing shard named") {
  auto dir = scratch("sharded");
  std::vector<Tensor> ts;
  for (int i = 0; i < 6; ++i) ts.push_back(filled("w" + std::to_string(i), DType::float32, {256}, uint8_t(i)));
  write_checkpoint(dir, ts, 2048);  // 1 KiB each: 2 per shard -> 3 shards
  CHECK(fs::exists(dir + "/model-00003-of-00003.safetensors"));
  auto c = Checkpoint::open(dir);
  CHECK(c.names().size() == 6);
  CHECK(c.opened_files().empty());  // nothing read before it is asked for
  auto w4 = c.get("w4");
  CHECK(std::memcmp(w4.data, ts[4].data, ts[4].nbytes) == 0);
  CHECK(c.opened_files() == std::vector<std::string>{"model-00003-of-00003.safetensors"});
  fs::remove(dir + "/model-00001-of-00003.safetensors");
  try {
    c.get("w0");
    FAIL("missing shard not reported");
  } catch (const CheckpointError& e) {
    CHECK(std::string(e.what()).find("model-00001-of-00003.safetensors") != std::string::npos);
    CHECK(std::string(e.what()).find("missing") != std::string::npos);
  }
  CHECK_THROWS_WITH_AS(Checkpoint::open(scratch("empty")), doctest::Contains("no checkpoint in"), CheckpointError);
}

TEST_CASE("the reader survives 5000 mutated headers without a crash") {
  auto dir = scratch("fuzz");
  write_safetensors(dir + "/seed.safetensors",
                    {filled("a", DType::float32, {8}, 1), filled("b", DType::bfloat16, {2, 3}, 2),
                     filled("c", DType::int64, {1}, 3)});
  const auto seed = read_all(dir + "/seed.safetensors");
  std::mt19937_64 rng(42);
  int opened = 0, rejected = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string s = seed;
    switch (rng() % 4) {
      case 0:  // flip bytes anywhere in length prefix and header
        for (int k = 0, n = 1 + rng() % 6; k < n; ++k) s[rng() % std::min<std::size_t>(s.size(), 200)] = char(rng());
        break;
      case 1:  // digits in the header changed (offsets, dims)
        for (std::size_t k = 8; k < 200 && k < s.size(); ++k)
          if (std::isdigit(static_cast<unsigned char>(s[k])) && rng() % 4 == 0) s[k] = char('0' + rng() % 10);
        break;
      case 2:  // truncated
        s.resize(rng() % s.size());
        break;
      case 3:  // interesting header lengths
      {
        uint64_t n = std::vector<uint64_t>{0, 1, 7, uint64_t(-1), uint64_t(1) << 40, s.size()}[rng() % 6];
        for (int b = 0; b < 8; ++b) s[b] = char((n >> (8 * b)) & 0xff);
        break;
      }
    }
    write_all(dir + "/m.safetensors", s);
    try {
      auto f = SafetensorsFile::open(dir + "/m.safetensors");
      for (const auto& [name, info] : f.tensors()) {
        auto t = f.get(name);  // every accepted tensor lies inside the file
        volatile std::byte sink{};
        for (std::size_t k = 0; k < t.nbytes; ++k) sink = t.data[k];
        (void)sink;
      }
      ++opened;
    } catch (const CheckpointError&) {
      ++rejected;
    }
  }
  MESSAGE("opened " << opened << ", rejected " << rejected);
  CHECK(opened + rejected == 5000);
  CHECK(rejected > 1000);
}

TEST_CASE("an index naming a file outside the checkpoint is refused, never opened") {
  auto dir = scratch("escape");
  write_safetensors(dir + "/model-00001-of-00001.safetensors", {filled("w", DType::float32, {4}, 1)});
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"w": "../../../../etc/passwd"}})";
  CHECK_THROWS_WITH_AS(Checkpoint::open(dir), doctest::Contains("not a file in the checkpoint directory"), CheckpointError);
  CHECK_THROWS_WITH_AS(Checkpoint::open(dir + "/nope"), doctest::Contains("does not exist"), CheckpointError);
}

TEST_CASE("a shard name the file system cannot look up, or that is not a regular file, is a CheckpointError naming it") {
  auto dir = scratch("odd-shards");
  write_safetensors(dir + "/model-00001-of-00001.safetensors", {filled("w", DType::float32, {4}, 1)});
  SUBCASE("a name longer than NAME_MAX (std::filesystem threw its own filesystem_error)") {
    const std::string name(300, 'x');
    std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": {"w": ")" + name + R"("}})";
    auto c = Checkpoint::open(dir);
    CHECK_THROWS_WITH_AS(c.get("w"), doctest::Contains("cannot be looked up: File name too long"), CheckpointError);
  }
  SUBCASE("a FIFO is refused without blocking, a directory without mapping it") {
    REQUIRE(::mkfifo((dir + "/fifo").c_str(), 0600) == 0);
    fs::create_directories(dir + "/sub");
    std::ofstream(dir + "/model.safetensors.index.json") << R"({"weight_map": {"a": "fifo", "b": "sub"}})";
    auto c = Checkpoint::open(dir);
    CHECK_THROWS_WITH_AS(c.get("a"), doctest::Contains("is not a regular file"), CheckpointError);
    CHECK_THROWS_WITH_AS(c.get("b"), doctest::Contains("is not a regular file"), CheckpointError);
  }
}

TEST_CASE("writing a checkpoint replaces the shards of an earlier save") {
  auto dir = scratch("rewrite");
  std::vector<Tensor> ts;
  for (int i = 0; i < 4; ++i) ts.push_back(filled("w" + std::to_string(i), DType::float32, {256}, uint8_t(i)));
  write_checkpoint(dir, ts, 1024);  // 4 shards
  write_checkpoint(dir, ts, 1 << 20);  // 1 shard
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir)) shards += e.path().extension() == ".safetensors";
  CHECK(shards == 1);
  CHECK(Checkpoint::open(dir).names().size() == 4);
}
