#pragma once
// A point in a CUDA device's current stream that the host can wait for (a cudaEvent without
// timing, at::cuda::CUDAEvent): how the host reads the results of work it queued earlier while
// work it queued later still runs (the rollout engine's overlapped decode steps,
// actors/rollout/decode_graphs.hpp). CPU builds (no KILN_CUDA) compile; recording then throws.
#include <torch/torch.h>

#include <memory>

namespace kiln::kernels {

class StreamEvent {
 public:
  /// Records the event on the current stream of CUDA `device`: it completes when the work queued
  /// there before this call has run. Throws std::invalid_argument for a device that is not CUDA,
  /// std::logic_error in a build without CUDA kernels.
  explicit StreamEvent(torch::Device device);
  ~StreamEvent();
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;
  /// Blocks the calling thread until the event completed (c10::Error on a CUDA error).
  void synchronize() const;
  /// Whether it completed, without blocking.
  bool done() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::kernels
