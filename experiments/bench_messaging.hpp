#pragma once
// `kiln bench messaging`: GB/s of kiln's gateway for 1, 16, 64, 256 MiB tensors over
// inproc, ipc and tcp loopback, beside raw ZeroMQ (DEALER -> ROUTER, zero-copy send of the
// same bytes) and memcpy, measured in the same run. Prints one table.
#include <cstddef>
#include <vector>

namespace kiln::experiments {

struct MessagingBenchOptions {
  std::vector<std::size_t> sizes_mib = {1, 16, 64, 256};
  std::size_t bytes_per_cell = std::size_t(1) << 30;  ///< bytes sent per measurement
  int repeats = 5;                                     ///< best of this many measurements (2-core machines are noisy)
};

int run_messaging_bench(const MessagingBenchOptions& options);

}  // namespace kiln::experiments
