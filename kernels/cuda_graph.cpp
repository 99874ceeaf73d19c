#include "kernels/cuda_graph.hpp"

#include <stdexcept>

#ifdef KILN_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kiln::kernels {

#ifdef KILN_CUDA
struct CapturedGraph::Impl {
  at::cuda::CUDAGraph graph;
  torch::Device device{torch::kCUDA};
};

GraphPool GraphPool::make() {
  auto id = at::cuda::graph_pool_handle();
  return GraphPool{{id.first, id.second}};
}

bool CapturedGraph::available() { return torch::cuda::is_available(); }

CapturedGraph::CapturedGraph(torch::Device device, const GraphPool& pool, const std::function<void()>& fn)
    : impl_(std::make_unique<Impl>()) {
  if (!device.is_cuda()) throw std::invalid_argument("CapturedGraph: device " + device.str() + " is not a CUDA device");
  impl_->device = device;
  const c10::cuda::CUDAGuard guard(device);
  auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  c10::cuda::device_synchronize();  // the inputs, written on the current stream, are in place
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    fn();  // warm-up, eagerly
    impl_->graph.capture_begin({pool.id.first, pool.id.second});
    try {
      fn();
    } catch (...) {
      try {
        impl_->graph.capture_end();  // leaves the stream out of capture mode
      } catch (...) {
      }
      throw;
    }
    impl_->graph.capture_end();
  }
  c10::cuda::device_synchronize();  // the warm-up's writes land before the current stream goes on
}

void CapturedGraph::replay() {
  const c10::cuda::CUDAGuard guard(impl_->device);
  impl_->graph.replay();
}

bool CapturedGraph::capturing(torch::Device device) {
  if (!device.is_cuda()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}
#else
struct CapturedGraph::Impl {};

GraphPool GraphPool::make() { throw std::logic_error("GraphPool: this build has no CUDA kernels (KILN_CUDA)"); }

bool CapturedGraph::available() { return false; }

CapturedGraph::CapturedGraph(torch::Device, const GraphPool&, const std::function<void()>&) {
  throw std::logic_error("CapturedGraph: this build has no CUDA kernels (KILN_CUDA)");
}

void CapturedGraph::replay() { throw std::logic_error("CapturedGraph: this build has no CUDA kernels (KILN_CUDA)"); }

bool CapturedGraph::capturing(torch::Device) { return false; }
#endif

CapturedGraph::~CapturedGraph() = default;

}  // namespace kiln::kernels
