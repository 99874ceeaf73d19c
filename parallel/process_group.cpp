#include "parallel/process_group.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef KILN_PARALLEL_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdlib>

namespace kiln::parallel {

namespace {

// ProcessGroups made by this process so far: the n-th of every rank uses store keys under
// "kiln/pg/<n>/", so a second set of groups in the same job never reads the first one's keys.
std::atomic<int> generations{0};

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ranks[i]);
  }
  return s + "]";
}

std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// Gloo's transport devices: one per interface of GLOO_SOCKET_IFNAME (as torch.distributed
// reads it), else the address the host name resolves to (loopback when it resolves to none).
std::vector<std::shared_ptr<::gloo::transport::Device>> gloo_devices() {
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  if (const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME"); ifnames && *ifnames) {
    std::string list = ifnames;
    std::size_t start = 0;
    while (start <= list.size()) {
      std::size_t comma = list.find(',', start);
      if (comma == std::string::npos) comma = list.size();
      const std::string name = list.substr(start, comma - start);
      if (name.empty()) throw std::invalid_argument("GLOO_SOCKET_IFNAME='" + list + "' has an empty interface name");
      devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
      start = comma + 1;
    }
  } else {
    devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return devices;
}

}  // namespace

c10::intrusive_ptr<c10d::Store> connect_store(const LaunchInfo& info, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(info.master_port);
  opts.isServer = !info.use_agent_store && info.rank == 0;
  opts.numWorkers = info.world_size;
  opts.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(info.master_addr, opts);
  } catch (const std::exception& e) {
    const std::string role = opts.isServer ? "serve" : "reach";
    const std::string source = info.use_agent_store ? "the torchrun agent's store" : "the rendezvous store";
    throw RendezvousError("rank " + std::to_string(info.rank) + " of " + std::to_string(info.world_size) +
                          " could not " + role + " " + source + " at " + info.master_addr + ":" +
                          std::to_string(info.master_port) + " (" + launcher_name(info.launcher) + " launch, timeout " +
                          std::to_string(timeout.count()) + " ms): " + error_text(e));
  }
}

ProcessGroups::ProcessGroups(const LaunchInfo& info, torch::Device device, std::vector<MeshDim> mesh,
                             GroupOptions options)
    : launch_(info), device_(device), mesh_(std::move(mesh), info.world_size), options_(options) {
#ifndef KILN_PARALLEL_NCCL
  if (device_.is_cuda())
    throw std::invalid_argument("process groups on " + device_.str() +
                                ": this kiln was built without NCCL (no CUDA toolkit or nccl.h at configure time)");
#endif
  if (!device_.is_cuda() && !device_.is_cpu())
    throw std::invalid_argument("process groups on " + device_.str() + ": only CPU (Gloo) and CUDA (NCCL) are supported");
  tcp_store_ = connect_store(info, options_.store_timeout);
  store_ = c10::make_intrusive<c10d::PrefixStore>("kiln", tcp_store_);
  const int generation = options_.generation ? *options_.generation : generations++;
  const std::string prefix = "pg/" + std::to_string(generation) + "/" + mesh_.describe() + "/";

  std::vector<int> all(info.world_size);
  for (int r = 0; r < info.world_size; ++r) all[r] = r;
  world_ = make_group("world", prefix + "world", std::move(all));
  for (std::size_t d = 0; d < mesh_.dims().size(); ++d) {
    auto ranks = mesh_.group_along(d, info.rank);
    const std::string& dim = mesh_.dims()[d].name;
    // Keyed by the group's first world rank: the same key for every member, unique per group.
    const auto key = prefix + dim + "/" + std::to_string(ranks.front());
    const auto name = dim + ranks_text(ranks);
    along_[dim] = make_group(name, key, std::move(ranks));
  }
}

ProcessGroups::~ProcessGroups() = default;

bool ProcessGroups::failed() const {
  if (world_->failed()) return true;
  for (const auto& [dim, g] : along_)
    if (g->failed()) return true;
  return false;
}

void ProcessGroups::abort(const std::string& why) {
  world_->abort(why);
  for (auto& [dim, g] : along_) g->abort(why);
}

Group& ProcessGroups::along(const std::string& dim) {
  mesh_.dim_index(dim);  // throws naming the mesh's dimensions
  return *along_.at(dim);
}

std::unique_ptr<Group> ProcessGroups::make_group(const std::string& name, const std::string& key_prefix,
                                                 std::vector<int> ranks) {
  const auto me = std::find(ranks.begin(), ranks.end(), launch_.rank);
  assert(me != ranks.end());  // Mesh::group_along always includes the rank it was asked about
  const int rank = static_cast<int>(me - ranks.begin());
  auto store = c10::make_intrusive<c10d::PrefixStore>(key_prefix, store_);
  try {
    auto backend = make_backend(store, rank, static_cast<int>(ranks.size()), device_, name, options_);
    return std::make_unique<Group>(name, std::move(ranks), rank, device_, std::move(backend), options_.collective_timeout);
  } catch (const RendezvousError& e) {
    throw RendezvousError(std::string(e.what()) + " (world ranks " + ranks_text(ranks) + ", world rank " +
                          std::to_string(launch_.rank) + ")");
  }
}

c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               torch::Device device, const std::string& name,
                                               const GroupOptions& options) {
#ifndef KILN_PARALLEL_NCCL
  if (device.is_cuda())
    throw std::invalid_argument("group '" + name + "' on " + device.str() +
                                ": this kiln was built without NCCL (no CUDA toolkit or nccl.h at configure time)");
#endif
  if (!device.is_cuda() && !device.is_cpu())
    throw std::invalid_argument("group '" + name + "' on " + device.str() + ": only CPU (Gloo) and CUDA (NCCL) are supported");
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    if (device.is_cuda()) {
#ifdef KILN_PARALLEL_NCCL
      c10::cuda::set_device(device.index());
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      // ProcessGroupNCCL's watchdog aborts the process (SIGABRT) when a collective outlives this;
      // kiln's own wait (Group, collective_timeout) must come first, to fail with an error that
      // names the group and to exit cleanly: the watchdog only backs it up.
      opts->timeout = 2 * options.collective_timeout;
      opts->group_name = name;
      backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
#endif
    } else {
      auto opts = c10d::ProcessGroupGloo::Options::create(options.collective_timeout);
      opts->devices = gloo_devices();
      opts->group_name = name;
      // Creating a Gloo group connects every pair of ranks through the store, bounded by
      // opts->timeout; rendezvous is what may fail here, so the store timeout applies.
      opts->timeout = options.store_timeout;
      backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
      backend->setTimeout(options.collective_timeout);
    }
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    throw RendezvousError("creating group '" + name + "' as rank " + std::to_string(rank) + " of " +
                          std::to_string(size) + " failed: " + error_text(e));
  }
  return backend;
}

std::unique_ptr<Group> join_torch_group(const TorchGroupAddress& at, torch::Device device, const GroupOptions& options) {
  if (at.world_size < 2 || at.rank < 0 || at.rank >= at.world_size)
    throw std::invalid_argument("group '" + at.group_name + "': rank " + std::to_string(at.rank) + " of world size " +
                                std::to_string(at.world_size) + " is out of range");
  if (at.port < 1 || at.port > 65535)
    throw std::invalid_argument("group '" + at.group_name + "': port " + std::to_string(at.port) + " is outside 1..65535");
  if (at.group_name.empty()) throw std::invalid_argument("a group name must not be empty");
  LaunchInfo info;
  info.rank = at.rank;
  info.world_size = at.world_size;
  info.master_addr = at.address;
  info.master_port = at.port;
  auto tcp = connect_store(info, options.store_timeout);
  // torch.distributed's layout: init_custom_process_group wraps the rendezvous store in
  // PrefixStore(group_name), _new_process_group_helper in PrefixStore(group_name + "/") and the
  // backend's in PrefixStore(device type + "/"): "cpu/" for Gloo, "cuda/" for NCCL.
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::PrefixStore>(at.group_name, tcp);
  store = c10::make_intrusive<c10d::PrefixStore>(at.group_name + "/", store);
  store = c10::make_intrusive<c10d::PrefixStore>(std::string(device.is_cuda() ? "cuda" : "cpu") + "/", store);
  auto backend = make_backend(store, at.rank, at.world_size, device, at.group_name, options);
  std::vector<int> ranks(std::size_t(at.world_size));
  for (int r = 0; r < at.world_size; ++r) ranks[std::size_t(r)] = r;
  return std::make_unique<Group>(at.group_name, std::move(ranks), at.rank, device, std::move(backend),
                                 options.collective_timeout);
}

}  // namespace kiln::parallel
