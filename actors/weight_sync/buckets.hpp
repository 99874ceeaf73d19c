#pragma once
// Weight sync from the trainer to rollout engines, in buckets. The sender takes the policy's
// HF-named tensors (grouped experts already split into per-expert names by the state-dict
// adapter, so each engine receives the names it loads), cuts them into buckets of at most
// `bucket_bytes`, never separating tensors the model package says travel together (engines
// may fuse them: CausalLM::weight_sync_groups), and stamps each bucket with the version. The receiver collects the buckets,
// checks every tensor's CRC-32 against the sender's list after the last bucket, and only
// then applies the update; a mismatch names the tensor and nothing is applied.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "messaging/tensor.hpp"

namespace kiln::weight_sync {

struct Bucket {
  int64_t version = 0;
  int64_t index = 0, count = 0;        ///< this bucket's place among the version's buckets
  std::vector<messaging::Tensor> tensors;
  uint64_t bytes() const;
};

/// Tensors that must travel in one bucket, as the model package declares them: each group is
/// a list of name patterns with `{}` standing for a layer index (e.g. a layer's q_a_proj and
/// kv_a_proj_with_mqa); names of one group instance share the index.
using TravelGroups = std::vector<std::vector<std::string>>;

/// `names` (by index, order kept) in units: a name alone, or with the other members of its
/// group instance, moved up next to the first member present.
std::vector<std::vector<std::size_t>> travel_units(const std::vector<std::string>& names, const TravelGroups& groups);

/// Cuts `tensors` into buckets (order kept; a group's members move together even if that
/// overfills a bucket; a tensor larger than bucket_bytes gets a bucket of its own).
std::vector<Bucket> plan_buckets(std::vector<messaging::Tensor> tensors, uint64_t bucket_bytes, int64_t version,
                                 const TravelGroups& groups = {});

/// name -> CRC-32 of every tensor (the sender's manifest).
std::map<std::string, uint32_t> manifest(const std::vector<messaging::Tensor>& tensors);

/// Collects the buckets of one version and verifies them against the manifest.
class Receiver {
 public:
  /// Adds a bucket. Throws std::invalid_argument for a bucket of another version than the
  /// first one seen, or a repeated index.
  void accept(Bucket bucket);
  bool complete() const { return count_ > 0 && int64_t(buckets_.size()) == count_; }
  /// The received tensors after checking each against `expected`; throws
  /// std::runtime_error naming every tensor whose checksum differs, or that is missing or
  /// unexpected. Call when complete().
  std::vector<messaging::Tensor> verified(const std::map<std::string, uint32_t>& expected) const;
  int64_t version() const { return version_; }

 private:
  std::map<int64_t, Bucket> buckets_;
  int64_t version_ = -1, count_ = 0;
};

}  // namespace kiln::weight_sync
