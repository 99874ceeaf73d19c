#pragma once
// A CUDA graph of LibTorch work: the kernels one call of `fn` launches, captured once on a side
// stream (at::cuda::CUDAGraph, the caching allocator's private pool for what they allocate) and
// replayed on the current stream. A replay reads and writes the same device addresses the
// capture saw: inputs must be written in place into tensors that stay allocated, and the
// tensors `fn` returned (kept alive by the caller) hold the outputs after each replay.
// Work that reads device data on the host (.item(), a copy to the host, data-dependent
// output sizes) cannot be captured: capture throws c10::Error naming the CUDA error.
// Graphs made with the same GraphPool share one memory pool (safe because kiln never
// replays two of them at once). CPU builds (no KILN_CUDA) compile; capture then throws.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

namespace kiln::kernels {

/// A memory pool several CapturedGraphs share (at::cuda::graph_pool_handle()).
struct GraphPool {
  std::pair<uint64_t, uint64_t> id{0, 0};
  /// A fresh pool id. Throws std::logic_error in a build without CUDA kernels.
  static GraphPool make();
};

class CapturedGraph {
 public:
  /// Whether this build can capture CUDA graphs (KILN_CUDA) and a CUDA device is visible.
  static bool available();
  /// Runs `fn` once eagerly on a side stream of `device` (warm-up: lazy initialisation, cuBLAS
  /// workspaces), then captures a second call of it on that stream into a graph drawing from
  /// `pool`. Throws c10::Error when a captured op cannot be captured (e.g. a host sync), and
  /// std::logic_error in a build without CUDA kernels.
  CapturedGraph(torch::Device device, const GraphPool& pool, const std::function<void()>& fn);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  /// Launches the captured kernels on the current stream of the capture's device.
  void replay();
  /// Whether the current stream of `device` is capturing a graph now (false for a device that
  /// is not CUDA, or in a build without CUDA kernels).
  static bool capturing(torch::Device device);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::kernels
