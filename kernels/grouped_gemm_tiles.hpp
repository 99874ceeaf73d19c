#pragma once
// The operand layouts and tiles of kiln's grouped GEMM (kernels/grouped_gemm.hpp), without
// LibTorch: also included by the CUDA translation units (kernels/grouped_gemm_cuda.hpp).
namespace kiln::kernels {

/// Storage of A and B. A row-major: its K dim contiguous; column-major: its M dim. B row-major:
/// its N dim contiguous; column-major: its K dim. The output is row-major.
/// kRowCol: a layer's forward (x times w[e]^T); kRowRow: its input gradient (dy times w[e]);
/// kColRow: its weight gradient (dy^T times x, ragged K).
enum class GroupedLayout { kRowCol, kRowRow, kColRow };

/// CTA tile (M x N x K), cluster and schedule of CUTLASS's sm90 pointer-array kernels
/// (cooperative: two consumer warp groups on one tile; pingpong: each warp group its own tile,
/// one's epilogue overlapping the other's main loop). kCoop128x256 is what at::_grouped_mm
/// runs at the experts' sizes, kPong64x128 its choice for small ones; kCoop256x128N2 the shape
/// and cluster (1x2: the A tile multicast to two CTAs along N) of cuBLAS's dense kernels at
/// these widths, kPong128x128N2 and kCoop128x256N2 the cluster 1x2 forms of the others.
enum class GroupedTile {
  kCoop128x256,
  kCoop128x128,
  kPong64x128,
  kPong128x128,
  kPong64x256,
  kCoop256x128N2,
  kPong128x128N2,
  kCoop128x256N2
};
inline constexpr int kGroupedTileCount = 8;
const char* grouped_tile_name(GroupedTile tile);
/// The tile's key in KILN_GROUPED_GEMM_TILES ("coop128x256", ...).
const char* grouped_tile_key(GroupedTile tile);
/// Reads KILN_GROUPED_GEMM_TILES now (kernels::parse_grouped_tiles, kernels/grouped_gemm.hpp),
/// which the MoE otherwise reads at its first grouped GEMM on a Hopper GPU: the `kiln` command
/// calls it before any work, so a malformed value is refused on every machine. Throws
/// std::invalid_argument naming the value and what is wrong.
void check_grouped_gemm_environment();
}  // namespace kiln::kernels
