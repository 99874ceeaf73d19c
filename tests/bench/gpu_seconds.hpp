#pragma once
// Mean wall time of one call of f on the GPU for the kernel benchmarks in tests/bench: `warmup`
// untimed calls, a device sync, then `iters` calls between two syncs (seconds per call; the
// launches queue back to back, so the host's launch time is hidden unless f is launch-bound).
#include <torch/torch.h>

#include <chrono>

namespace kiln::bench {

template <class F>
double gpu_seconds(F&& f, int iters = 20, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) f();
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

}  // namespace kiln::bench
