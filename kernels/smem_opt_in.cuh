#pragma once
// Opting a kernel into more than 48 KB of dynamic shared memory per CTA
// (cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)), per device, only when a
// launch needs more than was raised before: a launcher holds one static SmemOptIn per kernel and
// calls raise(kernel, bytes, device) before each launch. A kernel's first launches run eagerly
// (kernels/cuda_graph.hpp warms up before capture), so a captured launch of the same size makes
// no attribute call. Host code of the .cu files; throws c10::Error when the runtime refuses the
// size (more than the device's opt-in limit, 227 KB on Hopper).
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>

namespace kiln::kernels::cuda {

class SmemOptIn {
 public:
  template <class Kernel>
  void raise(Kernel kernel, std::size_t bytes, int device) {
    if (bytes <= 48 * 1024) return;  // the default limit
    const bool tracked = device >= 0 && device < int(raised_.size());
    if (tracked && raised_[std::size_t(device)].load() >= bytes) return;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    if (!tracked) return;
    std::size_t seen = raised_[std::size_t(device)].load();
    while (seen < bytes && !raised_[std::size_t(device)].compare_exchange_weak(seen, bytes)) {
    }
  }

 private:
  std::array<std::atomic<std::size_t>, 64> raised_{};  // bytes raised to, per device index
};

}  // namespace kiln::kernels::cuda
