#include "actors/weight_sync/buckets.hpp"

#include <optional>
#include <set>
#include <stdexcept>

namespace kiln::weight_sync {

uint64_t Bucket::bytes() const {
  uint64_t b = 0;
  for (const auto& t : tensors) b += t.nbytes;
  return b;
}

namespace {
// The layer index `name` fills into `pattern`'s {} ("" for a pattern without {}), or nullopt
// when the name does not match the pattern.
std::optional<std::string> match(const std::string& pattern, const std::string& name) {
  const auto hole = pattern.find("{}");
  if (hole == std::string::npos) return pattern == name ? std::optional<std::string>("") : std::nullopt;
  const std::string head = pattern.substr(0, hole), tail = pattern.substr(hole + 2);
  if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
    return std::nullopt;
  auto index = name.substr(head.size(), name.size() - head.size() - tail.size());
  if (index.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return index;
}
}  // namespace

std::vector<std::vector<std::size_t>> travel_units(const std::vector<std::string>& names, const TravelGroups& groups) {
  // Group instance ("group number/layer index") of every name that belongs to one.
  std::map<std::string, std::vector<std::size_t>> members;
  std::vector<std::string> instance(names.size());
  for (std::size_t i = 0; i < names.size(); ++i)
    for (std::size_t g = 0; g < groups.size() && instance[i].empty(); ++g)
      for (const auto& pattern : groups[g])
        if (auto index = match(pattern, names[i])) {
          instance[i] = std::to_string(g) + "/" + *index;
          members[instance[i]].push_back(i);
          break;
        }
  std::vector<std::vector<std::size_t>> units;
  std::set<std::size_t> placed;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (placed.count(i)) continue;
    if (instance[i].empty()) {
      units.push_back({i});
    } else {
      units.push_back(members[instance[i]]);
      placed.insert(units.back().begin(), units.back().end());
    }
  }
  return units;
}

std::vector<Bucket> plan_buckets(std::vector<messaging::Tensor> tensors, uint64_t bucket_bytes, int64_t version,
                                 const TravelGroups& groups) {
  std::vector<std::string> names;
  for (const auto& t : tensors) names.push_back(t.name);
  const auto units = travel_units(names, groups);
  std::vector<Bucket> out;
  uint64_t in_bucket = 0;
  for (const auto& u : units) {
    uint64_t bytes = 0;
    for (auto i : u) bytes += tensors[i].nbytes;
    if (out.empty() || (in_bucket > 0 && in_bucket + bytes > bucket_bytes)) {
      out.emplace_back();
      in_bucket = 0;
    }
    for (auto i : u) out.back().tensors.push_back(std::move(tensors[i]));
    in_bucket += bytes;
  }
  for (std::size_t b = 0; b < out.size(); ++b) {
    out[b].version = version;
    out[b].index = int64_t(b);
    out[b].count = int64_t(out.size());
  }
  return out;
}

std::map<std::string, uint32_t> manifest(const std::vector<messaging::Tensor>& tensors) {
  std::map<std::string, uint32_t> m;
  for (const auto& t : tensors) m[t.name] = messaging::crc32(t);
  return m;
}

void Receiver::accept(Bucket bucket) {
  if (version_ < 0) {
    version_ = bucket.version;
    count_ = bucket.count;
  }
  if (bucket.version != version_)
    throw std::invalid_argument("weight sync: bucket of version " + std::to_string(bucket.version) +
                                " while receiving version " + std::to_string(version_));
  if (bucket.count != count_ || bucket.index < 0 || bucket.index >= count_)
    throw std::invalid_argument("weight sync: bucket " + std::to_string(bucket.index) + "/" + std::to_string(bucket.count) +
                                " does not fit a version of " + std::to_string(count_) + " buckets");
  if (buckets_.count(bucket.index))
    throw std::invalid_argument("weight sync: bucket " + std::to_string(bucket.index) + " received twice");
  buckets_.emplace(bucket.index, std::move(bucket));
}

std::vector<messaging::Tensor> Receiver::verified(const std::map<std::string, uint32_t>& expected) const {
  std::vector<messaging::Tensor> all;
  std::set<std::string> seen;
  std::string bad;
  for (const auto& [i, b] : buckets_)
    for (const auto& t : b.tensors) {
      seen.insert(t.name);
      auto it = expected.find(t.name);
      if (it == expected.end()) bad += " '" + t.name + "' (not in the sender's manifest)";
      else if (messaging::crc32(t) != it->second) bad += " '" + t.name + "' (checksum differs)";
      all.push_back(t);
    }
  for (const auto& [name, crc] : expected)
    if (!seen.count(name)) bad += " '" + name + "' (never received)";
  if (!bad.empty())
    throw std::runtime_error("weight sync of version " + std::to_string(version_) + " failed its post-update check:" + bad);
  return all;
}

}  // namespace kiln::weight_sync
