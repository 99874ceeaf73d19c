#pragma once
// The Hopper grouped GEMM of kernels/grouped_gemm_cuda.hpp: CUTLASS 3's sm90 pointer-array
// kernels (TMA loads, warp-specialized WGMMA, persistent group tile scheduler; NVIDIA CUTLASS,
// examples/57_hopper_grouped_gemm), with kiln's own per-group argument kernel reading the
// offsets on the device (no host sync). Included by the generated translation units
// (kernels/CMakeLists.txt), each one KILN_GG_DEFINE(layout, tile) compiled for sm_90a. No
// LibTorch here: compile time.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/grouped_gemm_cuda.hpp"

namespace kiln::kernels::cuda::gg {

using namespace cute;

// CTA tile M x N x K, cluster M x N, and the schedule (pingpong or cooperative).
template <int M, int N, int K, int ClusterM, bool Pingpong, int ClusterN = 1>
struct TileDef {
  using Tile = Shape<Int<M>, Int<N>, Int<K>>;
  using Cluster = Shape<Int<ClusterM>, Int<ClusterN>, _1>;
  using Kernel = std::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using Epilogue = std::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};
template <GroupedTile T>
struct TileCfg;
template <>
struct TileCfg<GroupedTile::kCoop128x256> : TileDef<128, 256, 64, 2, false> {};
template <>
struct TileCfg<GroupedTile::kCoop128x128> : TileDef<128, 128, 64, 2, false> {};
template <>
struct TileCfg<GroupedTile::kPong64x128> : TileDef<64, 128, 128, 2, true> {};
template <>
struct TileCfg<GroupedTile::kPong128x128> : TileDef<128, 128, 64, 1, true> {};
template <>
struct TileCfg<GroupedTile::kPong64x256> : TileDef<64, 256, 64, 1, true> {};
template <>
struct TileCfg<GroupedTile::kCoop256x128N2> : TileDef<256, 128, 64, 1, false, 2> {};
template <>
struct TileCfg<GroupedTile::kPong128x128N2> : TileDef<128, 128, 64, 1, true, 2> {};
template <>
struct TileCfg<GroupedTile::kCoop128x256N2> : TileDef<128, 256, 64, 1, false, 2> {};

template <GroupedLayout L>
struct LayoutCfg;
template <>
struct LayoutCfg<GroupedLayout::kRowCol> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct LayoutCfg<GroupedLayout::kRowRow> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct LayoutCfg<GroupedLayout::kColRow> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

template <GroupedLayout L, GroupedTile T>
struct Gemm {
  using E = cutlass::bfloat16_t;
  using Cfg = TileCfg<T>;
  static constexpr int kAlign = 8;  // 16 bytes of bf16
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int32_t, int32_t, int32_t>>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, E, cutlass::layout::RowMajor*, kAlign, E,
      cutlass::layout::RowMajor*, kAlign, typename Cfg::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<E, float>>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, typename LayoutCfg<L>::A*, kAlign, E,
      typename LayoutCfg<L>::B*, kAlign, float, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      typename Cfg::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Main, Epi>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// A cute stride with one dynamic mode (the leading dim) and the other unit/zero.
template <class S>
__host__ __device__ S leading_stride(int64_t ld) {
  S s{};
  using M0 = std::decay_t<decltype(get<0>(s))>;
  if constexpr (cute::is_static<M0>::value) {
    get<1>(s) = ld;
  } else {
    get<0>(s) = ld;
  }
  return s;
}

// One thread per group: the group's span from the offsets, then its operand pointers, strides
// and problem shape. Ragged K with an empty span: M = 0 (no tiles; grouped_zero_empty writes d_g).
template <class G>
__global__ void prepare_groups(GroupedGemmArgs p, const typename G::E** pa, const typename G::E** pb,
                               typename G::E** pd, typename G::StrideA* sa, typename G::StrideB* sb,
                               typename G::StrideD* sd, typename G::Shape3* shapes) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.groups) return;
  const int64_t start = g == 0 ? 0 : p.offs[g - 1], end = p.offs[g];
  const int64_t len = end > start ? end - start : 0;
  const auto* a = static_cast<const typename G::E*>(p.a);
  const auto* b = static_cast<const typename G::E*>(p.b);
  auto* d = static_cast<typename G::E*>(p.d);
  int64_t m, n = p.N, k;
  if (p.mode == GroupedMode::kRaggedM) {
    m = len;
    k = p.K;
    pa[g] = a + start * p.lda;  // A row-major: rows of the group
    pb[g] = b + g * p.b_group_stride;
    pd[g] = d + start * p.N;
  } else {
    m = len > 0 ? p.M : 0;
    k = len;
    pa[g] = a + start * p.lda;  // A column-major: columns of the group
    pb[g] = b + start * p.ldb;  // B row-major: rows of the group
    pd[g] = d + int64_t(g) * p.M * p.N;
  }
  sa[g] = leading_stride<typename G::StrideA>(p.lda);
  sb[g] = leading_stride<typename G::StrideB>(p.ldb);
  sd[g] = leading_stride<typename G::StrideD>(p.N);
  shapes[g] = make_shape(int32_t(m), int32_t(n), int32_t(k));
}

inline size_t align_up(size_t x) { return (x + 127) / 128 * 128; }

template <GroupedLayout L, GroupedTile T>
void run(const GroupedGemmArgs& p, GroupedAlloc alloc, void* ctx) {
  using G = Gemm<L, T>;
  using E = typename G::E;
  const int n = p.groups;
  auto stream = static_cast<cudaStream_t>(p.stream);
  const size_t ptr_bytes = align_up(sizeof(void*) * n), sa_bytes = align_up(sizeof(typename G::StrideA) * n),
               sb_bytes = align_up(sizeof(typename G::StrideB) * n), sd_bytes = align_up(sizeof(typename G::StrideD) * n),
               shape_bytes = align_up(sizeof(typename G::Shape3) * n);
  auto* buf = static_cast<char*>(alloc(3 * ptr_bytes + sa_bytes + sb_bytes + sd_bytes + shape_bytes, ctx));
  auto** pa = reinterpret_cast<const E**>(buf);
  auto** pb = reinterpret_cast<const E**>(buf + ptr_bytes);
  auto** pd = reinterpret_cast<E**>(buf + 2 * ptr_bytes);
  auto* sa = reinterpret_cast<typename G::StrideA*>(buf + 3 * ptr_bytes);
  auto* sb = reinterpret_cast<typename G::StrideB*>(buf + 3 * ptr_bytes + sa_bytes);
  auto* sd = reinterpret_cast<typename G::StrideD*>(buf + 3 * ptr_bytes + sa_bytes + sb_bytes);
  auto* shapes = reinterpret_cast<typename G::Shape3*>(buf + 3 * ptr_bytes + sa_bytes + sb_bytes + sd_bytes);
  prepare_groups<G><<<(n + 127) / 128, 128, 0, stream>>>(p, pa, pb, pd, sa, sb, sd, shapes);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("grouped_gemm: argument kernel launch failed: ") + cudaGetErrorString(e));

  typename G::Adapter::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                      {n, shapes, nullptr},
                                      {pa, sa, pb, sb},
                                      {{}, const_cast<const E**>(pd), sd, pd, sd}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.hw_info.sm_count = p.sm_count;
  typename G::Adapter gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    throw std::runtime_error("grouped_gemm: CUTLASS cannot implement this problem (" +
                             std::string(grouped_tile_name(T)) + ")");
  void* ws = alloc(G::Adapter::get_workspace_size(args), ctx);
  if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess)
    throw std::runtime_error("grouped_gemm: CUTLASS initialize failed");
  if (auto s = gemm.run(stream); s != cutlass::Status::kSuccess)
    throw std::runtime_error("grouped_gemm: CUTLASS run failed: " + std::string(cutlassGetStatusString(s)));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("grouped_gemm: launch failed: ") + cudaGetErrorString(e));
}

}  // namespace kiln::kernels::cuda::gg

// What a generated translation unit defines: one (layout, tile) instantiation behind a plain
// function the registry (grouped_gemm.cu) lists.
#define KILN_GG_DEFINE(LAYOUT, TILE)                                                                        \
  namespace kiln::kernels::cuda::gg {                                                                      \
  void run_##LAYOUT##_##TILE(const GroupedGemmArgs& p, GroupedAlloc alloc, void* ctx) {                    \
    run<GroupedLayout::LAYOUT, GroupedTile::TILE>(p, alloc, ctx);                                          \
  }                                                                                                        \
  }
