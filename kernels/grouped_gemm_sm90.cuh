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

// CTA tile M x N x K, cluster along M, the schedule (pingpong or cooperative), and whether each
// group's TMA descriptors are built before the GEMM (PrebuiltMainloop / PrebuiltEpilogue below).
template <int M, int N, int K, int ClusterM, bool Pingpong, bool Prebuilt_ = false>
struct TileDef {
  static constexpr bool Prebuilt = Prebuilt_;
  using Tile = Shape<Int<M>, Int<N>, Int<K>>;
  using Cluster = Shape<Int<ClusterM>, _1, _1>;
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
struct TileCfg<GroupedTile::kPreCoop128x256> : TileDef<128, 256, 64, 2, false, true> {};
template <>
struct TileCfg<GroupedTile::kPrePong128x128> : TileDef<128, 128, 64, 1, true, true> {};

// Per-group TMA descriptors built before the GEMM. CUTLASS's pointer-array kernels keep one
// descriptor per operand per SM in global memory and rewrite it whenever a CTA's next tile
// belongs to another group: the producer warp edits a shared-memory copy, copies it out and
// fences it (tensormap.cp_fenceproxy release, then acquire) before that tile's first load, and a
// consumer warp group first waits for all its TMA stores to land before the output's descriptor
// may change. The persistent scheduler hands a CTA tiles ~SM-count apart, so at the experts'
// sizes (48-192 tiles a group) nearly every tile switches group. Here a kernel before the GEMM
// (build_group_descriptors) writes every group's descriptors once, from the same templates and
// with the same edits; the GEMM then only points its loads and stores at group g's and acquires
// it (tma_descriptor_fence_acquire) when the group changes. The kernels (CUTLASS's) are unchanged.
template <class Base>
struct PrebuiltMainloop : Base {
  using Arguments = typename Base::Arguments;
  using TensorMapStorage = typename Base::TensorMapStorage;
  using TensorStorage = typename Base::TensorStorage;
  /// Base's, with the group count: A's descriptors at tensormaps[0, G), B's at [G, 2G).
  struct Params : Base::Params {
    int32_t groups = 0;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shapes, Arguments const& args, void* workspace) {
    return Params{Base::to_underlying_arguments(shapes, args, workspace), shapes.groups()};
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& shapes, Arguments const&, int) {
    return 2 * sizeof(cute::TmaDescriptor) * size_t(shapes.groups());
  }
  int32_t group_ = 0;   // the group of the producer's next loads (tensormaps_perform_update)
  int32_t groups_ = 0;  // G (tensormaps_init)

  CUTLASS_DEVICE auto tensormaps_init(Params const& p, TensorMapStorage&, int32_t, int32_t) {
    auto* d = reinterpret_cast<cute::TmaDescriptor*>(p.tensormaps);
    groups_ = p.groups;
    return cute::make_tuple(d, d + p.groups);
  }
  template <class MapA, class MapB, class ProblemShape>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, Params const&, cute::tuple<MapA, MapB> const&,
                                                ProblemShape, int32_t next_group) {
    group_ = next_group;
  }
  template <class MapA, class MapB>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, cute::tuple<MapA, MapB> const&) {}
  template <class MapA, class MapB>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::tuple<MapA, MapB> const& maps) {
    if (group_ < 0 || group_ >= groups_) return;  // no work tile: no load follows
    cute::tma_descriptor_fence_acquire(get<0>(maps) + group_);
    cute::tma_descriptor_fence_acquire(get<1>(maps) + group_);
  }
  template <class TensorA, class TensorB, class MapA, class MapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState smem_pipe_write, cute::tuple<TensorA, TensorB> const& load_inputs,
                           cute::tuple<MapA, MapB> const& maps, BlockCoord const& blk_coord, KTileIterator k_tile_iter,
                           int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    Base::load(p, pipeline, smem_pipe_write, load_inputs, cute::make_tuple(get<0>(maps) + group_, get<1>(maps) + group_),
               blk_coord, k_tile_iter, k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
  }
};

template <class Base>
struct PrebuiltEpilogue : Base {
  using Arguments = typename Base::Arguments;
  using TensorMapStorage = typename Base::TensorMapStorage;
  using TensorStorage = typename Base::TensorStorage;
  /// Base's (its workspace after the groups' output descriptors), with those: group g's at group_d[g].
  struct Params : Base::Params {
    cute::TmaDescriptor* group_d = nullptr;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shapes, Arguments const& args, void* workspace) {
    auto* d = static_cast<cute::TmaDescriptor*>(workspace);
    return Params{Base::to_underlying_arguments(shapes, args, d + shapes.groups()), d};
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& shapes, Arguments const& args, int sm_count) {
    return sizeof(cute::TmaDescriptor) * size_t(shapes.groups()) + Base::get_workspace_size(shapes, args, sm_count);
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const& shapes, Arguments const& args, void* workspace,
                                              cudaStream_t stream, cutlass::CudaHostAdapter* adapter = nullptr) {
    return Base::initialize_workspace(shapes, args, static_cast<cute::TmaDescriptor*>(workspace) + shapes.groups(), stream,
                                      adapter);
  }
  CUTLASS_DEVICE PrebuiltEpilogue(Params const& p, TensorStorage& shared) : Base(p, shared), group_d_(p.group_d) {}

  // The output's descriptor: nothing to edit or fence here (store() points at group g's); the
  // source's (C, read only with beta != 0) as CUTLASS does it.
  template <bool IsLoad, class ProblemShape>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& s, Params const& p, cute::TmaDescriptor const* map,
                                                ProblemShape shape, int32_t next_group, int32_t warp_group) {
    if constexpr (IsLoad) Base::template tensormaps_perform_update<IsLoad>(s, p, map, shape, next_group, warp_group);
  }
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage& s, cute::TmaDescriptor const* map,
                                                  const int32_t warp_group = 0) {
    if constexpr (IsLoad) Base::template tensormaps_cp_fence_release<IsLoad>(s, map, warp_group);
  }
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::TmaDescriptor const* map) {
    if constexpr (IsLoad) Base::template tensormaps_fence_acquire<IsLoad>(map);
  }
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto store(typename Base::LoadPipeline load_pipeline,
                            typename Base::LoadPipelineState load_pipe_consumer_state,
                            typename Base::StorePipeline store_pipeline,
                            typename Base::StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, TensorStorage& shared_tensors, TensorMapD const&,
                            int subtile_idx = -1) {
    const int32_t g = int32_t(get<3>(tile_coord_mnkl));  // the work tile's group (CUTLASS's L index)
    cute::TmaDescriptor* map = group_d_ + g;
    if (g != last_group_) {
      cute::tma_descriptor_fence_acquire(map);
      last_group_ = g;
    }
    return Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                       problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx,
                       shared_tensors, map, subtile_idx);
  }

 private:
  cute::TmaDescriptor* group_d_;
  int32_t last_group_ = -1;
};

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
  using EpiBuilt = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, E, cutlass::layout::RowMajor*, kAlign, E,
      cutlass::layout::RowMajor*, kAlign, typename Cfg::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<E, float>>::CollectiveOp;
  using Epi = std::conditional_t<Cfg::Prebuilt, PrebuiltEpilogue<EpiBuilt>, EpiBuilt>;
  using MainBuilt = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, typename LayoutCfg<L>::A*, kAlign, E,
      typename LayoutCfg<L>::B*, kAlign, float, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      typename Cfg::Kernel>::CollectiveOp;
  using Main = std::conditional_t<Cfg::Prebuilt, PrebuiltMainloop<MainBuilt>, MainBuilt>;
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

// One descriptor of one group: CUTLASS's template (tma's, made on the host for the problem's
// layout) with the group's address, dims and strides, as its pointer-array kernels edit it
// (tensormaps_replace_global_address / _tensor_properties), copied out with the release fence.
// One warp; `smem` 128-byte aligned.
template <class Tma, class Elem, class Stride>
__device__ void build_descriptor(Tma const& tma, cute::TmaDescriptor& smem, cute::TmaDescriptor* out, Elem const* ptr,
                                 int32_t rows, int32_t cols, Stride stride) {
  if (cute::elect_one_sync()) {
    const auto* src = reinterpret_cast<const uint4*>(tma.get_tma_descriptor());
    auto* dst = reinterpret_cast<uint4*>(&smem);
    for (int i = 0; i < int(sizeof(cute::TmaDescriptor) / sizeof(uint4)); ++i) dst[i] = src[i];
    cute::tma_descriptor_replace_addr_in_shared_mem(smem, ptr);
    cute::array<uint32_t, 5> shape = {1, 1, 1, 1, 1};
    cute::array<uint64_t, 5> strides = {0, 0, 0, 0, 0};
    auto t = make_tensor(static_cast<Elem const*>(nullptr), make_layout(make_shape(rows, cols, Int<1>{}), stride));
    cute::detail::fill_tma_gmem_shape_stride(tma, t, shape, strides);
    for (auto& s : strides) s = s * cute::sizeof_bits_v<Elem> / 8;  // bytes
    cute::tma_descriptor_replace_dims_strides_in_shared_mem(smem, shape, strides);
  }
  __syncwarp();
  cute::tma_descriptor_cp_fence_release(out, smem);
}

// Block g: warp 0 A's descriptor, 1 B's, 2 D's, from prepare_groups's arrays; groups without
// tiles (M or K 0) keep none (the scheduler gives them no work).
template <class G>
__global__ void __launch_bounds__(96) build_group_descriptors(
    const __grid_constant__ typename G::Main::Params mp, const __grid_constant__ typename G::Epi::Params ep,
    const typename G::E* const* pa, const typename G::E* const* pb, typename G::E* const* pd,
    const typename G::StrideA* sa, const typename G::StrideB* sb, const typename G::StrideD* sd,
    const typename G::Shape3* shapes) {
  __shared__ alignas(128) cute::TmaDescriptor smem[3];
  const int g = blockIdx.x, warp = threadIdx.x / 32, n = mp.groups;
  const auto shape = shapes[g];
  const int32_t m = get<0>(shape), nn = get<1>(shape), k = get<2>(shape);
  if (m == 0 || k == 0) return;
  auto* maps = reinterpret_cast<cute::TmaDescriptor*>(mp.tensormaps);
  if (warp == 0) build_descriptor(mp.tma_load_a, smem[0], maps + g, pa[g], m, k, sa[g]);
  else if (warp == 1) build_descriptor(mp.tma_load_b, smem[1], maps + n + g, pb[g], nn, k, sb[g]);
  else build_descriptor(ep.tma_store_d, smem[2], ep.group_d + g, pd[g], m, nn, sd[g]);
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
  if constexpr (G::Cfg::Prebuilt) {
    build_group_descriptors<G><<<n, 96, 0, stream>>>(gemm.params().mainloop, gemm.params().epilogue, pa, pb, pd, sa, sb,
                                                     sd, shapes);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      throw std::runtime_error(std::string("grouped_gemm: descriptor kernel launch failed: ") + cudaGetErrorString(e));
  }
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
