#pragma once
// Weight sync on one device, without host round trips: the trainer's parameters are copied
// device-to-device straight into the rollout engine's parameter storage (the engine model is
// the same package, so names and layouts match one to one: grouped expert tensors travel as
// they are, no gather or split). Tensors go in buckets of at most `bucket_bytes` in name
// order, each of `groups`' instances in one bucket (kiln names: CausalLM::weight_sync_groups
// with hf_names = false). With `verify`, the copy kernel also computes each source tensor's checksum in the
// same pass (kernels/checksum.hpp), the engine re-reads its storage once for its own checksum
// after each bucket, and after the last bucket one host read compares them all: the sync fails
// naming every tensor that differs. Device traffic: 3 passes over the bytes instead of the plain copy's 2.
// Both modules must be on the same device; dtypes may differ (the copy converts).
#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "actors/weight_sync/buckets.hpp"

namespace kiln::weight_sync {

struct DeviceSyncStats {
  double seconds = 0;      ///< wall time of the whole update, device work included
  uint64_t bytes = 0;      ///< bytes written into the engine's storage
  int64_t tensors = 0, buckets = 0;
  bool verified = false;
};

/// Copies every parameter and buffer of `src` into the same-named one of `dst`. Throws
/// std::invalid_argument when names or shapes differ (naming the tensor), std::runtime_error
/// naming the tensors whose post-copy check failed. `verify` = false skips the check.
DeviceSyncStats copy_weights_device(torch::nn::Module& src, torch::nn::Module& dst, uint64_t bucket_bytes,
                                    bool verify = true, const TravelGroups& groups = {});

}  // namespace kiln::weight_sync
