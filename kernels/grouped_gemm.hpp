#pragma once
// kiln's grouped GEMM for the routed experts on Hopper: CUTLASS 3's sm90 pointer-array kernels
// (TMA, warp-specialized WGMMA, persistent group scheduler) with kiln's choice of tile per
// operand layout and kiln's per-group argument kernel (offsets read on the device, no host sync);
// kernels/grouped_gemm_sm90.cuh. Same results as at::_grouped_mm (the same fp32 accumulation,
// one bf16 rounding per output element; the order of the K sum may differ with the tile).
//
// Legend: E experts (groups), M rows in expert order, K input width, N output width.
// offs: [E] int32 on the GPU, the end row of each expert (cumsum of the counts); an expert may
// have no rows.
//
// grouped_linear(x, w, offs): y[rows of e] = x[rows of e] @ w[e]^T, F.linear per expert.
//   x [M, K] bf16 (row-major), w [E, N, K] bf16 (HF's [out, in] per expert, contiguous) -> y [M, N].
//   Differentiable in x and w: dx = dy @ w[e] per expert (ragged M), dw[e] = dy_e^T x_e (ragged
//   K, written in w's [E, N, K] layout; an expert without rows gets zeros).
//   Needs grouped_linear_available(x, w); throws c10::Error naming the shape, dtype or layout
//   that does not fit, std::runtime_error when CUTLASS refuses the problem or a launch fails.
// grouped_mm_ragged_m(a, b, offs, tile): a [M, K] row-major, b [E, K, N] with each b[e]
//   row-major (N contiguous) or column-major (K contiguous) -> [M, N].
// grouped_mm_ragged_k(a, b, offs, tile): a [M, Ktot] column-major (a.t() of a row-major
//   [Ktot, M]), b [Ktot, N] row-major -> [E, M, N]; offs split Ktot.
//   Every width and leading dim a multiple of 8 (16-byte TMA rows), pointers 16-byte aligned.
#include <ATen/core/Tensor.h>

#include <array>
#include <optional>

#include "kernels/grouped_gemm_tiles.hpp"

namespace kiln::kernels {

/// A KILN_GROUPED_GEMM_TILES value parsed (what grouped_default_tile, grouped_linear_chosen and
/// grouped_linear_chosen_for read from the environment, once): null or "" -> the MoE on
/// at::_grouped_mm, the build's tiles for grouped_linear; "aten" -> grouped_linear unavailable;
/// "cutlass" -> the MoE on kiln's kernels with the build's tiles; "FWD,DX,DW" -> with these, each
/// a tile key below or "aten" (that form on at::_grouped_mm). Throws c10::Error naming the value
/// and what is wrong (unknown key, not three, a tile this build did not compile).
struct GroupedTileChoice {
  bool aten = false;                     ///< "aten": grouped_linear unavailable
  bool chosen = false;                   ///< "cutlass" or three forms: the MoE takes grouped_linear
  std::array<GroupedTile, 3> tiles{};    ///< by GroupedLayout
  std::array<bool, 3> form_aten{};       ///< by GroupedLayout: that form on at::_grouped_mm
};
GroupedTileChoice parse_grouped_tiles(const char* value);

/// The tile grouped_linear uses for each layout: the build's (KILN_GG_TILE_* in
/// kernels/CMakeLists.txt, chosen by tests/bench/bench_grouped_gemm.cpp on the H200;
/// docs/benchmarks.md), or KILN_GROUPED_GEMM_TILES="FWD,DX,DW" from the environment, each one of
/// coop128x256, coop128x128, pong64x128, pong128x128, pong64x256, coop256x128n2, pong128x128n2,
/// coop128x256n2 (grouped_tile_key) or aten (that form keeps
/// at::_grouped_mm, e.g. "aten,aten,pong128x128": kiln's kernel for the weight gradient only),
/// "cutlass" (the build's), or "aten" (grouped_linear unavailable); read once; a malformed value,
/// or a tile this build did not compile for its layout, throws c10::Error naming it.
GroupedTile grouped_default_tile(GroupedLayout layout);
/// Whether the MoE's experts (grouped_swiglu) take grouped_linear where it is available:
/// KILN_GROUPED_GEMM_TILES = "cutlass" (the build's tiles) or three tiles. Unset: no, they run
/// at::_grouped_mm (on the H200 kiln's kernels gave the same step time, and each MoE layer's
/// forward+backward ~4% slower: docs/benchmarks.md, 2026-12-05).
bool grouped_linear_chosen();
/// grouped_linear_chosen() and the layout's form not given as "aten" in KILN_GROUPED_GEMM_TILES:
/// whether the MoE's GEMMs of that form (kernels::GroupedLayout) run kiln's kernel.
bool grouped_linear_chosen_for(GroupedLayout layout);
/// Whether this build has kiln's grouped GEMM for (layout, tile) (CUDA, CUTLASS found).
bool grouped_gemm_compiled(GroupedLayout layout, GroupedTile tile);

/// True when grouped_linear runs kiln's kernels for these tensors: a build with them, a Hopper
/// GPU (compute capability 9.x), bf16, K and N multiples of 8.
bool grouped_linear_available(const at::Tensor& x_MK, const at::Tensor& w_ENK);
at::Tensor grouped_linear(const at::Tensor& x_MK, const at::Tensor& w_ENK, const at::Tensor& offs_E);

at::Tensor grouped_mm_ragged_m(const at::Tensor& a_MK, const at::Tensor& b_EKN, const at::Tensor& offs_E,
                               std::optional<GroupedTile> tile = std::nullopt);
at::Tensor grouped_mm_ragged_k(const at::Tensor& a_MK, const at::Tensor& b_KN, const at::Tensor& offs_E,
                               std::optional<GroupedTile> tile = std::nullopt);

}  // namespace kiln::kernels
