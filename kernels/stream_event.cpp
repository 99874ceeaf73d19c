#include "kernels/stream_event.hpp"

#include <stdexcept>

#ifdef KILN_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kiln::kernels {

#ifdef KILN_CUDA
struct StreamEvent::Impl {
  at::cuda::CUDAEvent event{cudaEventDisableTiming};
};

StreamEvent::StreamEvent(torch::Device device) : impl_(std::make_unique<Impl>()) {
  if (!device.is_cuda()) throw std::invalid_argument("StreamEvent: device " + device.str() + " is not a CUDA device");
  const c10::cuda::CUDAGuard guard(device);
  impl_->event.record(c10::cuda::getCurrentCUDAStream(device.has_index() ? device.index() : -1));
}

void StreamEvent::synchronize() const { impl_->event.synchronize(); }

bool StreamEvent::done() const { return impl_->event.query(); }
#else
struct StreamEvent::Impl {};

StreamEvent::StreamEvent(torch::Device) {
  throw std::logic_error("StreamEvent: this build has no CUDA kernels (KILN_CUDA)");
}

void StreamEvent::synchronize() const {}

bool StreamEvent::done() const { return true; }
#endif

StreamEvent::~StreamEvent() = default;

}  // namespace kiln::kernels
