#pragma once
// Helpers of the kernel suites (tests/kernels/), over the shared ones in tests/test_util.hpp.
#include <torch/torch.h>

#include "kernels/rms_norm.hpp"
#include "../test_util.hpp"

namespace kiln::test {

/// A CUDA build of kiln's kernels and a GPU to run them on.
inline bool have_cuda_kernels() { return kernels::built_with_cuda() && have_gpu(); }

/// Skips the running CUDA kernel test case without them (see skip_unless).
inline bool skip_without_cuda_kernels() {
  return skip_unless(have_cuda_kernels(), "needs a CUDA build of kiln's kernels and a CUDA device");
}

}  // namespace kiln::test
