#pragma once
// A job's process groups: rendezvous through a c10d::TCPStore at the launch's master address,
// the world group, and one sub-group per device-mesh dimension for this rank. ProcessGroupNCCL
// when the device is CUDA, ProcessGroupGloo on CPU (the same code path; CPU CI runs it).
#include "parallel/group.hpp"
#include "parallel/launch.hpp"
#include "parallel/mesh.hpp"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <map>
#include <optional>
#include <memory>
#include <string>

namespace kiln::parallel {

/// Rendezvous failed: the store could not be served or reached in time.
class RendezvousError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Timeouts (milliseconds).
struct GroupOptions {
  /// Connecting to the store (rank 0 also waits here for every rank to connect) and creating
  /// each group (peers exchange addresses through the store).
  std::chrono::milliseconds store_timeout = std::chrono::minutes(5);
  /// Every collective's wait; a lost peer surfaces as a CollectiveError after at most this long.
  std::chrono::milliseconds collective_timeout = std::chrono::minutes(10);
  /// n in the groups' store keys "kiln/pg/<n>/...". Unset: the number of ProcessGroups this
  /// process made before (every rank must then make the same sequence of them). Set it when
  /// the members are programs that make different numbers of groups (e.g. the trainer and
  /// the engines of a collective weight sync), to the same value on every member.
  std::optional<int> generation;
};

/// Connects to the job's TCPStore at info.master_addr:info.master_port. Rank 0 serves it
/// (waiting up to `timeout` for every rank to connect) unless info.use_agent_store, when every
/// rank is a client of the torchrun agent's store. Throws RendezvousError naming the address,
/// the launcher, this rank and c10d's message.
c10::intrusive_ptr<c10d::Store> connect_store(const LaunchInfo& info, std::chrono::milliseconds timeout);

/// Where a group that torch.distributed programs join meets: SGLang's
/// init_custom_process_group(backend, init_method="tcp://ADDRESS:PORT", world_size, rank,
/// group_name) (python/sglang/srt/utils.py; slime's and verl's trainers use the same helper).
struct TorchGroupAddress {
  std::string address;  ///< host of the TCPStore, which rank 0 serves
  int port = 0;         ///< 1..65535
  int rank = 0;         ///< this process's rank, 0 <= rank < world_size
  int world_size = 0;   ///< >= 2
  std::string group_name;
};

/// Joins (rank 0: serves the TCPStore and waits up to options.store_timeout for every rank) a
/// group laid out in the store as torch.distributed lays out `at.group_name`'s: keys under
/// PrefixStore(group_name) / (group_name + "/") / ("cpu/" for Gloo, "cuda/" for NCCL), so
/// that a Python program calling init_custom_process_group with the same address, world and
/// name is a member. Group ranks are the world ranks 0..world_size-1. `device` picks the
/// backend as ProcessGroups does (CUDA: NCCL, CPU: Gloo). Throws std::invalid_argument for a
/// rank, port or name out of range or a device the build cannot serve, RendezvousError naming
/// the address when the store or a peer is not reached in time.
std::unique_ptr<Group> join_torch_group(const TorchGroupAddress& at, torch::Device device, const GroupOptions& options);

/// The c10d backend of one group over `store` (keys already prefixed for it): ProcessGroupNCCL
/// on a CUDA `device` (this process's CUDA device set to its index), ProcessGroupGloo on CPU
/// (devices from GLOO_SOCKET_IFNAME, else the host name's address). Creating it waits for every
/// rank (options.store_timeout); collectives wait options.collective_timeout. Throws
/// std::invalid_argument for a device the build cannot serve, RendezvousError when a peer is
/// not reached.
c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               torch::Device device, const std::string& name,
                                               const GroupOptions& options);

/// The world group and this rank's group along each mesh dimension.
class ProcessGroups {
 public:
  /// Rendezvous (connect_store) and the groups. `device` picks the backend: CUDA -> NCCL (this
  /// process's CUDA device is set to device.index()), CPU -> Gloo (devices from
  /// GLOO_SOCKET_IFNAME, comma-separated interface names, else the host name's address). Every
  /// rank must call it with the same mesh, in the same order relative to other ProcessGroups.
  /// Throws std::invalid_argument for a mesh whose sizes' product is not the world size or a
  /// CUDA device in a build without NCCL, RendezvousError when the store is not reached.
  ProcessGroups(const LaunchInfo& info, torch::Device device, std::vector<MeshDim> mesh = {}, GroupOptions options = {});
  ~ProcessGroups();
  ProcessGroups(const ProcessGroups&) = delete;
  ProcessGroups& operator=(const ProcessGroups&) = delete;

  const LaunchInfo& launch() const { return launch_; }
  const Mesh& mesh() const { return mesh_; }
  /// Every rank of the job.
  Group& world() { return *world_; }
  /// This rank's group along mesh dimension `dim` ("dp", "ep", ...); its group rank is this
  /// rank's coordinate along `dim`. Throws std::invalid_argument for an unknown dimension.
  Group& along(const std::string& dim);
  /// The job's store under the prefix "kiln/" (e.g. to publish each rank's ZeroMQ endpoint).
  c10d::Store& store() { return *store_; }
  /// True once a collective of any of the groups failed (or abort()): this rank can no longer
  /// take part in the job's collectives (Group::failed).
  bool failed() const;
  /// Group::abort(why) on every group: a collective this rank waits in on another thread ends
  /// with CollectiveError (NCCL at once; Gloo when a peer's connection closes or at the
  /// timeout). For a peer known lost (its process gone), so that this rank reports it instead
  /// of waiting out parallel.collective_timeout_s.
  void abort(const std::string& why);

 private:
  std::unique_ptr<Group> make_group(const std::string& name, const std::string& key_prefix, std::vector<int> ranks);

  LaunchInfo launch_;
  torch::Device device_;
  Mesh mesh_;
  GroupOptions options_;
  c10::intrusive_ptr<c10d::Store> tcp_store_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<Group> world_;
  std::map<std::string, std::unique_ptr<Group>> along_;
};

}  // namespace kiln::parallel
