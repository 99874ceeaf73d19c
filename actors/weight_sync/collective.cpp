#include "actors/weight_sync/collective.hpp"

#include <future>
#include <map>
#include <algorithm>
#include <stdexcept>

#include "actors/weight_sync/messages.hpp"
#include "kernels/checksum.hpp"
#include "messaging/gateway.hpp"
#include "messaging/stopwatch.hpp"
#include "parallel/process_group.hpp"

namespace kiln::weight_sync {

using namespace kiln::messaging;

namespace {

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::map<std::string, torch::Tensor> named_tensors(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value();
  return out;
}

int64_t nbytes(const torch::Tensor& t) { return t.numel() * int64_t(t.element_size()); }

bool is_slice(const torch::Tensor& t, const SlicedTensors& sliced) {
  return std::any_of(sliced.slices.begin(), sliced.slices.end(), [&](const torch::Tensor& s) { return s.is_same(t); });
}

// `t`'s place in a bucket buffer, viewed in its dtype and shape.
torch::Tensor slot(const torch::Tensor& buffer, int64_t offset, const torch::Tensor& like) {
  return buffer.narrow(0, offset, nbytes(like)).view(like.scalar_type()).view(like.sizes());
}

std::unique_ptr<parallel::ProcessGroups> make_group(const std::string& host, int port, int rank, int world,
                                                    int64_t generation, torch::Device device,
                                                    std::chrono::milliseconds timeout,
                                                    std::chrono::milliseconds collective_timeout) {
  parallel::LaunchInfo info;
  info.rank = rank;
  info.world_size = world;
  info.master_addr = host;
  info.master_port = port;
  return std::make_unique<parallel::ProcessGroups>(info, device, std::vector<parallel::MeshDim>{},
                                                   parallel::GroupOptions{timeout, collective_timeout, int(generation)});
}

}  // namespace

CollectiveSender::CollectiveSender(Gateway& gateway, torch::Device device, std::chrono::milliseconds timeout,
                                   std::chrono::milliseconds collective_timeout)
    : gw_(gateway), device_(device), timeout_(timeout), collective_timeout_(collective_timeout) {}
CollectiveSender::~CollectiveSender() = default;

void CollectiveSender::connect(const std::vector<std::string>& engines) {
  group_.reset();
  engines_.clear();
  const int port = parallel::free_loopback_port();
  const int world = int(engines.size()) + 1;
  ++generation_;
  std::vector<std::future<Expected<Envelope>>> answers;
  for (std::size_t i = 0; i < engines.size(); ++i) {
    WeightSyncJoinGroup j{"127.0.0.1", port, int64_t(i) + 1, world, generation_, timeout_.count(),
                          collective_timeout_.count()};
    answers.push_back(gw_.request(make_envelope(j, Kind::request, "controller", engines[i]), timeout_));
  }
  std::string failed, mine;
  try {
    group_ = make_group("127.0.0.1", port, 0, world, generation_, device_, timeout_, collective_timeout_);
  } catch (const std::exception& e) {
    mine = e.what();
  }
  for (std::size_t i = 0; i < engines.size(); ++i) {
    auto r = answers[i].get();
    if (!r) failed += (failed.empty() ? "" : "; ") + engines[i] + ": " + r.error().what();
  }
  if (!failed.empty() || !mine.empty()) {
    group_.reset();
    throw std::runtime_error("collective weight sync: the group did not form: " +
                             (failed.empty() ? std::string() : failed) + (mine.empty() ? "" : " (trainer: " + mine + ")"));
  }
  engines_ = engines;
}

std::vector<std::string> send_order(torch::nn::Module& model, const TravelGroups& groups) {
  std::vector<std::string> names, out;
  for (const auto& [name, t] : named_tensors(model)) names.push_back(name);
  for (const auto& unit : travel_units(names, groups))
    for (auto i : unit) out.push_back(names[i]);
  return out;
}

void join_gathers(torch::nn::Module& model, const TravelGroups& groups, const SlicedTensors& sliced) {
  torch::NoGradGuard no_grad;
  auto named = named_tensors(model);
  for (const auto& name : send_order(model, groups))
    if (is_slice(named[name], sliced)) (void)sliced.gather(named[name]);
}

DeviceSyncStats CollectiveSender::send(torch::nn::Module& model, int64_t version, uint64_t bucket_bytes,
                                       const TravelGroups& groups, const SlicedTensors& sliced) {
  if (!group_) throw std::logic_error("collective weight sync: send() before connect()");
  auto named = named_tensors(model);
  std::vector<std::string> names;
  for (const auto& [name, t] : named) {
    if (t.device() != device_)
      throw std::invalid_argument("collective weight sync: '" + name + "' is on " + t.device().str() +
                                  ", the group on " + device_.str());
    names.push_back(name);
  }
  // Bytes of a tensor as it travels: a slice goes whole (sliced.ranks of them).
  auto travel_bytes = [&](const torch::Tensor& t) { return nbytes(t) * (is_slice(t, sliced) ? sliced.ranks : 1); };
  WeightSyncCollective plan{version, {{}}, {}, {}};
  int64_t in_bucket = 0;
  for (const auto& unit : travel_units(names, groups)) {
    int64_t bytes = 0;
    for (auto i : unit) bytes += aligned(travel_bytes(named[names[i]]));
    if (!plan.buckets.back().empty() && uint64_t(in_bucket + bytes) > bucket_bytes) {
      plan.bucket_bytes.push_back(in_bucket);
      plan.buckets.emplace_back();
      in_bucket = 0;
    }
    for (auto i : unit) {
      plan.buckets.back().push_back(names[i]);
      plan.nbytes.push_back(travel_bytes(named[names[i]]));
    }
    in_bucket += bytes;
  }
  plan.bucket_bytes.push_back(in_bucket);
  torch::NoGradGuard no_grad;
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  const Stopwatch t0;
  std::vector<std::future<Expected<Envelope>>> answers;
  for (const auto& e : engines_)
    answers.push_back(gw_.request(make_envelope(plan, Kind::request, "controller", e), timeout_));
  DeviceSyncStats st;
  std::string mine;
  try {
    auto& world = group_->world();
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      auto buffer = torch::empty({plan.bucket_bytes[b]}, torch::TensorOptions().dtype(torch::kUInt8).device(device_));
      auto sums = torch::zeros({int64_t(plan.buckets[b].size())}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
      int64_t offset = 0;
      for (std::size_t i = 0; i < plan.buckets[b].size(); ++i) {
        const auto& held = named[plan.buckets[b][i]];
        const auto src = is_slice(held, sliced) ? sliced.gather(held) : held;  // [E/P, ...] -> [E, ...]
        auto dst = slot(buffer, offset, src);
        auto acc = sums[int64_t(i)];
        kernels::copy_with_checksum_add(dst, src.contiguous(), acc);  // pack and checksum in one pass
        offset += aligned(nbytes(src));
        st.bytes += uint64_t(nbytes(src));
        ++st.tensors;
      }
      world.broadcast(buffer, 0);
      world.broadcast(sums, 0);
      ++st.buckets;
    }
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  } catch (const std::exception& e) {
    mine = e.what();
    // Leave the group at once: engines still waiting in a broadcast fail now (their peer
    // closed) instead of at the timeout, and can answer (and join a new group).
    group_.reset();
  }
  std::string failed;
  for (std::size_t i = 0; i < engines_.size(); ++i) {
    auto r = answers[i].get();
    if (!r) failed += (failed.empty() ? "" : "; ") + engines_[i] + ": " + r.error().what();
  }
  if (!failed.empty() || !mine.empty()) {
    group_.reset();  // not usable after a failed broadcast: connect() again
    engines_.clear();
    throw std::runtime_error("collective weight sync of version " + std::to_string(version) + ": " + failed +
                             (mine.empty() ? "" : (failed.empty() ? "" : "; ") + std::string("trainer: ") + mine));
  }
  st.seconds = t0.seconds();
  st.verified = true;
  return st;
}

CollectiveReceiver::CollectiveReceiver() = default;
CollectiveReceiver::~CollectiveReceiver() = default;

Expected<Envelope> CollectiveReceiver::join(const Envelope& request, torch::Device device) {
  auto j = payload_as<WeightSyncJoinGroup>(request);
  if (!j) return j.error();
  if (j->rank < 1 || j->rank >= j->world || j->port < 1 || j->port > 65535 || j->timeout_ms < 1 ||
      j->collective_timeout_ms < 1)
    return make_error(ErrorCode::bad_message, "weight_sync.join_group: rank " + std::to_string(j->rank) + " of " +
                                                  std::to_string(j->world) + ", port " + std::to_string(j->port) +
                                                  ", timeout " + std::to_string(j->timeout_ms) + " ms: out of range");
  group_.reset();
  try {
    group_ = make_group(j->host, int(j->port), int(j->rank), int(j->world), j->generation, device,
                        std::chrono::milliseconds(j->timeout_ms), std::chrono::milliseconds(j->collective_timeout_ms));
  } catch (const std::exception& e) {
    return make_error(ErrorCode::remote_error, std::string("weight_sync.join_group: ") + e.what());
  }
  return make_envelope(WeightSyncAck{-1, 0}, Kind::reply, request.receiver, request.sender);
}

Expected<Envelope> CollectiveReceiver::receive(const Envelope& request, torch::nn::Module& model) {
  auto p = payload_as<WeightSyncCollective>(request);
  if (!p) return p.error();
  if (!group_) return make_error(ErrorCode::remote_error, "weight_sync.collective before weight_sync.join_group");
  std::size_t tensors = 0;
  for (const auto& b : p->buckets) tensors += b.size();
  if (p->bucket_bytes.size() != p->buckets.size() || p->nbytes.size() != tensors)
    return make_error(ErrorCode::bad_message, "weight_sync.collective: " + std::to_string(p->buckets.size()) +
                                                  " buckets, " + std::to_string(p->bucket_bytes.size()) +
                                                  " bucket sizes, " + std::to_string(tensors) + " tensors, " +
                                                  std::to_string(p->nbytes.size()) + " tensor sizes");
  auto named = named_tensors(model);
  torch::NoGradGuard no_grad;
  const auto device = named.empty() ? torch::Device(torch::kCPU) : named.begin()->second.device();
  // 1. The plan against this model, on the host, before anything arrives: every tensor known
  // here, of the same size, inside its bucket. A bad plan is still received (the broadcasts
  // must go on for the group to stay usable) but nothing of it is written.
  std::string bad;
  std::vector<std::vector<std::pair<int64_t, torch::Tensor>>> places(p->buckets.size());  // (offset, own tensor)
  std::size_t k = 0;
  for (std::size_t b = 0; b < p->buckets.size(); ++b) {
    int64_t offset = 0;
    for (const auto& name : p->buckets[b]) {
      const int64_t n = p->nbytes[k++];
      auto it = named.find(name);
      if (it == named.end()) bad += (bad.empty() ? "" : ", ") + name + " (unknown to this engine)";
      else if (nbytes(it->second) != n || offset + n > p->bucket_bytes[b])
        bad += (bad.empty() ? "" : ", ") + name + " (" + std::to_string(n) + " bytes sent, " +
               std::to_string(nbytes(it->second)) + " here)";
      else places[b].emplace_back(offset, it->second);
      offset += aligned(n);
    }
  }
  // 2. Every bucket, checked (one host read of its checksums' comparison) and then written in
  // place; after a bucket that failed, the rest are received and dropped.
  std::size_t written = 0;
  try {
    auto& world = group_->world();
    for (std::size_t b = 0; b < p->buckets.size(); ++b) {
      auto buffer = torch::empty({p->bucket_bytes[b]}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
      auto want = torch::empty({int64_t(p->buckets[b].size())}, torch::TensorOptions().dtype(torch::kInt64).device(device));
      world.broadcast(buffer, 0);
      world.broadcast(want, 0);
      if (!bad.empty()) continue;
      auto got = torch::zeros_like(want);
      std::vector<torch::Tensor> received;
      for (std::size_t i = 0; i < places[b].size(); ++i) {
        received.push_back(slot(buffer, places[b][i].first, places[b][i].second));
        auto acc = got[int64_t(i)];
        kernels::checksum_add(received.back(), acc);
      }
      auto same = torch::eq(got, want).to(torch::kCPU);
      for (std::size_t i = 0; i < received.size(); ++i)
        if (!same[int64_t(i)].item<bool>()) bad += (bad.empty() ? "" : ", ") + p->buckets[b][i] + " (checksum differs)";
      if (!bad.empty()) continue;
      for (std::size_t i = 0; i < received.size(); ++i) places[b][i].second.copy_(received[i]);
      ++written;
    }
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  } catch (const std::exception& e) {  // the group is broken (a lost trainer): join again first
    group_.reset();
    torn_ = torn_ || written > 0;
    return make_error(ErrorCode::remote_error, "weight_sync.collective of version " + std::to_string(p->version) +
                                                   ": " + e.what() +
                                                   (written > 0 ? " (the engine holds a mix of versions until one arrives whole)" : ""));
  }
  if (!bad.empty()) {
    torn_ = torn_ || written > 0;
    return make_error(ErrorCode::remote_error,
                      "weight_sync.collective of version " + std::to_string(p->version) + ": not applied: " + bad +
                          (written > 0 ? " (the buckets before it were written: the engine holds a mix of "
                                         "versions until one arrives whole)"
                                       : ""));
  }
  torn_ = false;
  return make_envelope(WeightSyncAck{p->version, int64_t(tensors)}, Kind::reply, request.receiver, request.sender);
}

}  // namespace kiln::weight_sync
