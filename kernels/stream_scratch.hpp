#pragma once
// Stream-ordered device scratch for the CUTLASS host entries' `alloc(bytes, ctx)` callbacks
// (kernels/grouped_gemm_cuda.hpp, kernels/lm_head_cuda.hpp): each block is a tensor from the
// caching allocator, which hands a freed block to later work on the same stream only, so the
// blocks can go (with this object) once the work using them is queued.
#include <ATen/ATen.h>

#include <cstddef>
#include <vector>

namespace kiln::kernels {

struct StreamScratch {
  explicit StreamScratch(at::Device d) : device(d) {}
  at::Device device;
  std::vector<at::Tensor> blocks;
  /// The callback: ctx is a StreamScratch*; 0 bytes gives nullptr.
  static void* alloc(size_t bytes, void* ctx) {
    if (bytes == 0) return nullptr;
    auto* self = static_cast<StreamScratch*>(ctx);
    self->blocks.push_back(at::empty({int64_t(bytes)}, at::TensorOptions().dtype(at::kByte).device(self->device)));
    return self->blocks.back().data_ptr();
  }
};

}  // namespace kiln::kernels
