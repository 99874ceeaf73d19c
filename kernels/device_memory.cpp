#include "kernels/device_memory.hpp"

#include <sys/resource.h>

#ifdef KILN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace kiln::kernels {

namespace {
constexpr double kGiB = double(1ull << 30);
}

double peak_memory_gib(torch::Device device) {
  if (device.is_cpu()) {
    rusage usage{};
    ::getrusage(RUSAGE_SELF, &usage);
    return double(usage.ru_maxrss) * 1024.0 / kGiB;  // Linux: kilobytes
  }
#ifdef KILN_CUDA
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  return double(c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].peak) / kGiB;
#else
  return 0;
#endif
}

void reset_peak_memory(torch::Device device) {
#ifdef KILN_CUDA
  if (device.is_cuda())
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : c10::cuda::current_device());
#else
  (void)device;
#endif
}

double take_peak_memory_gib(torch::Device device) {
  const double peak = peak_memory_gib(device);
  reset_peak_memory(device);
  return peak;
}

}  // namespace kiln::kernels
