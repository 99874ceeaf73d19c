#include "actors/weight_sync/device_sync.hpp"
#include "messaging/stopwatch.hpp"

#include "kernels/checksum.hpp"

#include <chrono>
#include <map>
#include <stdexcept>

namespace kiln::weight_sync {

namespace {
std::map<std::string, torch::Tensor> named_tensors(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value();
  return out;
}

void sync_device(const torch::Tensor& t) {
  if (t.is_cuda()) torch::cuda::synchronize(t.device().index());
}
}  // namespace

DeviceSyncStats copy_weights_device(torch::nn::Module& src, torch::nn::Module& dst, uint64_t bucket_bytes,
                                    bool verify, const TravelGroups& groups) {
  auto s = named_tensors(src), d = named_tensors(dst);
  for (const auto& [name, t] : s) {
    auto it = d.find(name);
    if (it == d.end()) throw std::invalid_argument("copy_weights_device: engine has no tensor '" + name + "'");
    if (it->second.sizes() != t.sizes())
      throw std::invalid_argument("copy_weights_device: '" + name + "' is " + c10::str(t.sizes()) + " in the trainer, " +
                                  c10::str(it->second.sizes()) + " in the engine");
    if (it->second.device() != t.device())
      throw std::invalid_argument("copy_weights_device: '" + name + "' lives on " + t.device().str() + " and " +
                                  it->second.device().str());
  }
  for (const auto& [name, t] : d)
    if (!s.count(name)) throw std::invalid_argument("copy_weights_device: trainer has no tensor '" + name + "'");
  // Buckets in name order; a group's members move together.
  std::vector<std::string> names;
  for (const auto& [name, t] : s) names.push_back(name);
  std::vector<std::vector<std::string>> buckets(1);
  uint64_t in_bucket = 0;
  for (const auto& unit : travel_units(names, groups)) {
    uint64_t bytes = 0;
    for (auto i : unit) bytes += uint64_t(d[names[i]].numel()) * d[names[i]].element_size();
    if (!buckets.back().empty() && in_bucket + bytes > bucket_bytes) {
      buckets.emplace_back();
      in_bucket = 0;
    }
    for (auto i : unit) buckets.back().push_back(names[i]);
    in_bucket += bytes;
  }
  DeviceSyncStats st;
  torch::NoGradGuard no_grad;
  sync_device(s.begin()->second);
  const messaging::Stopwatch t0;
  // One zeroed buffer for the whole update: row 0 the sender's checksums, row 1 the engine's,
  // one column per tensor in bucket order; compared once, after the last bucket.
  torch::Tensor sums;
  if (verify) sums = torch::zeros({2, int64_t(s.size())}, s.begin()->second.options().dtype(torch::kInt64));
  std::vector<std::string> order;
  for (const auto& b : buckets) {
    const int64_t base = int64_t(order.size());
    order.insert(order.end(), b.begin(), b.end());
    for (std::size_t i = 0; i < b.size(); ++i) {
      auto& dst = d[b[i]];
      const auto& name = b[i];
      const auto src = s[name].scalar_type() == dst.scalar_type() ? s[name] : s[name].to(dst.scalar_type());
      if (verify) {
        auto slot = sums[0][base + int64_t(i)];
        kernels::copy_with_checksum_add(dst, src.contiguous(), slot);  // checksum free with the copy
      } else {
        dst.copy_(src, /*non_blocking=*/true);
      }
      st.bytes += uint64_t(dst.numel()) * dst.element_size();
      ++st.tensors;
    }
    ++st.buckets;
    if (verify)  // the engine re-reads its storage of this bucket once
      for (std::size_t i = 0; i < b.size(); ++i) {
        auto slot = sums[1][base + int64_t(i)];
        kernels::checksum_add(d[b[i]].contiguous(), slot);
      }
  }
  if (verify) {  // one host read compares every tensor
    auto same = torch::eq(sums[0], sums[1]).to(torch::kCPU);
    const bool* ok = same.data_ptr<bool>();
    std::string names;
    for (std::size_t i = 0; i < order.size(); ++i)
      if (!ok[i]) names += (names.empty() ? "" : ", ") + order[i];
    if (!names.empty()) throw std::runtime_error("weight sync: engine copy differs from the trainer's for " + names);
  }
  sync_device(s.begin()->second);
  st.seconds = t0.seconds();
  st.verified = verify;
  return st;
}

}  // namespace kiln::weight_sync
