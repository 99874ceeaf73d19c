#include "model/checkpoint/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

namespace kiln::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {
[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw CheckpointError("checkpoint file '" + file + "': " + what);
}

uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | uint64_t(p[i]);
  return v;
}

std::string header_json(const std::vector<Tensor>& tensors, const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& t : tensors) {
    h[t.name] = {{"dtype", std::string(messaging::dtype_name(t.dtype))},
                 {"shape", t.shape},
                 {"data_offsets", {off, off + t.nbytes}}};
    off += t.nbytes;
  }
  std::string s = h.dump();
  s.append((8 - s.size() % 8) % 8, ' ');  // pad so that the data starts 8-byte aligned
  return s;
}

// Whether `p` exists. A path the file system cannot look up (a name longer than NAME_MAX, no
// permission) is a CheckpointError naming it: std::filesystem::exists would throw its own
// filesystem_error, which callers of this reader do not expect.
bool exists(const fs::path& p, const std::string& what) {
  std::error_code ec;
  const bool yes = fs::exists(p, ec);
  if (ec) throw CheckpointError(what + " '" + p.string() + "' cannot be looked up: " + ec.message());
  return yes;
}

std::string describe(const std::string& name, const TensorInfo& i) {
  return "'" + name + "' (data_offsets [" + std::to_string(i.begin) + ", " + std::to_string(i.end) + "])";
}

// The format's rule (the reference implementation's Metadata::validate): sorted by offset, the
// tensors tile the data section exactly: the first begins at 0, each begins where the one
// before ends, the last ends at the end of the file. A header length one byte off, a shifted
// or stale offset, or trailing bytes would otherwise load every tensor from the wrong bytes.
void check_coverage(const std::string& path, const std::map<std::string, TensorInfo>& infos, uint64_t data_size) {
  std::vector<std::pair<std::string, TensorInfo>> order(infos.begin(), infos.end());
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second.begin, a.second.end) < std::tie(b.second.begin, b.second.end);
  });
  uint64_t covered = 0;  // data bytes [0, covered) belong to the tensors before this one
  std::string prev = "the start of the data section";
  for (const auto& [name, info] : order) {
    if (info.begin < covered) fail(path, "tensors " + prev + " and " + describe(name, info) + " overlap");
    if (info.begin > covered)
      fail(path, "tensor " + describe(name, info) + " leaves data bytes [" + std::to_string(covered) + ", " +
                     std::to_string(info.begin) + ") unused after " + prev +
                     ": the tensors must cover the data section exactly");
    covered = info.end;
    prev = describe(name, info);
  }
  if (covered != data_size)
    fail(path, (order.empty() ? std::string("the header lists no tensors") : "the last tensor " + prev + " ends at data byte " +
                                                                                 std::to_string(covered)) +
                   ", but the data section is " + std::to_string(data_size) +
                   " bytes (a wrong header length, or bytes appended): the tensors must cover it exactly");
}
}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  // O_NONBLOCK: a FIFO under a shard's name must not block the open forever.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path, "cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "is not a regular file");
  }
  const uint64_t size = uint64_t(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(path, "truncated: " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) fail(path, "mmap failed");
  SafetensorsFile f;
  f.path_ = path;
  f.mapping_ = std::shared_ptr<const void>(map, [size](const void* p) { ::munmap(const_cast<void*>(p), size); });
  const auto* base = static_cast<const std::byte*>(map);
  const uint64_t n = read_le64(base);
  if (n > kMaxHeaderBytes) fail(path, "header length " + std::to_string(n) + " exceeds the limit " + std::to_string(kMaxHeaderBytes));
  if (n > size - 8)
    fail(path, "truncated: header length " + std::to_string(n) + " but only " + std::to_string(size - 8) +
                   " bytes follow");
  json h;
  try {
    h = json::parse(reinterpret_cast<const char*>(base + 8), reinterpret_cast<const char*>(base + 8 + n));
  } catch (const std::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!h.is_object()) fail(path, "header is not a JSON object");
  f.data_ = base + 8 + n;
  const uint64_t data_size = size - 8 - n;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) fail(path, "__metadata__ is not an object");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string()) fail(path, "__metadata__['" + m.key() + "'] is not a string");
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      fail(path, where + " needs dtype, shape and data_offsets");
    if (!e["dtype"].is_string()) fail(path, where + ": dtype is not a string");
    auto dt = messaging::dtype_from_name(e["dtype"].get<std::string>());
    if (!dt) fail(path, where + ": unsupported dtype '" + e["dtype"].get<std::string>() + "'");
    TensorInfo info{*dt, {}, 0, 0};
    if (!e["shape"].is_array()) fail(path, where + ": shape is not an array");
    uint64_t bytes = messaging::item_size(*dt);
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail(path, where + ": shape has a negative or non-integer dim");
      int64_t v = d.get<int64_t>();
      if (__builtin_mul_overflow(bytes, uint64_t(v), &bytes)) fail(path, where + ": shape overflows");
      info.shape.push_back(v);
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(path, where + ": data_offsets must be two unsigned integers");
    info.begin = off[0].get<uint64_t>();
    info.end = off[1].get<uint64_t>();
    if (info.end < info.begin) fail(path, where + ": data_offsets end before they begin");
    if (info.end > data_size)
      fail(path, where + ": data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
                     ") point past the end of the data (" + std::to_string(data_size) + " bytes; file truncated?)");
    if (info.end - info.begin != bytes)
      fail(path, where + ": " + std::to_string(info.end - info.begin) + " bytes for dtype " +
                     e["dtype"].get<std::string>() + " and its shape, which need " + std::to_string(bytes));
    f.infos_.emplace(name, std::move(info));
  }
  check_coverage(path, f.infos_, data_size);
  return f;
}

Tensor SafetensorsFile::get(const std::string& name) const {
  auto it = infos_.find(name);
  if (it == infos_.end()) fail(path_, "has no tensor '" + name + "'");
  const TensorInfo& i = it->second;
  Tensor t;
  t.name = name;
  t.dtype = i.dtype;
  t.shape = i.shape;
  t.data = data_ + i.begin;
  t.nbytes = i.end - i.begin;
  t.owner = mapping_;
  return t;
}

void write_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const auto& t : tensors)
    if (!names.insert(t.name).second) throw CheckpointError("writing '" + path + "': duplicate tensor name '" + t.name + "'");
  std::string header = header_json(tensors, metadata);
  // Written beside as PATH.partial and renamed over PATH once whole: a write that fails (disk
  // full, a file-size limit) leaves no truncated file under the final name.
  const std::string partial = partial_path(path);
  std::ofstream out(partial, std::ios::binary | std::ios::trunc);
  if (!out) throw CheckpointError("writing '" + path + "': cannot create '" + partial + "'");
  uint64_t n = header.size();
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = char((n >> (8 * i)) & 0xff);
  out.write(len, 8);
  out.write(header.data(), std::streamsize(header.size()));
  for (const auto& t : tensors) out.write(reinterpret_cast<const char*>(t.data), std::streamsize(t.nbytes));
  out.close();
  std::error_code ec;
  if (!out) {
    fs::remove(partial, ec);
    throw CheckpointError("writing '" + path + "': write failed (disk full, or a file-size limit?)");
  }
  fs::rename(partial, path, ec);
  if (ec) {
    const auto why = ec.message();
    fs::remove(partial, ec);
    throw CheckpointError("writing '" + path + "': cannot rename '" + partial + "' over it: " + why);
  }
}

Checkpoint Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  fs::path single = fs::path(dir) / "model.safetensors";
  if (exists(index, "checkpoint index")) {
    std::ifstream in(index);
    json j;
    try {
      j = json::parse(in);
    } catch (const std::exception& e) {
      throw CheckpointError("checkpoint index '" + index.string() + "' is not valid JSON: " + e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw CheckpointError("checkpoint index '" + index.string() + "' has no weight_map object");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw CheckpointError("checkpoint index '" + index.string() + "': weight_map['" + it.key() + "'] is not a file name");
      auto file = it.value().get<std::string>();
      // Shards live in the checkpoint directory: a path elsewhere is refused, never opened.
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        throw CheckpointError("checkpoint index '" + index.string() + "': weight_map['" + it.key() + "'] names '" + file +
                              "', not a file in the checkpoint directory");
      c.weight_map_[it.key()] = file;
    }
  } else if (exists(single, "checkpoint file")) {
    auto f = std::make_shared<SafetensorsFile>(SafetensorsFile::open(single.string()));
    for (const auto& [name, info] : f->tensors()) c.weight_map_[name] = "model.safetensors";
    c.shards_["model.safetensors"] = f;
  } else {
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      throw CheckpointError("checkpoint directory '" + dir + "' does not exist" + (ec ? " (" + ec.message() + ")" : ""));
    throw CheckpointError("no checkpoint in '" + dir + "': neither model.safetensors.index.json nor model.safetensors");
  }
  return c;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> n;
  for (const auto& [name, file] : weight_map_) n.push_back(name);
  return n;
}

SafetensorsFile& Checkpoint::shard(const std::string& file) {
  auto it = shards_.find(file);
  if (it != shards_.end()) return *it->second;
  fs::path p = fs::path(dir_) / file;
  if (!exists(p, "checkpoint shard")) throw CheckpointError("checkpoint shard '" + p.string() + "' named by the index is missing");
  auto f = std::make_shared<SafetensorsFile>(SafetensorsFile::open(p.string()));
  return *shards_.emplace(file, f).first->second;
}

TensorInfo Checkpoint::info(const std::string& name) {
  auto it = weight_map_.find(name);
  if (it == weight_map_.end()) throw CheckpointError("checkpoint '" + dir_ + "' has no tensor '" + name + "'");
  auto& f = shard(it->second);
  if (!f.contains(name))
    throw CheckpointError("checkpoint index of '" + dir_ + "' puts '" + name + "' in " + it->second + ", which does not hold it");
  return f.tensors().at(name);
}

Tensor Checkpoint::get(const std::string& name) {
  info(name);
  return shard(weight_map_.at(name)).get(name);
}

std::vector<std::pair<std::string, std::string>> Checkpoint::unindexed() {
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map_) files.insert(file);
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& file : files)
    for (const auto& [name, info] : shard(file).tensors())
      if (!weight_map_.count(name)) out.emplace_back(name, file);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> Checkpoint::opened_files() const {
  std::vector<std::string> f;
  for (const auto& [file, s] : shards_) f.push_back(file);
  return f;
}

void write_checkpoint(const std::string& dir, const std::vector<Tensor>& tensors, uint64_t max_shard_bytes) {
  fs::create_directories(dir);
  // Shards of an earlier save would sit beside the new ones under other names: remove them, and
  // the partial shards of a save that was killed (write_safetensors' PATH.partial).
  const std::string partial = partial_path(".safetensors");
  for (const auto& e : fs::directory_iterator(dir)) {
    auto name = e.path().filename().string();
    const bool left_partial = name.rfind("model", 0) == 0 && name.size() > partial.size() &&
                              name.compare(name.size() - partial.size(), partial.size(), partial) == 0;
    if (name == "model.safetensors" || name == "model.safetensors.index.json" || left_partial ||
        (name.rfind("model-", 0) == 0 && e.path().extension() == ".safetensors"))
      fs::remove(e.path());
  }
  std::vector<std::vector<Tensor>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const auto& t : tensors) {
    if (!shards.back().empty() && in_shard + t.nbytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(t);
    in_shard += t.nbytes;
    total += t.nbytes;
  }
  json index;
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = json::object();
  char name[64];
  for (std::size_t i = 0; i < shards.size(); ++i) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    write_safetensors((fs::path(dir) / name).string(), shards[i]);
    for (const auto& t : shards[i]) index["weight_map"][t.name] = name;
  }
  std::ofstream out(fs::path(dir) / "model.safetensors.index.json");
  out << index.dump(2) << "\n";
  out.close();  // checked after the flush: a full disk shows there
  if (!out) throw CheckpointError("writing the index in '" + dir + "' failed (disk full, or a file-size limit?)");
}

}  // namespace kiln::checkpoint
