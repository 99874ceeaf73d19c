#pragma once
// Helpers shared by the kernel suites (tests/kernels/).
#include <torch/torch.h>

#include "kernels/rms_norm.hpp"

namespace kiln::test {

/// A CUDA build of kiln on a machine with a GPU: the CUDA test cases run, else they say so.
inline bool have_gpu() { return kernels::built_with_cuda() && torch::cuda::is_available(); }

/// ||a - b|| / ||b|| in fp64.
inline double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kFloat64) - b.to(torch::kFloat64)).norm() / b.to(torch::kFloat64).norm()).item<double>();
}

}  // namespace kiln::test
