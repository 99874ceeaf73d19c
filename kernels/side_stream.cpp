#include "kernels/side_stream.hpp"

#ifdef KILN_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kiln::kernels {

std::pair<torch::Tensor, torch::Tensor> run_beside(torch::Device device, const std::function<torch::Tensor()>& main,
                                                   const std::function<torch::Tensor()>& side,
                                                   const std::vector<torch::Tensor>& side_reads) {
#ifdef KILN_CUDA
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard device_guard(device);
    const auto index = c10::cuda::current_device();
    const auto current = c10::cuda::getCurrentCUDAStream(index);
    thread_local std::vector<std::optional<c10::cuda::CUDAStream>> side_streams;
    if (side_streams.size() <= std::size_t(index)) side_streams.resize(std::size_t(index) + 1);
    auto& slot = side_streams[std::size_t(index)];
    if (!slot) slot = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    const auto other = *slot;
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(other);
    for (const auto& t : side_reads)
      if (t.defined() && t.is_cuda()) t.record_stream(other);
    auto join = [&] {
      at::cuda::CUDAEvent done;
      done.record(other);
      done.block(current);
    };
    torch::Tensor s, m;
    try {
      {
        const c10::cuda::CUDAStreamGuard stream_guard(other);
        s = side();
      }
      m = main();
    } catch (...) {
      join();
      throw;
    }
    join();
    if (s.defined() && s.is_cuda()) s.record_stream(current);
    return {m, s};
  }
#endif
  (void)device;
  (void)side_reads;
  auto s = side();
  auto m = main();
  return {m, s};
}

}  // namespace kiln::kernels
