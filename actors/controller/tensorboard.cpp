#include "actors/controller/tensorboard.hpp"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace kiln::controller::tensorboard {

namespace fs = std::filesystem;

namespace {
constexpr std::string_view kPrefix = "events.out.tfevents.";

std::array<uint32_t, 256> crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += char((v >> (8 * i)) & 0xff);
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// Protobuf wire format: varints, keys (field << 3 | wire type), length-delimited fields.
void varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += char((v & 0x7f) | 0x80);
  out += char(v);
}
void key(std::string& out, int field, int wire_type) { varint(out, uint64_t(field << 3 | wire_type)); }
void bytes_field(std::string& out, int field, std::string_view data) {
  key(out, field, 2);
  varint(out, data.size());
  out += data;
}
void double_field(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  key(out, field, 1);
  put_le(out, bits, 8);
}

int64_t file_time(const fs::path& file) {  // the <time> of events.out.tfevents.<time>.<host>...
  const auto name = file.filename().string();
  try {
    return std::stoll(name.substr(kPrefix.size()));
  } catch (const std::exception&) {
    return 0;
  }
}

// Rewrites `file` without the events of steps >= first_step; removes it when nothing but its
// file_version event is left.
void drop_steps_from(const fs::path& file, int64_t first_step) {
  const auto records = read_records(file);
  std::vector<std::string> keep;
  for (const auto& r : records.data)
    if (auto step = event_step(r); step && *step < first_step) keep.push_back(r);
  if (keep.size() <= 1) {
    fs::remove(file);
    return;
  }
  if (keep.size() == records.data.size() && records.intact) return;
  const auto tmp = fs::path(file.string() + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    for (const auto& r : keep) out << frame_record(r);
    if (!out.flush()) throw std::runtime_error("cannot write '" + tmp.string() + "'");
  }
  fs::rename(tmp, file);
}
}  // namespace

uint32_t crc32c(std::string_view data) {
  static const auto table = crc_table();
  uint32_t c = 0xFFFFFFFFu;
  for (char ch : data) c = table[(c ^ static_cast<unsigned char>(ch)) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string frame_record(std::string_view data) {
  std::string out;
  put_le(out, data.size(), 8);
  put_le(out, masked_crc32c(out), 4);
  out += data;
  put_le(out, masked_crc32c(data), 4);
  return out;
}

Records read_records(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open '" + file.string() + "'");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Records r;
  std::size_t at = 0;
  while (at < bytes.size()) {
    if (bytes.size() - at < 12 || uint32_t(get_le(&bytes[at + 8], 4)) != masked_crc32c({&bytes[at], 8})) {
      r.intact = false;
      break;
    }
    const uint64_t n = get_le(&bytes[at], 8), left = bytes.size() - at - 12;
    if (n > left || left - n < 4 ||  // (n + 4 could wrap)
        uint32_t(get_le(&bytes[at + 12 + n], 4)) != masked_crc32c({&bytes[at + 12], std::size_t(n)})) {
      r.intact = false;
      break;
    }
    r.data.emplace_back(bytes.substr(at + 12, n));
    at += 12 + n + 4;
  }
  return r;
}

std::string file_version_event(double wall_time) {
  std::string e;
  double_field(e, 1, wall_time);
  bytes_field(e, 3, "brain.Event:2");
  return e;
}

std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    bytes_field(value, 1, tag);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    key(value, 2, 5);
    put_le(value, bits, 4);
    bytes_field(summary, 1, value);
  }
  std::string e;
  double_field(e, 1, wall_time);
  key(e, 2, 0);
  varint(e, uint64_t(step));
  bytes_field(e, 5, summary);
  return e;
}

std::optional<int64_t> event_step(std::string_view event) {
  int64_t step = 0;
  std::size_t at = 0;
  auto read_varint = [&](uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at >= event.size()) return false;
      const auto b = static_cast<unsigned char>(event[at++]);
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  while (at < event.size()) {
    uint64_t k, v;
    if (!read_varint(k)) return std::nullopt;
    switch (k & 7) {
      case 0:
        if (!read_varint(v)) return std::nullopt;
        if (k >> 3 == 2) step = int64_t(v);
        break;
      case 1: at += 8; break;
      case 5: at += 4; break;
      case 2:
        if (!read_varint(v) || v > event.size() - std::min(at, event.size())) return std::nullopt;
        at += v;
        break;
      default: return std::nullopt;
    }
    if (at > event.size()) return std::nullopt;
  }
  return step;
}

std::vector<std::pair<std::string, float>> scalars_of(const nlohmann::json& row) {
  std::vector<std::pair<std::string, float>> out;
  auto add = [&](const std::string& tag, const nlohmann::json& v) {
    if (v.is_boolean()) out.emplace_back(tag, v.get<bool>() ? 1.0f : 0.0f);
    else if (v.is_number() && std::isfinite(v.get<double>())) out.emplace_back(tag, float(v.get<double>()));
  };
  for (const auto& [k, v] : row.items()) {
    if (k == "step") continue;
    if (v.is_object())
      for (const auto& [inner, w] : v.items()) add(k + "/" + inner, w);
    else
      add(k, v);
  }
  return out;
}

EventWriter::EventWriter(const fs::path& dir, int64_t first_step) {
  fs::create_directories(dir);
  std::vector<fs::path> files;  // listed first: dropping steps rewrites and removes files
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (entry.is_regular_file() && name.starts_with(kPrefix) && !name.ends_with(".tmp")) files.push_back(entry.path());
  }
  int64_t newest = 0;
  for (const auto& f : files) {
    newest = std::max(newest, file_time(f));
    drop_steps_from(f, first_step);
  }
  const auto now = std::chrono::system_clock::now();
  const int64_t seconds = std::chrono::duration_cast<std::chrono::seconds>(now.time_since_epoch()).count();
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  char name[512];
  std::snprintf(name, sizeof name, "%s%010lld.%s.%d", std::string(kPrefix).c_str(),
                (long long)std::max(seconds, newest + 1), host, int(::getpid()));
  path_ = dir / name;
  out_.open(path_, std::ios::binary | std::ios::trunc);
  out_ << frame_record(file_version_event(std::chrono::duration<double>(now.time_since_epoch()).count()));
  if (!out_.flush()) throw std::runtime_error("cannot write '" + path_.string() + "'");
}

void EventWriter::write(const nlohmann::json& row, double wall_time) {
  out_ << frame_record(scalars_event(wall_time, row.at("step").get<int64_t>(), scalars_of(row))) << std::flush;
  if (!out_) throw std::runtime_error("writing '" + path_.string() + "' failed (disk full, or a file-size limit?)");
}

}  // namespace kiln::controller::tensorboard
