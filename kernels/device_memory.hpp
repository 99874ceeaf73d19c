#pragma once
// Peak memory of a device as this process used it: what `kiln run` reports per trainer rank
// (metrics.jsonl `peak_memory_gib_rank_R`) and the CUDA benchmarks report.
#include <torch/torch.h>

namespace kiln::kernels {

/// Peak memory this process used on `device` since the last reset_peak_memory(device), GiB
/// (2^30 bytes). CUDA: the caching allocator's peak allocated bytes on that GPU (tensors alive
/// at once; the allocator's cache, NCCL buffers and other processes are not counted); 0 in a
/// build without CUDA kernels (KILN_CUDA). CPU: the process's peak resident set size
/// (getrusage ru_maxrss; not resettable: the peak since the process started).
double peak_memory_gib(torch::Device device);
/// Starts a new peak for `device` (CUDA); no-op on CPU.
void reset_peak_memory(torch::Device device);
/// peak_memory_gib, then reset_peak_memory: the peak since the previous call (CUDA).
double take_peak_memory_gib(torch::Device device);

}  // namespace kiln::kernels
