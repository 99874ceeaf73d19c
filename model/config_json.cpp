#include "model/config_json.hpp"

#include <cassert>
#include <cmath>
#include <stdexcept>

namespace kiln::model::config_json {

using nlohmann::json;

std::string IntRange::str() const {
  // Appended piece by piece: "[" + std::to_string(...) trips GCC 12's -Wrestrict false positive.
  std::string s = "[";
  s += std::to_string(lo);
  s += ", ";
  s += std::to_string(hi);
  s += "]";
  return s;
}

IntRange range_of(const IntRanges& ranges, const std::string& field) {
  auto it = ranges.find(field);
  assert(it != ranges.end() && "every integer field read or validated has a range in its package's table");
  return it->second;
}

bool shallow(const json& v, int levels) {
  if (!v.is_structured()) return true;
  if (levels == 0) return false;
  for (const auto& x : v)
    if (!shallow(x, levels - 1)) return false;
  return true;
}

std::string show(const json& v) {
  // dump() recurses once per level: a config.json of a million '[' would overflow the stack.
  if (!shallow(v, 4)) return v.is_array() ? "a deeply nested array" : "a deeply nested object";
  std::string s = v.dump();
  if (s.size() <= 120) return s;
  std::size_t cut = 100;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 character
  return s.substr(0, cut) + "... (" + std::to_string(s.size()) + " bytes)";
}

void FieldReader::bad(const std::string& field, const std::string& why) const {
  throw std::invalid_argument("config.json (" + source + "): field '" + prefix + field + "': " + why);
}

void FieldReader::missing(const char* f) const { bad(f, "missing (required: " + missing_why + ")"); }

int64_t FieldReader::integer(const char* f, std::optional<int64_t> fallback) const {
  if (!has(f)) {
    if (fallback) return *fallback;
    missing(f);
  }
  return integer_value(f, j[f]);
}

int64_t FieldReader::integer_value(const std::string& f, const json& v) const {
  if (!v.is_number_integer()) bad(f, "must be an integer, got " + show(v));
  const auto r = range_of(ranges, f);
  const bool inside = v.is_number_unsigned()
                          ? v.get<uint64_t>() >= uint64_t(r.lo) && v.get<uint64_t>() <= uint64_t(r.hi)
                          : v.get<int64_t>() >= r.lo && v.get<int64_t>() <= r.hi;
  if (!inside) bad(f, show(v) + " is outside " + r.str());
  return v.get<int64_t>();
}

double FieldReader::number(const char* f, std::optional<double> fallback) const {
  if (!has(f)) {
    if (fallback) return *fallback;
    missing(f);
  }
  if (!j[f].is_number()) bad(f, "must be a number, got " + show(j[f]));
  const double v = j[f].get<double>();
  if (!std::isfinite(v)) bad(f, "must be a finite number, got " + std::to_string(v));
  return v;
}

bool FieldReader::boolean(const char* f, bool fallback) const {
  if (!has(f)) return fallback;
  if (!j[f].is_boolean()) bad(f, "must be true or false, got " + show(j[f]));
  return j[f].get<bool>();
}

std::string FieldReader::string(const char* f, const std::string& fallback) const {
  if (!has(f)) return fallback;
  if (!j[f].is_string()) bad(f, "must be a string, got " + show(j[f]));
  return j[f].get<std::string>();
}

}  // namespace kiln::model::config_json
