#pragma once
// The log-prob head's logits and their row statistics in one Hopper GEMM (kernels/lm_head.hpp):
// CUTLASS 3's sm90 GEMM (TMA loads, warp-specialized WGMMA; NVIDIA CUTLASS,
// examples/49_hopper_gemm_with_collective_builder) in two schedules, one translation unit each:
//   cooperative (kernels/lm_head_sm90.cu):         128x256x64 tiles, both consumer warp groups on
//                                                  one tile, the epilogue after the mainloop;
//   pingpong    (kernels/lm_head_sm90_pingpong.cu): 128x128x64 tiles, one per consumer warp group,
//                                                  one group's epilogue under the other's mainloop;
// cluster 1x2 in both. Its epilogue
// visitor tree (CUTLASS's EVT, examples/49 and cutlass/epilogue/fusion) stores bf16(acc) and
// reduces every row twice as an online softmax's normalizer (Milakov & Gimelshein 2018): each
// value x enters as (m, s) = (x, 1), two statistics merge as (max, s_a e^(m_a - max) + s_b e^(m_b - max)),
// and the result is m + log s:
//   lse      = logsumexp over v of acc[t, v]                 (the fp32 accumulators)
//   kept_lse = logsumexp over v of float(bf16(acc[t, v]))    (the logits stored)
// Each CTA reduces its tile's rows (registers, warp shuffles, shared memory) and writes one
// partial per row and tile (Sm90ColReduction over (m, s) pairs, without its FinalReduction); a
// second kernel merges each row's partials, many rows and tile columns at once. The merge is associative and commutative up to rounding, with identity
// (-inf, 0); s stays in the linear domain, so small terms add as in kernels/logprobs.cu's pass
// (a running logsumexp in fp32 would drop every term below half a unit of its last place).
// No LibTorch here: compile time.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/lm_head_cuda.hpp"

namespace kiln::kernels::cuda {
// A row's running softmax statistics over the values seen: their max m and sum_v exp(x_v - m) s
// (s in the linear domain, as an online softmax keeps it: a log-domain running sum would lose
// every term below half a unit in the last place of the logsumexp). Empty: {-inf, 0}.
struct alignas(8) MaxSum {
  float m, s;
  MaxSum() = default;
  CUTLASS_HOST_DEVICE MaxSum(float max, float sum) : m(max), s(sum) {}
  // CUTLASS's default reduction identity is ElementCompute(0); kiln passes its own, {-inf, 0}.
  // int only: a bf16 or float reaching it through an implicit conversion would become the empty
  // value (a value enters by the NumericConverter specializations below, or fails to compile).
  template <class I, std::enable_if_t<std::is_same_v<I, int>, int> = 0>
  CUTLASS_HOST_DEVICE explicit MaxSum(I) : m(-std::numeric_limits<float>::infinity()), s(0.f) {}
};
}  // namespace kiln::kernels::cuda

namespace cutlass {
// A value enters a row's statistics as {x, 1}; the statistics leave as their logsumexp m + log s.
template <FloatRoundStyle Round>
struct NumericConverter<kiln::kernels::cuda::MaxSum, float, Round> {
  using result_type = kiln::kernels::cuda::MaxSum;
  using source_type = float;
  CUTLASS_HOST_DEVICE static result_type convert(source_type const& x) { return {x, 1.f}; }
  CUTLASS_HOST_DEVICE result_type operator()(source_type const& x) const { return convert(x); }
};
// The outer reduction's input: the bf16 logits the epilogue stores.
template <FloatRoundStyle Round>
struct NumericConverter<kiln::kernels::cuda::MaxSum, cutlass::bfloat16_t, Round> {
  using result_type = kiln::kernels::cuda::MaxSum;
  using source_type = cutlass::bfloat16_t;
  CUTLASS_HOST_DEVICE static result_type convert(source_type const& x) { return {float(x), 1.f}; }
  CUTLASS_HOST_DEVICE result_type operator()(source_type const& x) const { return convert(x); }
};
template <FloatRoundStyle Round>
struct NumericConverter<float, kiln::kernels::cuda::MaxSum, Round> {
  using result_type = float;
  using source_type = kiln::kernels::cuda::MaxSum;
  CUTLASS_HOST_DEVICE static result_type convert(source_type const& x) {
#ifdef __CUDA_ARCH__
    return x.m + logf(x.s);
#else
    return x.m + std::log(x.s);
#endif
  }
  CUTLASS_HOST_DEVICE result_type operator()(source_type const& x) const { return convert(x); }
};
}  // namespace cutlass

namespace kiln::kernels::cuda::lm_head_sm90 {
using namespace cute;

CUTLASS_HOST_DEVICE float exp_of(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return std::exp(x);
#endif
}

// Two rows' statistics merged: max, and each sum rescaled to it (Milakov & Gimelshein 2018,
// "Online normalizer calculation for softmax").
template <class T>
struct MergeMaxSum;
template <>
struct MergeMaxSum<MaxSum> {
  CUTLASS_HOST_DEVICE MaxSum operator()(MaxSum a, MaxSum b) const {
    if (a.m < b.m) {  // b's max is the larger: rescale a's sum (an empty a adds exp(-inf) = 0)
      const MaxSum t = a;
      a = b, b = t;
    }
    if (b.s == 0.f) return a;  // empty b (also when both are empty: no -inf - -inf)
    return {a.m, a.s + b.s * exp_of(b.m - a.m)};
  }
};
// Element by element over the fragments the reduction's shuffle and shared-memory stages pass.
template <int N>
struct MergeMaxSum<cutlass::Array<MaxSum, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<MaxSum, N> operator()(cutlass::Array<MaxSum, N> const& a,
                                                           cutlass::Array<MaxSum, N> const& b) const {
    cutlass::Array<MaxSum, N> r;
    MergeMaxSum<MaxSum> f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) r[i] = f(a[i], b[i]);
    return r;
  }
};

using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // hidden [N, D]
using LayoutB = cutlass::layout::ColumnMajor;  // weight [V, D] as a D x V matrix
using LayoutD = cutlass::layout::RowMajor;     // logits [N, V]
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// A packed row-major [rows, cols] operand's (row, 1, batch) stride (what CUTLASS's
// tools/util make_cute_packed_stride gives; the bundled headers are include/ only).
template <class Stride>
Stride packed(int rows, int cols) {
  Stride s{};
  cute::get<0>(s) = cols;
  cute::get<2>(s) = int64_t(rows) * cols;
  return s;
}

inline void check(cutlass::Status s, const char* what) {
  if (s != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("lm_head_logits_lse: CUTLASS ") + what + " failed: " +
                             cutlassGetStatusString(s));
}

// Each tile's row statistics, written by the GEMM's epilogue: pair [n_tiles, m_pad] (row-major:
// tile column j's partial of row r at j * m_pad + r; m_pad = the rows rounded up to the tile's),
// for merge_row_partials (kernels/lm_head_sm90.cu) to reduce over the tile columns. CUTLASS's own
// cross-tile stage (FinalReduction) leaves that to the last CTA of each row block, one thread per
// row merging all the tile columns' partials serially (at V = 154880 ~600 per row, twice) while
// that SM takes no other tile: with it, the fused head's first H100 run was slower than cuBLAS
// plus kiln's pass, the more so with half-width tiles (docs/benchmarks.md).
struct Partials {
  MaxSum *lse = nullptr, *kept = nullptr;  // over the fp32 accumulators, over the bf16 values
  int n_tiles = 0;
  int64_t m_pad = 0;
};

// The GEMM with the fused epilogue for one tile shape, cluster and kernel schedule (the
// epilogue's schedule matches it: cooperative with cooperative, pingpong with plain TMA
// warp-specialized). Queues it on a.stream; the partials live in memory from alloc.
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
Partials run(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx) {
  namespace ef = cutlass::epilogue::fusion;
  // One pair per row and tile (M-major, no N stride), the cross-tile merge left to the caller.
  using RowMaxSum = ef::Sm90ColReduction<MergeMaxSum, MergeMaxSum, MergeMaxSum, 0, TileShape, float, MaxSum, kRound,
                                         Stride<_1, _0, int64_t>, 4, /*EnableNullptr=*/false,
                                         /*FinalReduction=*/false, /*VisitCheckOOB=*/true>;
  using ToBf16 = ef::Sm90Compute<cutlass::epilogue::thread::Identity, Element, float, kRound>;
  // kept (over the bf16 values) <- bf16(acc) <- lse (over acc) <- acc; D stores the bf16 values.
  using Fusion = ef::Sm90EVT<RowMaxSum, ef::Sm90EVT<ToBf16, ef::Sm90EVT<RowMaxSum, ef::Sm90AccFetch>>>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, Element, LayoutD, 8,
      EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  constexpr int kTileM = cute::size<0>(TileShape{}), kTileN = cute::size<1>(TileShape{});

  const int M = int(a.N), N = int(a.V), K = int(a.D);
  Partials p;
  p.n_tiles = int((int64_t(N) + kTileN - 1) / kTileN);
  p.m_pad = (int64_t(M) + kTileM - 1) / kTileM * kTileM;
  const size_t pair_bytes = size_t(p.n_tiles) * size_t(p.m_pad) * sizeof(MaxSum);
  p.lse = static_cast<MaxSum*>(alloc(pair_bytes, alloc_ctx));
  p.kept = static_cast<MaxSum*>(alloc(pair_bytes, alloc_ctx));

  const auto sa = packed<typename Kernel::StrideA>(M, K), sb = packed<typename Kernel::StrideB>(N, K);
  const auto sd = packed<typename Kernel::StrideD>(M, N);
  const MaxSum identity{-std::numeric_limits<float>::infinity(), 0.f};
  const Stride<_1, _0, int64_t> per_row{_1{}, _0{}, int64_t(M)};
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, 1},
                                {static_cast<const Element*>(a.hidden), sa, static_cast<const Element*>(a.weight), sb},
                                {{}, nullptr, sd, static_cast<Element*>(a.logits), sd}};
  // Children first, then the node: {{{acc, lse}, to_bf16}, kept}.
  args.epilogue.thread = {{{{}, {p.lse, identity, per_row}}, {}}, {p.kept, identity, per_row}};
  args.hw_info.sm_count = a.sm_count;
  Gemm gemm;
  check(gemm.can_implement(args), "can_implement");
  const size_t bytes = Gemm::get_workspace_size(args);
  void* workspace = bytes ? alloc(bytes, alloc_ctx) : nullptr;
  auto stream = static_cast<cudaStream_t>(a.stream);
  check(gemm.initialize(args, workspace, stream), "initialize");
  check(gemm.run(stream), "run");
  return p;
}

// The two instantiations, one translation unit each (they compile in parallel):
// kernels/lm_head_sm90.cu and kernels/lm_head_sm90_pingpong.cu.
Partials run_cooperative(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx);
Partials run_pingpong(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx);

}  // namespace kiln::kernels::cuda::lm_head_sm90
