#pragma once
// Timing and memory helpers shared by the CUDA benchmarks (bench_gpu.cpp, bench_parallel.cpp).
// Needs a CUDA device when called; the peak-memory figures are 0 in a build without KILN_CUDA.
#include <torch/torch.h>
#ifdef KILN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <vector>

#include "messaging/stopwatch.hpp"

namespace kiln::experiments {

/// Median seconds of `steps` calls of fn after `warmup` calls, the device synchronised around each.
template <class F>
double median_seconds(int warmup, int steps, F fn) {
  for (int i = 0; i < warmup; ++i) fn();
  torch::cuda::synchronize();
  std::vector<double> t;
  for (int i = 0; i < steps; ++i) {
    const messaging::Stopwatch t0;
    fn();
    torch::cuda::synchronize();
    t.push_back(t0.seconds());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Resets / reads the peak of memory allocated on CUDA device `device` (GiB).
inline void reset_peak(int device = 0) {
#ifdef KILN_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(c10::DeviceIndex(device));
#else
  (void)device;
#endif
}
inline double peak_gib(int device = 0) {
#ifdef KILN_CUDA
  auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::DeviceIndex(device));
  return double(s.allocated_bytes[0].peak) / double(1ull << 30);
#else
  (void)device;
  return 0;
#endif
}

}  // namespace kiln::experiments
