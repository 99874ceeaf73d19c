#pragma once
// Timing and memory helpers shared by the CUDA benchmarks (bench_gpu.cpp, bench_parallel.cpp).
// Needs a CUDA device when called; the peak-memory figures are 0 in a build without KILN_CUDA.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/device_memory.hpp"
#include "messaging/stopwatch.hpp"
#include "model/blocks/basic.hpp"

namespace kiln::experiments {

/// The checks every training benchmark makes first: a CUDA device is visible, and `tokens`
/// split into `docs` documents of >= `min_per_doc` tokens each. Prints what is wrong as
/// "kiln bench NAME: ..." and returns 2 (the command's exit status), else 0.
inline int check_cuda_and_packing(const char* name, int64_t tokens, int64_t docs, int64_t min_per_doc) {
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "kiln bench %s: no CUDA device visible\n", name);
    return 2;
  }
  if (docs < 1 || tokens % docs != 0 || tokens / docs < min_per_doc) {
    std::fprintf(stderr, "kiln bench %s: --tokens must be a multiple of --docs with >= %lld tokens per document\n", name,
                 (long long)min_per_doc);
    return 2;
  }
  return 0;
}

/// `docs` documents of tokens / docs random ids in [0, vocab) each, packed (on the CPU; the
/// ids from torch's current RNG). `tokens` must be a multiple of `docs` (check_cuda_and_packing).
inline model::PackedBatch random_packed_documents(int64_t tokens, int64_t docs, int64_t vocab) {
  const int64_t n = tokens / docs;
  std::vector<std::vector<int64_t>> out(static_cast<std::size_t>(docs));
  auto ids = torch::randint(0, vocab, {tokens}, torch::kInt64);
  for (int64_t d = 0; d < docs; ++d) {
    auto row = ids.narrow(0, d * n, n);
    out[std::size_t(d)].assign(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + n);
  }
  return model::PackedBatch::from_documents(out);
}

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

/// Resets / reads the peak of memory allocated on CUDA device `device` (GiB;
/// kernels/device_memory.hpp: 0 in a build without KILN_CUDA).
inline void reset_peak(int device = 0) { kernels::reset_peak_memory(torch::Device(torch::kCUDA, int8_t(device))); }
inline double peak_gib(int device = 0) { return kernels::peak_memory_gib(torch::Device(torch::kCUDA, int8_t(device))); }

}  // namespace kiln::experiments
