// The registry of kernels/grouped_gemm_cuda.hpp: which (layout, tile) instantiations this build
// has (the generated list grouped_gemm_instances.inc, kernels/CMakeLists.txt), and the kernel
// that zeroes the outputs of empty groups. No CUTLASS here: each instantiation is its own
// generated translation unit over kernels/grouped_gemm_sm90.cuh.
#include <cuda_bf16.h>

#include <stdexcept>
#include <string>

#include "kernels/grouped_gemm_cuda.hpp"

namespace kiln::kernels::cuda {

namespace gg {
#define KILN_GG_INSTANCE(LAYOUT, TILE) void run_##LAYOUT##_##TILE(const GroupedGemmArgs&, GroupedAlloc, void*);
#include "grouped_gemm_instances.inc"
#undef KILN_GG_INSTANCE
}  // namespace gg

namespace {
using RunFn = void (*)(const GroupedGemmArgs&, GroupedAlloc, void*);
RunFn find(GroupedLayout layout, GroupedTile tile) {
#define KILN_GG_INSTANCE(LAYOUT, TILE) \
  if (layout == GroupedLayout::LAYOUT && tile == GroupedTile::TILE) return &gg::run_##LAYOUT##_##TILE;
#include "grouped_gemm_instances.inc"
#undef KILN_GG_INSTANCE
  return nullptr;
}

__global__ void zero_empty_groups(const int32_t* offs, int64_t mn, __nv_bfloat16* d) {
  const int g = blockIdx.y;
  const int64_t start = g == 0 ? 0 : offs[g - 1];
  if (offs[g] > start) return;
  auto* dg = reinterpret_cast<uint4*>(d + int64_t(g) * mn);  // mn % 8 == 0: 16-byte stores
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < mn / 8; i += int64_t(gridDim.x) * blockDim.x)
    dg[i] = make_uint4(0, 0, 0, 0);
}
}  // namespace

bool grouped_gemm_compiled(GroupedLayout layout, GroupedTile tile) { return find(layout, tile) != nullptr; }

bool grouped_gemm_run(GroupedLayout layout, GroupedTile tile, const GroupedGemmArgs& args, GroupedAlloc alloc,
                      void* alloc_ctx) {
  RunFn f = find(layout, tile);
  if (!f) return false;
  f(args, alloc, alloc_ctx);
  return true;
}

void grouped_zero_empty(const int32_t* offs, int groups, void* d, int64_t mn, void* stream) {
  if (groups == 0 || mn == 0) return;
  if (mn % 8 != 0) throw std::invalid_argument("grouped_zero_empty: M * N must be a multiple of 8");
  zero_empty_groups<<<dim3(64, groups), 256, 0, static_cast<cudaStream_t>(stream)>>>(offs, mn, static_cast<__nv_bfloat16*>(d));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("grouped_zero_empty: launch failed: ") + cudaGetErrorString(e));
}

}  // namespace kiln::kernels::cuda
