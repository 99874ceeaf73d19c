#pragma once
// Host entry points of the Hopper grouped GEMM (kernels/grouped_gemm_sm90.cuh, instantiated per
// operand layout and tile in generated translation units; kernels/CMakeLists.txt). Torch-free:
// kernels/grouped_gemm.cpp checks the tensors and fills GroupedGemmArgs.
//
// Legend: G groups (experts); offs [G] int32 on the device, the end of each group along the
// ragged dim (cumulative counts; group g spans [offs[g-1], offs[g]), offs[-1] = 0).
//   ragged M: d[rows of g] = a[rows of g] @ b_g        a [M, K], b_g [K, N] (b: G matrices), d [M, N]
//   ragged K: d_g = a[:, cols of g] @ b[rows of g]     a [M, Ktot], b [Ktot, N], d [G, M, N]
// bf16 operands and output, fp32 accumulation (one rounding per output element).
#include <cstddef>
#include <cstdint>

#include "kernels/grouped_gemm_tiles.hpp"

namespace kiln::kernels::cuda {

using kernels::GroupedLayout;
using kernels::GroupedTile;

enum class GroupedMode { kRaggedM, kRaggedK };

struct GroupedGemmArgs {
  GroupedMode mode = GroupedMode::kRaggedM;
  int groups = 0;
  const int32_t* offs = nullptr;  ///< [G] end offsets along the ragged dim, device
  const void* a = nullptr;        ///< bf16
  const void* b = nullptr;        ///< bf16
  void* d = nullptr;              ///< bf16
  int64_t M = 0, N = 0, K = 0;    ///< ragged M: K, N fixed (M = total rows); ragged K: M, N fixed
  int64_t lda = 0, ldb = 0;       ///< leading dims (elements) of A's and B's storage
  int64_t b_group_stride = 0;     ///< ragged M: elements from b_g to b_{g+1}
  int sm_count = 0;
  void* stream = nullptr;  ///< cudaStream_t
};

/// Device memory for the call's argument arrays and CUTLASS workspace: (bytes, ctx) -> pointer
/// valid until the work queued on args.stream is done (a stream-ordered allocator).
using GroupedAlloc = void* (*)(size_t bytes, void* ctx);

/// Queues the grouped GEMM on args.stream. Returns false when (layout, tile) is not compiled
/// into this build; throws std::runtime_error when CUTLASS refuses the problem or the launch fails.
bool grouped_gemm_run(GroupedLayout layout, GroupedTile tile, const GroupedGemmArgs& args, GroupedAlloc alloc,
                      void* alloc_ctx);

/// Whether (layout, tile) is compiled into this build.
bool grouped_gemm_compiled(GroupedLayout layout, GroupedTile tile);

/// Ragged K only: zeroes d_g of every group with no columns (offs[g] == offs[g-1]), which the
/// GEMM does not write. d: [G, M, N] bf16 contiguous.
void grouped_zero_empty(const int32_t* offs, int groups, void* d, int64_t mn, void* stream);

}  // namespace kiln::kernels::cuda
