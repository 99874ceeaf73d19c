#pragma once
// The log-prob head's probabilities and their row statistics in one Hopper GEMM (kernels/lm_head.hpp):
// CUTLASS 3's sm90 GEMM (TMA loads, warp-specialized WGMMA; NVIDIA CUTLASS,
// examples/49_hopper_gemm_with_collective_builder) in two schedules, one translation unit each:
//   cooperative (kernels/lm_head_sm90.cu):         128x256x64 tiles, both consumer warp groups on
//                                                  one tile, the epilogue after the mainloop (the
//                                                  default: the faster in the H100's training step);
//   pingpong    (kernels/lm_head_sm90_pingpong.cu): 128x128x64 tiles, one per consumer warp group,
//                                                  one group's epilogue under the other's mainloop
//                                                  (the faster GEMM alone on the H200);
// cluster 1x2 in both. The epilogue is one node of CUTLASS's visitor tree (EVT, examples/49 and
// cutlass/epilogue/fusion), kiln's RowSoftmaxStats below: against a reference c[t] per row given
// by the caller it stores probs = bf16(min(exp(acc - c[t]), 2^64)) and sums every row twice:
//   lse      = logsumexp over v of acc[t, v]                 (the fp32 accumulators, as an online
//              softmax's normalizer against a reference of its own: Milakov & Gimelshein 2018)
//   kept_lse = c[t] + log sum_v float(probs[t, v])           (the values stored)
// Each CTA reduces its tile's rows (registers, warp shuffles) and writes one (reference, sum)
// partial per row and tile; a second kernel (merge_row_partials, kernels/lm_head_sm90.cu) merges
// each row's partials, many rows and tile columns at once. The sums stay in the linear domain, so
// small terms add as in kernels/logprobs.cu's pass (a running logsumexp in fp32 would drop every
// term below half a unit of its last place). Why a node of kiln's own: the same GEMM with two of
// CUTLASS's Sm90ColReduction over (max, sum) pairs ran at 467 TFLOP/s where the plain GEMM runs
// at 738 (their per-value merge, a compare, swap and exp per statistic, and the per-value
// out-of-bounds check, ~45 instructions a value); this node, ~13 a value, at 689 (cooperative)
// and 724 (pingpong; cuBLAS 750) at T 1024 on the H200 (tests/bench/lm_head_variants.cu).
// Why probabilities and not logits: the backward's dz = g (onehot - probs exp(c - kept_lse)) is
// then probs scaled by row, which the backward's two GEMMs take as they are (kernels/lm_head.hpp,
// lm_head_probs_backward), with no pass over [N, V] between them.
// No LibTorch here: compile time.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <cfloat>
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
  // The empty value, MaxSum(0) (merge_row_partials' start). int only: a bf16 or float reaching
  // it through an implicit conversion would become the empty value; that fails to compile.
  template <class I, std::enable_if_t<std::is_same_v<I, int>, int> = 0>
  CUTLASS_HOST_DEVICE explicit MaxSum(I) : m(-std::numeric_limits<float>::infinity()), s(0.f) {}
};
}  // namespace kiln::kernels::cuda

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

using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // hidden [N, D]
using LayoutB = cutlass::layout::ColumnMajor;  // weight [V, D] as a D x V matrix
using LayoutD = cutlass::layout::RowMajor;     // probs [N, V]
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// 2^x on the special function unit (ex2.approx.ftz: ~2 ulp; a subnormal result flushes to 0).
CUTLASS_DEVICE float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Two rows' (reference r in log2 units, sum of 2^(x log2 e - r) over the fp32 values) merged onto
// the larger reference; an empty side (r = -inf) adds nothing.
CUTLASS_DEVICE void merge_stats(float& r, float& s, float r2, float s2) {
  if (r2 == -INFINITY) return;
  if (r == -INFINITY) {
    r = r2, s = s2;
    return;
  }
  const float m = fmaxf(r, r2);
  s = s * ex2(r - m) + s2 * ex2(r2 - m), r = m;
}

// The largest probability stored (2^64, e^44.4): a row whose values lie further above its
// reference is clamped there, which the caller sees as lse - c > 44 (kernels/lm_head.hpp).
constexpr float kProbMax = 18446744073709551616.f;

// The epilogue's node for the log-prob head (an EVT node over the accumulators, in place of two
// CUTLASS Sm90ColReductions over MaxSum): per row slot of each thread (the 4 lanes that share a
// row each keep their own) it holds the caller's reference q (nats), a reference r of its own
// (log2 units, never below q log2 e - 64) with f = 2^(r - q log2 e), and two sums,
//   s = sum_v 2^(acc_v log2 e - r)               (lse      = r ln 2 + log s)
//   k = sum_v float(probs_v),  probs_v = bf16(min(2^(acc_v log2 e - r) f, 2^64))
//                                                 (kept_lse = q + log k)
// Per value: one fma and one ex2 for s, then a product, a min, the rounding to bf16 and an add
// for probs and k (no second ex2: 2^(x log2 e - q log2 e) = 2^(x log2 e - r) f). r is not the
// running max: a slot's first fragment sets it to that fragment's max, and it moves only when a
// value lies more than 64 (log2 units, ~44 nats) above it, checked once per fragment (almost never
// true after the first), so the common path has no per-value max, swap or select; s is rescaled
// and f recomputed when it moves, k never (it is against q throughout). The sums stay finite (a
// term of s is at most 2^64, of k at most 2^64); the cost of a reference below the max is the
// rounding of t = x log2 e - r, |t| up to 64: ~1e-6 relative per term against ~1e-7 (measured lse
// errors 1-2e-6, tests/bench/lm_head_variants.cu). At the tile's end the lanes of a row merge by
// shuffles (merge_stats; k by a plain sum) and one lane per row writes the two partials
// {r ln 2, s} and {q, k} at [tile column][row] of the buffers [n_tiles, m_pad] for
// merge_row_partials, as the ColReduction version did. Non-finite values: a NaN makes s NaN (also
// alone in a slot: its reference is then -FLT_MAX, not the empty -inf), and its probability 2^64;
// +inf makes s NaN. One warp per row across N (the cooperative and pingpong tilings here);
// columns past V are skipped (checked per value only in a tile that crosses V), rows past N land
// in the padding (their references read from the padded copy run() makes).
template <class CtaTileShapeMNK>
struct RowSoftmaxStats {
  struct SharedStorage {};
  struct Arguments {
    MaxSum* lse = nullptr;            // [n_tiles, m_pad]: per tile column, each row's partial over fp32 values
    MaxSum* kept = nullptr;           // [n_tiles, m_pad]: the sums of the probabilities stored, against q
    const float* reference = nullptr; // [m_pad]: each row's reference q (nats), rows past N included
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.lse != nullptr && args.kept != nullptr && args.reference != nullptr;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  CUTLASS_HOST_DEVICE RowSoftmaxStats() {}
  CUTLASS_HOST_DEVICE RowSoftmaxStats(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, Params const& params)
        : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params) {}
    ArgsTuple args_tuple;
    Params const& params;

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<Element, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const&,
                                                               int epi_v, int epi_m, int epi_n,
                                                               cutlass::Array<ElementInput, FragmentSize> const& x) {
      // (no structured bindings: the lambdas below capture these, which C++17 does not allow)
      Tensor r_mn = get<0>(args_tuple)(_, _, _, epi_m, epi_n);
      Tensor s_mn = get<1>(args_tuple)(_, _, _, epi_m, epi_n);
      Tensor k_mn = get<2>(args_tuple)(_, _, _, epi_m, epi_n);
      Tensor c_mn = get<3>(args_tuple)(_, _, _, epi_m, epi_n);
      auto const& residue_tCcCol = get<4>(args_tuple);
      const bool check_n = get<5>(args_tuple);
      Tensor q_mn = get<12>(args_tuple)(_, _, _, epi_m, epi_n);
      Tensor f_mn = get<13>(args_tuple)(_, _, _, epi_m, epi_n);
      cutlass::Array<Element, FragmentSize> out;
      const cutlass::NumericConverter<Element, float, kRound> to_bf16;
      // The fragment's values against their row slots' references: t = x log2 e - r. When one lies
      // more than 64 above its reference (or the slot is still empty, r = -inf: the first
      // fragment of each row), the slots' references move up to the fragment's max, their sums
      // are rescaled and their factors f recomputed, once per fragment; then every value adds 2^t
      // to s and stores min(2^t f, 2^64), adding it as stored to k, without a per-value branch.
      auto body = [&](auto checked) CUTLASS_LAMBDA_FUNC_INLINE {
        constexpr bool kChecked = decltype(checked)::value;
        auto in = [&](int idx) CUTLASS_LAMBDA_FUNC_INLINE {  // a column before V
          if constexpr (kChecked) return get<1>(c_mn(idx)) < get<1>(residue_tCcCol);
          else return true;
        };
        auto t_of = [&](int i) CUTLASS_LAMBDA_FUNC_INLINE {  // a column past V: -inf (2^-inf = 0 adds nothing)
          const int idx = epi_v * FragmentSize + i;
          return in(idx) ? fmaf(float(x[i]), kLog2e, -r_mn(idx)) : -INFINITY;
        };
        float t[FragmentSize];
        bool far = false;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          t[i] = t_of(i);
          far |= !(t[i] <= 64.f);  // also NaN: an empty slot (r = -inf) meeting -inf, or a NaN value
        }
        if (far) {
          Tensor r_f = filter(r_mn), s_f = filter(s_mn), q_f = filter(q_mn), f_f = filter(f_mn);  // each slot once
          float r_old[decltype(size(r_f))::value];
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(r_f); ++j) r_old[j] = r_f(j);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < FragmentSize; ++i) {
            const int idx = epi_v * FragmentSize + i;
            // (-FLT_MAX at least: a slot that has seen values is never the empty -inf)
            if (in(idx)) r_mn(idx) = fmaxf(r_mn(idx), fmaxf(float(x[i]) * kLog2e, -FLT_MAX));
          }
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(r_f); ++j) {
            if (r_old[j] == r_f(j)) continue;  // (-inf, -inf): unchanged
            // Not below q - 64 (log2 units): f stays >= 2^-64, so a slot whose first values lie far
            // below the reference does not zero the later ones (+inf above 2^128: then clamped).
            r_f(j) = fmaxf(r_f(j), fmaf(q_f(j), kLog2e, -64.f));
            s_f(j) *= ex2(r_old[j] - r_f(j));
            f_f(j) = ex2(r_f(j) - q_f(j) * kLog2e);
          }
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < FragmentSize; ++i) t[i] = t_of(i);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          const int idx = epi_v * FragmentSize + i;
          const float e = ex2(t[i]);
          s_mn(idx) += e;
          out[i] = to_bf16(fminf(e * f_mn(idx), kProbMax));  // (0 * inf = NaN: fminf takes 2^64)
          k_mn(idx) += float(out[i]);
        }
      };
      if (check_n) body(cute::true_type{});  // a tile that crosses V
      else body(cute::false_type{});
      return out;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration, VTensor) {
      if (!is_last_iteration) return;
      auto& [tCrR, tCrS, tCrK, tCcCol, residue_tCcCol, check_n, cCol, residue_cCol, tCgL, tCgK, lane_layout_MN,
             lane_mn, tCrQ, tCrF] = args_tuple;
      if (!elem_less(cCol(_0{}, _0{}), residue_cCol)) return;  // a CTA wholly past the problem (cluster padding)
      // The lanes that share a row (along N) merge by shuffles; their lane 0 holds the row's tile partial.
      Tensor r_f = filter(tCrR), s_f = filter(tCrS), k_f = filter(tCrK);
      CUTLASS_PRAGMA_UNROLL
      for (int cols = size<1>(lane_layout_MN) / 2; cols > 0; cols /= 2) {
        const int delta = lane_layout_MN(_0{}, cols);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(r_f); ++i) {
          const float r2 = __shfl_down_sync(0xFFFFFFFF, r_f(i), delta);
          const float s2 = __shfl_down_sync(0xFFFFFFFF, s_f(i), delta);
          k_f(i) += __shfl_down_sync(0xFFFFFFFF, k_f(i), delta);  // against the row's q on every lane
          merge_stats(r_f(i), s_f(i), r2, s2);
        }
      }
      if (get<1>(lane_mn) != 0) return;
      Tensor r_z = filter_zeros(tCrR), s_z = filter_zeros(tCrS), k_z = filter_zeros(tCrK), q_z = filter_zeros(tCrQ);
      Tensor gL_z = filter_zeros(tCgL), gK_z = filter_zeros(tCgK);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(r_z); ++i) {
        gL_z(i) = MaxSum{r_z(i) == -INFINITY ? -INFINITY : r_z(i) * kLn2, s_z(i)};
        gK_z(i) = MaxSum{q_z(i), k_z(i)};
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    static_assert(ReferenceSrc, "RowSoftmaxStats: written for the epilogue's source-referenced register tensors");
    Layout ref_layout_MN = right_inverse(args.tiled_copy.get_layoutS_TV())
                               .with_shape(shape(typename decltype(args.tiled_copy)::Tiler_MN{}));  // tile_mn -> tv
    // Lanes and warps over the tile's (M, N): which lanes share a row (the shuffles' partners).
    using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout ref2lane = composition(Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_1, _0, _0>>{},
                                  ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    auto lane_mn = idx2crd(right_inverse(lane_layout_MN)(cutlass::canonical_lane_idx()), shape(lane_layout_MN));
    Layout ref2warp = composition(Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_0, _1, _0>>{},
                                  ref_layout_MN);
    static_assert(decltype(size(filter(get<1>(ref2warp))))::value <= 1,
                  "RowSoftmaxStats: a row's columns must lie in one warp (no cross-warp reduction here)");

    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    // The partial buffers over (M, N): stride 1 along a tile's rows, 0 along its columns, m_pad
    // from one tile column to the next ([n_tiles, m_pad], m_pad = M rounded up to the tile's rows).
    Layout tile_layout = make_layout(take<0, 2>(args.tile_shape_mnk), make_stride(_1{}, _0{}));
    Layout buf_layout = blocked_product(tile_layout, make_layout(ceil_div(make_shape(M, N, L), shape(tile_layout))));
    Tensor gL = local_tile(make_tensor(make_gmem_ptr(params.lse), buf_layout), take<0, 2>(args.tile_shape_mnk),
                           make_coord(m, n, _))(_, _, l);  // (CTA_M, CTA_N)
    Tensor gK = local_tile(make_tensor(make_gmem_ptr(params.kept), buf_layout), take<0, 2>(args.tile_shape_mnk),
                           make_coord(m, n, _))(_, _, l);
    // This thread's view of them (CPY,CPY_M,CPY_N,EPI_M,EPI_N), and its sums shaped alike (0-stride along N).
    Tensor tCgL = cutlass::epilogue::fusion::sm90_partition_for_epilogue<true>(gL, args.epi_tile, args.tiled_copy,
                                                                             args.thread_idx);
    Tensor tCgK = cutlass::epilogue::fusion::sm90_partition_for_epilogue<true>(gK, args.epi_tile, args.tiled_copy,
                                                                             args.thread_idx);
    // The rows' references: [m_pad] with stride 1 along a tile's rows and 0 along its columns and
    // from one tile column to the next; read once into registers shaped as the sums.
    Layout ref_layout = blocked_product(
        tile_layout, make_layout(ceil_div(make_shape(M, N, L), shape(tile_layout)), make_stride(_1{}, _0{}, _0{})));
    Tensor gQ = local_tile(make_tensor(make_gmem_ptr(params.reference), ref_layout), take<0, 2>(args.tile_shape_mnk),
                           make_coord(m, n, _))(_, _, l);
    Tensor tCgQ = cutlass::epilogue::fusion::sm90_partition_for_epilogue<true>(gQ, args.epi_tile, args.tiled_copy,
                                                                             args.thread_idx);
    Tensor tCrR = make_tensor_like<float>(tCgL);
    Tensor tCrS = make_tensor_like<float>(tCgL);
    Tensor tCrK = make_tensor_like<float>(tCgL);
    Tensor tCrQ = make_tensor_like<float>(tCgL);
    Tensor tCrF = make_tensor_like<float>(tCgL);
    fill(tCrR, -INFINITY);
    fill(tCrS, 0.f);
    fill(tCrK, 0.f);
    fill(tCrF, 0.f);  // (set with the slot's first reference)
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tCrQ); ++i) tCrQ(i) = tCgQ(i);  // the same coordinates: one load per slot, repeated
    const bool check_n = get<1>(args.residue_cD) < int(size<1>(args.tile_shape_mnk));
    auto args_tuple = make_tuple(cute::move(tCrR), cute::move(tCrS), cute::move(tCrK), args.tCcD, args.residue_tCcD,
                                 check_n, args.cD, args.residue_cD, tCgL, tCgK, lane_layout_MN, lane_mn,
                                 cute::move(tCrQ), cute::move(tCrF));
    return ConsumerStoreCallbacks<decltype(args_tuple)>(std::move(args_tuple), params);
  }
};


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
    throw std::runtime_error(std::string("lm_head_probs_lse: CUTLASS ") + what + " failed: " +
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

// The CUTLASS types of the head's GEMM (bf16 A [M, K] row-major, B [N, K] as K x N, D [M, N]
// bf16 row-major, fp32 accumulation, no C) for one tile, cluster, pair of schedules, epilogue
// fusion and epilogue subtile; the mainloop takes the shared memory the epilogue leaves.
// (tests/bench/lm_head_variants.cu instantiates it with other fusions.)
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule, class Fusion,
          class EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto>
struct GemmTypes {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float, void,
      LayoutD, 8, Element, LayoutD, 8, EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The GEMM with the fused epilogue for one tile shape, cluster and kernel schedule (the
// epilogue's schedule matches it: cooperative with cooperative, pingpong with plain TMA
// warp-specialized). Queues it on a.stream; the partials live in memory from alloc.
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
Partials run(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx) {
  namespace ef = cutlass::epilogue::fusion;
  // The probabilities to D, each row's (reference, sum) partials per tile to the buffers (RowSoftmaxStats).
  using Fusion = ef::Sm90EVT<RowSoftmaxStats<TileShape>, ef::Sm90AccFetch>;
  using Types = GemmTypes<TileShape, ClusterShape, KernelSchedule, EpilogueSchedule, Fusion>;
  using Kernel = typename Types::Kernel;
  using Gemm = typename Types::Gemm;
  constexpr int kTileM = cute::size<0>(TileShape{}), kTileN = cute::size<1>(TileShape{});

  const int M = int(a.N), N = int(a.V), K = int(a.D);
  Partials p;
  p.n_tiles = int((int64_t(N) + kTileN - 1) / kTileN);
  p.m_pad = (int64_t(M) + kTileM - 1) / kTileM * kTileM;
  const size_t pair_bytes = size_t(p.n_tiles) * size_t(p.m_pad) * sizeof(MaxSum);
  p.lse = static_cast<MaxSum*>(alloc(pair_bytes, alloc_ctx));
  p.kept = static_cast<MaxSum*>(alloc(pair_bytes, alloc_ctx));
  // The references of rows past N too (the epilogue reads every row of a tile): a padded copy.
  auto stream = static_cast<cudaStream_t>(a.stream);
  auto* reference = static_cast<float*>(alloc(size_t(p.m_pad) * sizeof(float), alloc_ctx));
  if (cudaMemcpyAsync(reference, a.reference, size_t(M) * sizeof(float), cudaMemcpyDeviceToDevice, stream) !=
          cudaSuccess ||
      (p.m_pad > M &&
       cudaMemsetAsync(reference + M, 0, size_t(p.m_pad - M) * sizeof(float), stream) != cudaSuccess))
    throw std::runtime_error(std::string("lm_head_probs_lse: copying the references failed: ") +
                             cudaGetErrorString(cudaGetLastError()));

  const auto sa = packed<typename Kernel::StrideA>(M, K), sb = packed<typename Kernel::StrideB>(N, K);
  const auto sd = packed<typename Kernel::StrideD>(M, N);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, 1},
                                {static_cast<const Element*>(a.hidden), sa, static_cast<const Element*>(a.weight), sb},
                                {{}, nullptr, sd, static_cast<Element*>(a.probs), sd}};
  args.epilogue.thread = {{}, {p.lse, p.kept, reference}};  // the child (AccFetch), then the node
  args.hw_info.sm_count = a.sm_count;
  Gemm gemm;
  check(gemm.can_implement(args), "can_implement");
  const size_t bytes = Gemm::get_workspace_size(args);
  void* workspace = bytes ? alloc(bytes, alloc_ctx) : nullptr;
  check(gemm.initialize(args, workspace, stream), "initialize");
  check(gemm.run(stream), "run");
  return p;
}

// The two instantiations, one translation unit each (they compile in parallel):
// kernels/lm_head_sm90.cu and kernels/lm_head_sm90_pingpong.cu.
Partials run_cooperative(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx);
Partials run_pingpong(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx);

}  // namespace kiln::kernels::cuda::lm_head_sm90
