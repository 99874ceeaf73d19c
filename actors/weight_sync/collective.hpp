#pragma once
// Collective weight sync: the trainer broadcasts a policy version to rollout engines in other
// processes over a c10d process group — NCCL between GPUs, Gloo on CPU, the same code — the way
// SGLang's init_weights_update_group / update_weights_from_distributed work. ZeroMQ carries
// one request per engine per version (the bucket plan: WeightSyncCollective); the bytes go as
// one broadcast per bucket, packed from the trainer's own tensors (kiln names; grouped expert
// tensors as they are: the engine is the same model package, so names and layouts match one
// to one, as in device_sync.hpp).
//
// Bucket layout (both sides compute it from the plan): the bucket's tensors in order, tensor i
// at the sum of the previous tensors' byte counts each rounded up to 16 (kAlign), so that every
// tensor can be viewed in its dtype inside the flat uint8 buffer [bucket_bytes].
//
// Check: the sender computes each tensor's checksum (kernels/checksum.hpp) in the same pass as
// it packs the bucket, and broadcasts the bucket's checksums [n] int64 after it; the engine
// recomputes them over what it received and writes the bucket into its weights in place only
// when all match (one host read per bucket; a variant checking on the device with one host read
// per version, each tensor written through a `where`, measured 15-20% slower on two H200s). A
// version that fails part-way leaves the earlier buckets written: the
// receiver then reports itself torn() until a version arrives whole (the rollout actor
// refuses to generate meanwhile), so no rollout ever runs on a mix of two versions unnoticed.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "actors/weight_sync/buckets.hpp"
#include "actors/weight_sync/device_sync.hpp"
#include "messaging/envelope.hpp"

namespace kiln::messaging {
class Gateway;
}
namespace kiln::parallel {
class ProcessGroups;
}

namespace kiln::weight_sync {

inline constexpr int64_t kAlign = 16;  ///< byte alignment of each tensor inside a bucket

/// Tensors a trainer rank holds as slices of larger ones: with expert parallel, each rank's
/// [E/P, ...] slice of a grouped expert tensor. The sender gathers each whole (`gather`,
/// collective over the P ranks holding its slices: each of them calls join_gathers meanwhile)
/// just before packing it, so that at most one whole tensor exists at a time; the engines get
/// whole tensors [E, ...] under the same names.
struct SlicedTensors {
  std::vector<torch::Tensor> slices;  ///< by identity: parameters of the model sent
  int64_t ranks = 1;                  ///< P: a whole tensor is P slices, concatenated along dim 0
  std::function<torch::Tensor(const torch::Tensor& slice)> gather;  ///< slice [E/P, ...] -> [E, ...]
};

/// `model`'s tensor names in the order CollectiveSender::send packs them (sorted, then each
/// travel group's members moved together: travel_units).
std::vector<std::string> send_order(torch::nn::Module& model, const TravelGroups& groups = {});
/// What every other rank holding slices runs while the sender sends `model` with the same
/// `groups` and `sliced`: sliced.gather of each slice, in send_order (the results dropped).
void join_gathers(torch::nn::Module& model, const TravelGroups& groups, const SlicedTensors& sliced);

/// The trainer's side (in the process that holds the policy).
class CollectiveSender {
 public:
  /// `device`: the policy's device, with its index (NCCL on CUDA, Gloo on CPU); `timeout`:
  /// forming the group (every engine joining); `collective_timeout`: every broadcast (a lost
  /// or stopped engine fails a version within it), also the engines'.
  CollectiveSender(messaging::Gateway& gateway, torch::Device device, std::chrono::milliseconds timeout,
                   std::chrono::milliseconds collective_timeout);
  ~CollectiveSender();
  /// (Re)forms the group with the engine actors `engines` (ranks 1..N in this order; any
  /// previous group is left): serves a c10d TCPStore on a free loopback port (the engines are
  /// on this host), sends each engine weight_sync.join_group and joins as rank 0. Throws
  /// std::runtime_error naming the engines that did not join and why.
  void connect(const std::vector<std::string>& engines);
  /// Broadcasts `model`'s parameters and buffers as `version` to the connected engines in
  /// buckets of about `bucket_bytes` (`groups`' members in one bucket each, kiln names).
  /// Tensors in `sliced` go whole (gathered one at a time; the other ranks holding slices must
  /// call join_gathers meanwhile). Returns once every engine checked and wrote every bucket.
  /// Throws std::runtime_error naming each engine that failed and its error, std::logic_error
  /// when not connected.
  DeviceSyncStats send(torch::nn::Module& model, int64_t version, uint64_t bucket_bytes, const TravelGroups& groups = {},
                       const SlicedTensors& sliced = {});
  const std::vector<std::string>& engines() const { return engines_; }

 private:
  messaging::Gateway& gw_;
  torch::Device device_;
  std::chrono::milliseconds timeout_, collective_timeout_;
  std::vector<std::string> engines_;
  int64_t generation_ = 0;
  std::unique_ptr<parallel::ProcessGroups> group_;
};

/// The engine's side (hosted by the rollout actor).
class CollectiveReceiver {
 public:
  CollectiveReceiver();
  ~CollectiveReceiver();
  /// weight_sync.join_group: joins the trainer's group on `device` (the engine model's).
  messaging::Expected<messaging::Envelope> join(const messaging::Envelope& request, torch::Device device);
  /// weight_sync.collective: receives the version's buckets, each checked, into `model`'s
  /// parameters and buffers in place. Every bucket is received whatever fails (the broadcasts
  /// must go on for the group to stay usable); the error names every tensor that was unknown
  /// here, of another size, or whose checksum differed.
  messaging::Expected<messaging::Envelope> receive(const messaging::Envelope& request, torch::nn::Module& model);
  /// Some bucket of a version that then failed was written: the weights mix two versions.
  bool torn() const { return torn_; }

 private:
  std::unique_ptr<parallel::ProcessGroups> group_;
  bool torn_ = false;
};

}  // namespace kiln::weight_sync
