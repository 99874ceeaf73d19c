#include "actors/weight_sync/buckets.hpp"

#include <set>
#include <stdexcept>

namespace kiln::weight_sync {

uint64_t Bucket::bytes() const {
  uint64_t b = 0;
  for (const auto& t : tensors) b += t.nbytes;
  return b;
}

std::string fused_partner(const std::string& name) {
  static const std::string q = "self_attn.q_a_proj.weight", kv = "self_attn.kv_a_proj_with_mqa.weight";
  auto swap = [&](const std::string& from, const std::string& to) -> std::string {
    auto p = name.rfind(from);
    if (p == std::string::npos || p + from.size() != name.size()) return {};
    return name.substr(0, p) + to;
  };
  if (auto s = swap(q, kv); !s.empty()) return s;
  return swap(kv, q);
}

std::vector<Bucket> plan_buckets(std::vector<messaging::Tensor> tensors, uint64_t bucket_bytes, int64_t version) {
  // Units: a tensor, or a partner pair (the second member moved up next to the first).
  std::map<std::string, std::size_t> where;
  for (std::size_t i = 0; i < tensors.size(); ++i) where[tensors[i].name] = i;
  std::vector<std::vector<std::size_t>> units;
  std::set<std::size_t> placed;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (placed.count(i)) continue;
    std::vector<std::size_t> u{i};
    placed.insert(i);
    auto partner = fused_partner(tensors[i].name);
    if (auto it = where.find(partner); !partner.empty() && it != where.end() && !placed.count(it->second)) {
      u.push_back(it->second);
      placed.insert(it->second);
    }
    units.push_back(u);
  }
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
