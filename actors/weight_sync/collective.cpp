#include "actors/weight_sync/collective.hpp"

#include <deque>
#include <future>
#include <map>
#include <set>
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

// One bucket on the wire: its bytes and its tensors' checksums, each broadcast from rank 0.
struct InFlight {
  torch::Tensor buffer, sums;  // [bucket bytes] uint8, [tensors] int64
  c10::intrusive_ptr<c10d::Work> buffer_work, sums_work;
  void start(parallel::Group& g) {
    buffer_work = g.start_broadcast(buffer, 0);
    sums_work = g.start_broadcast(sums, 0);
  }
  void finish(parallel::Group& g) const {
    g.finish(buffer_work, "broadcast");
    g.finish(sums_work, "broadcast");
  }
};

int64_t nbytes(const torch::Tensor& t) { return t.numel() * int64_t(t.element_size()); }

// `t`'s place in a bucket buffer, viewed in its dtype and shape.
torch::Tensor slot(const torch::Tensor& buffer, int64_t offset, const torch::Tensor& like) {
  return buffer.narrow(0, offset, nbytes(like)).view(like.scalar_type()).view(like.sizes());
}

// The names of `named` in the order the sender packs them (travel_units of the sorted names).
std::vector<std::string> packing_order(const std::map<std::string, torch::Tensor>& named, const TravelGroups& groups) {
  std::vector<std::string> names, out;
  for (const auto& [name, t] : named) names.push_back(name);
  for (const auto& unit : travel_units(names, groups))
    for (auto i : unit) out.push_back(names[i]);
  return out;
}

// Checks `experts` against `named` and returns its names as a set; throws std::invalid_argument
// naming a tensor the model lacks.
std::set<std::string> expert_set(const std::map<std::string, torch::Tensor>& named, const ExpertSlices& experts) {
  std::set<std::string> out;
  for (const auto& n : experts.names) {
    if (!named.count(n)) throw std::invalid_argument("collective weight sync: expert tensor '" + n + "' is not the model's");
    out.insert(n);
  }
  return out;
}

// The whole [P*El, ...] shape of an expert slice [El, ...] over P ranks.
std::vector<int64_t> whole_shape(const torch::Tensor& slice, int ranks) {
  auto shape = slice.sizes().vec();
  shape[0] *= ranks;
  return shape;
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

DeviceSyncStats CollectiveSender::send(torch::nn::Module& model, int64_t version, uint64_t bucket_bytes,
                                       const TravelGroups& groups, const ExpertSlices* experts) {
  if (!group_) throw std::logic_error("collective weight sync: send() before connect()");
  auto named = named_tensors(model);
  std::vector<std::string> names;
  for (const auto& [name, t] : named) {
    if (t.device() != device_)
      throw std::invalid_argument("collective weight sync: '" + name + "' is on " + t.device().str() +
                                  ", the group on " + device_.str());
    names.push_back(name);
  }
  const auto gathered = experts && experts->ep ? expert_set(named, *experts) : std::set<std::string>{};
  const int ranks = gathered.empty() ? 1 : experts->ep->size();
  // Bytes the engines receive of a tensor: an expert slice stands for all ranks' slices.
  auto sent_bytes = [&](const std::string& name) { return nbytes(named[name]) * (gathered.count(name) ? ranks : 1); };
  WeightSyncCollective plan{version, {{}}, {}, {}};
  int64_t in_bucket = 0;
  for (const auto& unit : travel_units(names, groups)) {
    int64_t bytes = 0;
    for (auto i : unit) bytes += aligned(sent_bytes(names[i]));
    if (!plan.buckets.back().empty() && uint64_t(in_bucket + bytes) > bucket_bytes) {
      plan.bucket_bytes.push_back(in_bucket);
      plan.buckets.emplace_back();
      in_bucket = 0;
    }
    for (auto i : unit) {
      plan.buckets.back().push_back(names[i]);
      plan.nbytes.push_back(sent_bytes(names[i]));
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
    // Pipelined: bucket b+1 is packed (on the current stream) and its broadcast queued while
    // bucket b's is on the wire; the host waits for b only then. Two buckets in flight at most.
    std::deque<InFlight> flight;
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      InFlight f;
      f.buffer = torch::empty({plan.bucket_bytes[b]}, torch::TensorOptions().dtype(torch::kUInt8).device(device_));
      f.sums = torch::zeros({int64_t(plan.buckets[b].size())}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
      int64_t offset = 0;
      for (std::size_t i = 0; i < plan.buckets[b].size(); ++i) {
        const auto& name = plan.buckets[b][i];
        const auto& src = named[name];
        auto acc = f.sums[int64_t(i)];
        const int64_t n = plan.nbytes[std::size_t(st.tensors)];
        if (gathered.count(name)) {  // every ep rank's slice, straight into the bucket
          auto dst = f.buffer.narrow(0, offset, n).view(src.scalar_type()).view(whole_shape(src, ranks));
          experts->ep->all_gather_into_tensor(dst, src.contiguous());
          kernels::checksum_add(dst, acc);
        } else {
          auto dst = slot(f.buffer, offset, src);
          kernels::copy_with_checksum_add(dst, src.contiguous(), acc);  // pack and checksum in one pass
        }
        offset += aligned(n);
        st.bytes += uint64_t(n);
        ++st.tensors;
      }
      f.start(world);
      flight.push_back(std::move(f));
      if (flight.size() == 2) {
        flight.front().finish(world);
        flight.pop_front();
      }
      ++st.buckets;
    }
    for (auto& f : flight) f.finish(world);
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

void join_expert_gathers(torch::nn::Module& model, const ExpertSlices& experts, const TravelGroups& groups) {
  if (!experts.ep || experts.ep->size() == 1) return;
  const auto named = named_tensors(model);
  const auto gathered = expert_set(named, experts);
  torch::NoGradGuard no_grad;
  for (const auto& name : packing_order(named, groups)) {
    if (!gathered.count(name)) continue;
    const auto& src = named.at(name);
    auto whole = torch::empty(whole_shape(src, experts.ep->size()), src.options());
    experts.ep->all_gather_into_tensor(whole, src.contiguous());
  }
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
    // Pipelined: bucket b+1's broadcast is queued before bucket b is checked and written, so
    // the trainer sends it meanwhile. Two buckets in flight at most.
    auto post = [&](std::size_t b) {
      InFlight f;
      f.buffer = torch::empty({p->bucket_bytes[b]}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
      f.sums = torch::empty({int64_t(p->buckets[b].size())}, torch::TensorOptions().dtype(torch::kInt64).device(device));
      f.start(world);
      return f;
    };
    std::deque<InFlight> flight;
    if (!p->buckets.empty()) flight.push_back(post(0));
    for (std::size_t b = 0; b < p->buckets.size(); ++b) {
      if (b + 1 < p->buckets.size()) flight.push_back(post(b + 1));
      InFlight f = std::move(flight.front());
      flight.pop_front();
      f.finish(world);
      if (!bad.empty()) continue;
      auto got = torch::zeros_like(f.sums);
      std::vector<torch::Tensor> received;
      for (std::size_t i = 0; i < places[b].size(); ++i) {
        received.push_back(slot(f.buffer, places[b][i].first, places[b][i].second));
        auto acc = got[int64_t(i)];
        kernels::checksum_add(received.back(), acc);
      }
      auto same = torch::eq(got, f.sums).to(torch::kCPU);
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
