// Batch-invariant CUDA kernels (kernels/batch_invariant_cuda.hpp; formulas and shapes in
// kernels/batch_invariant.hpp). The rule every kernel here keeps: an output element is one
// fixed chain of operations that depends on the reduced length alone, never on how many rows
// share the launch, where the row sits, which CTA or tile holds it, or the GPU's SM count.
// No split-K, no atomics, no reductions across rows; explicit fmaf / __fmul_rn / __fadd_rn
// where the compiler could otherwise contract differently at different call sites.
//
// GEMM (bf16, K % 8 == 0): CTA tile BM x BN, K in BK-wide slices through a cp.async pipeline,
// warps of WM x WN computing with mma.sync m16n8k16 (fp32 accumulate). An element's
// accumulator sees the 16-wide k slices 0, 16, 32, ... in order and nothing else, whatever
// BM/BN/WM/WN are: so a smaller tile for decode-sized M gives the same bits as the large one.
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16", g = lane / 4, t = lane % 4):
//   A (16x16, row): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16x8, col):  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)   (w [N, K] row-major is B col-major)
//   C (16x8, fp32): c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1)
// both A and B fragments by ldmatrix.x4 from shared rows padded by 8 bf16 (conflict-free).
// GEMM (fp32, or K % 8 != 0): 64 x 64 CTA tile on CUDA cores, each element an fmaf chain over
// k = 0 .. K-1.
// Grouped GEMM: the same kernels; a one-thread prologue turns counts [E] into each group's
// first row and first M-tile, and each CTA finds its group by binary search (no host read).
//
// Attention, bf16 with Dqk = Dv in {128, 256}: tensor cores (attention_mma_kernel, described
// there; P rounded to bf16 before P V as in FlashAttention). Otherwise (fp32, other widths):
// one CTA of 128 threads per (16 queries of one sequence, head), fp32 SIMT. Per key
// block of 64 (from key 0): scores = fmaf chains over Dqk (thread: one key x 8 queries), then
// one thread per query row runs the online-softmax step over its visible keys of the block in
// order, then the output columns (thread: 2 columns x 16 rows) take an fmaf chain over the
// block's keys in order, a key entering a row only if it is within the row's causal limit.
// A decode query (one row of its CTA) and the same token among a training pack's queries run
// this same sequence on the same values.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/empty_like.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/dtype.cuh"
#include "kernels/batch_invariant_cuda.hpp"
#include "kernels/mma_bf16.cuh"
#include "kernels/smem_opt_in.cuh"

namespace kiln::kernels::cuda {

namespace {


template <class F>
void dispatch_float(at::ScalarType t, const char* op, F f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, op, ": dtype ", t, " not supported on CUDA (fp32, bf16)");
  }
}


// ---------------------------------------------------------------------------------------------
// Segments (groups of rows / sequences of queries) -> tiles, on the device.

// sizes [E] (counts) or offsets [E+1] (cu): first_row[e], first_tile[e] for e < E and
// first_tile[E] = the number of tiles. One thread: E is at most a few thousand.
__global__ void segment_tiles_kernel(const int64_t* __restrict__ in, bool offsets, int64_t E, int64_t tile,
                                     int64_t* __restrict__ first_row, int64_t* __restrict__ first_tile) {
  int64_t rows = 0, tiles = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = offsets ? in[e + 1] - in[e] : in[e];
    n = n < 0 ? 0 : n;
    first_row[e] = offsets ? in[e] : rows;
    first_tile[e] = tiles;
    rows += n;
    tiles += (n + tile - 1) / tile;
  }
  first_tile[E] = tiles;
}

// The segment of tile `tile`: largest e with first_tile[e] <= tile (first_tile[E] = total).
__device__ __forceinline__ int64_t find_segment(const int64_t* first_tile, int64_t E, int64_t tile) {
  int64_t lo = 0, hi = E - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first_tile[mid] <= tile) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// [2E+1] int64 on x's device: first_row [E], first_tile [E+1].
at::Tensor segment_tiles(const at::Tensor& in, bool offsets, int64_t E, int64_t tile, const at::Device& device) {
  auto src = in.to(device, at::kLong).contiguous();
  auto out = at::empty({2 * E + 1}, src.options());
  segment_tiles_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(src.data_ptr<int64_t>(), offsets, E, tile,
                                                                       out.data_ptr<int64_t>(),
                                                                       out.data_ptr<int64_t>() + E);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// ---------------------------------------------------------------------------------------------
// GEMM

struct GemmParams {
  const void* x;          // [M, K]
  const void* w;          // [E, N, K]
  void* y;                // [M, N]
  int64_t M, N, K;
  int64_t E;              // groups (1: plain linear)
  const int64_t* first_row;   // [E] (grouped) or null
  const int64_t* first_tile;  // [E+1] (grouped) or null
};

// This CTA's rows [row0, row_end) and group e; false when the CTA has no rows.
template <int BM>
__device__ __forceinline__ bool cta_rows(const GemmParams& p, int64_t& row0, int64_t& row_end, int64_t& e) {
  const int64_t tile = blockIdx.x;
  if (p.first_tile == nullptr) {
    e = 0;
    row0 = tile * BM;
    row_end = p.M;
  } else {
    if (tile >= p.first_tile[p.E]) return false;
    e = find_segment(p.first_tile, p.E, tile);
    const int64_t seg0 = p.first_row[e];
    row0 = seg0 + (tile - p.first_tile[e]) * BM;
    const int64_t seg_end = e + 1 < p.E ? p.first_row[e + 1] : p.M;
    row_end = seg_end < p.M ? seg_end : p.M;
  }
  if (row_end > row0 + BM) row_end = row0 + BM;
  return row0 < row_end;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&d)[4], const __nv_bfloat16* p) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(s));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// CTA tile BM x BN, warp tile WM x WN, BK k per pipeline stage, STAGES stages. Shared rows are
// padded by 8 bf16 (80 or 144 bytes): the 8 rows of an ldmatrix hit distinct banks.
template <int BM, int BN, int WM, int WN, int BK, int STAGES>
struct MmaTile {
  static constexpr int kWarpsN = BN / WN;
  static constexpr int kThreads = (BM / WM) * kWarpsN * 32;
  static constexpr int MT = WM / 16, NT = WN / 8;
  static constexpr int kBK = BK, kStages = STAGES, kLds = BK + 8;
  static constexpr std::size_t smem = sizeof(__nv_bfloat16) * kStages * (BM + BN) * kLds;
  static_assert(WM % 16 == 0 && WN % 16 == 0 && BM % WM == 0 && BN % WN == 0 && BK % 16 == 0, "tiles");
};

template <class S, int BM, int BN, int WM, int WN, class Out>
__global__ void __launch_bounds__(S::kThreads) gemm_mma_kernel(GemmParams p) {
  constexpr int kBK = S::kBK, kStages = S::kStages, kLds = S::kLds;
  int64_t row0, row_end, e;
  if (!cta_rows<BM>(p, row0, row_end, e)) return;
  const int64_t n0 = int64_t(blockIdx.y) * BN;
  const int64_t K = p.K, N = p.N;
  const auto* x = static_cast<const __nv_bfloat16*>(p.x);
  const auto* w = static_cast<const __nv_bfloat16*>(p.w) + e * N * K;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* As = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kStages][BM][kLds]
  auto* Bs = As + kStages * BM * kLds;                      // [kStages][BN][kLds]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp / S::kWarpsN, wn = warp % S::kWarpsN;
  const int64_t ktiles = (K + kBK - 1) / kBK;

  auto load = [&](int stage, int64_t kt) {
    const int64_t k0 = kt * kBK;
    __nv_bfloat16* a = As + stage * BM * kLds;
    __nv_bfloat16* b = Bs + stage * BN * kLds;
    for (int i = tid; i < BM * (kBK / 8); i += S::kThreads) {
      const int r = i / (kBK / 8), c = (i % (kBK / 8)) * 8;
      const int64_t row = row0 + r, k = k0 + c;
      const bool ok = row < row_end && k < K;
      cp_async16(a + r * kLds + c, ok ? x + row * K + k : x, ok ? 16 : 0);
    }
    for (int i = tid; i < BN * (kBK / 8); i += S::kThreads) {
      const int r = i / (kBK / 8), c = (i % (kBK / 8)) * 8;
      const int64_t n = n0 + r, k = k0 + c;
      const bool ok = n < N && k < K;
      cp_async16(b + r * kLds + c, ok ? w + n * K + k : w, ok ? 16 : 0);
    }
  };

  float acc[S::MT][S::NT][4];
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int j = 0; j < S::NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load(s, s);
    cp_async_commit();
  }
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt ready for all; stage kt-1 (reloaded next) done by all
    const int64_t next = kt + kStages - 1;
    if (next < ktiles) load(int(next % kStages), next);
    cp_async_commit();
    const __nv_bfloat16* a = As + int(kt % kStages) * BM * kLds;
    const __nv_bfloat16* b = Bs + int(kt % kStages) * BN * kLds;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {  // k slices in increasing order
      uint32_t af[S::MT][4], bf[S::NT][2];
#pragma unroll
      for (int mt = 0; mt < S::MT; ++mt)
        ldmatrix_x4(af[mt], a + (wm * WM + mt * 16 + (lane & 15)) * kLds + kk + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < S::NT / 2; ++np) {
        uint32_t r4[4];
        ldmatrix_x4(r4, b + (wn * WN + np * 16 + (lane & 7) + (lane >> 4) * 8) * kLds + kk + ((lane >> 3) & 1) * 8);
        bf[2 * np][0] = r4[0];
        bf[2 * np][1] = r4[1];
        bf[2 * np + 1][0] = r4[2];
        bf[2 * np + 1][1] = r4[3];
      }
#pragma unroll
      for (int mt = 0; mt < S::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt) mma_bf16(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
    }
  }
  cp_async_wait<0>();

  Out* y = static_cast<Out*>(p.y);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < S::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int64_t row = row0 + wm * WM + mt * 16 + g + 8 * hi;
        if (row >= row_end) continue;
        const int64_t col = n0 + wn * WN + nt * 8 + 2 * t;
        if (col < N) y[row * N + col] = from_f<Out>(acc[mt][nt][2 * hi]);
        if (col + 1 < N) y[row * N + col + 1] = from_f<Out>(acc[mt][nt][2 * hi + 1]);
      }
}

// CUDA-core GEMM: 64 x 64 CTA tile, 256 threads of 4 x 4 elements, each an fmaf chain over k.
constexpr int kSimtTile = 64, kSimtBK = 16, kSimtThreads = 256;

template <class T, class Out>
__global__ void __launch_bounds__(kSimtThreads) gemm_simt_kernel(GemmParams p) {
  int64_t row0, row_end, e;
  if (!cta_rows<kSimtTile>(p, row0, row_end, e)) return;
  const int64_t n0 = int64_t(blockIdx.y) * kSimtTile, K = p.K, N = p.N;
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w) + e * N * K;
  __shared__ float As[kSimtBK][kSimtTile + 4], Bs[kSimtBK][kSimtTile + 4];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int64_t k0 = 0; k0 < K; k0 += kSimtBK) {
    for (int i = tid; i < kSimtTile * kSimtBK; i += kSimtThreads) {
      const int r = i / kSimtBK, kk = i % kSimtBK;
      const int64_t k = k0 + kk, row = row0 + r, n = n0 + r;
      As[kk][r] = row < row_end && k < K ? to_f(x[row * K + k]) : 0.f;
      Bs[kk][r] = n < N && k < K ? to_f(w[n * K + k]) : 0.f;
    }
    __syncthreads();
    const int kn = int(K - k0 < kSimtBK ? K - k0 : kSimtBK);  // only real k enter the chain
    for (int kk = 0; kk < kn; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  Out* y = static_cast<Out*>(p.y);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + ty + 16 * i;
    if (row >= row_end) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tx + 16 * j;
      if (n < N) y[row * N + n] = from_f<Out>(acc[i][j]);
    }
  }
}

template <int BM, int BN, int WM, int WN, int BK, int STAGES, class Out>
void launch_mma(const GemmParams& p, int64_t mtiles, int device) {
  using S = MmaTile<BM, BN, WM, WN, BK, STAGES>;
  static SmemOptIn opt_in;
  auto kernel = gemm_mma_kernel<S, BM, BN, WM, WN, Out>;
  opt_in.raise(kernel, S::smem, device);
  const dim3 grid(unsigned(mtiles), unsigned((p.N + BN - 1) / BN));
  kernel<<<grid, S::kThreads, S::smem, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// y = x w^T per group. counts: [E] on any device, or undefined (one group of M rows).
void gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), E = w.dim() == 3 ? w.size(0) : 1, N = w.size(-2);
  if (M == 0 || N == 0) return;
  TORCH_CHECK((N + 31) / 32 <= 65535, "bi_linear: N = ", N, " output columns, over the kernels' grid limit of ",
              65535 * 32);
  GemmParams p{x.data_ptr(), w.data_ptr(), y.data_ptr(), M, N, K, E, nullptr, nullptr};
  const bool mma = x.scalar_type() == at::kBFloat16 && K % 8 == 0 && K > 0;
  const bool small = M <= 64 * E;  // decode-sized: at most 64 rows per group on average
  const int64_t bm = !mma ? kSimtTile : small ? 32 : 128;
  int64_t mtiles = (M + bm - 1) / bm;
  at::Tensor seg;
  if (counts.defined()) {
    seg = segment_tiles(counts, false, E, bm, x.device());
    p.first_row = seg.data_ptr<int64_t>();
    p.first_tile = p.first_row + E;
    mtiles += E;  // >= sum_e ceil(counts_e / bm) when the counts sum to M; spare CTAs exit
  }
  const int device = x.get_device();
  auto out_dispatch = [&](auto launch) {
    if (y.scalar_type() == at::kFloat) launch(float{});
    else if (y.scalar_type() == at::kBFloat16) launch(__nv_bfloat16{});
    else TORCH_CHECK(false, "bi_linear: output dtype ", y.scalar_type(), " not supported on CUDA (fp32, bf16)");
  };
  if (mma) {
    out_dispatch([&](auto o) {
      using Out = decltype(o);
      // Large M: 128 x 128 CTAs of 4 warps (64 x 64 each), 32-wide k stages; decode-sized M:
      // 32 x 32 CTAs of 4 warps (more CTAs over N) with 8 stages of 64 k in flight (the weight
      // stream is the cost there). The element chains are the same in both.
      if (small) launch_mma<32, 32, 16, 16, 64, 8, Out>(p, mtiles, device);
      else launch_mma<128, 128, 64, 64, 32, 4, Out>(p, mtiles, device);
    });
    return;
  }
  dispatch_float(x.scalar_type(), "bi_linear", [&](auto tx) {
    out_dispatch([&](auto o) {
      const dim3 grid(unsigned(mtiles), unsigned((N + kSimtTile - 1) / kSimtTile));
      gemm_simt_kernel<decltype(tx), decltype(o)><<<grid, kSimtThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Attention

constexpr int kQB = 16;            // queries per CTA
constexpr int kKB = 64;            // keys per online-softmax step
constexpr int kDC = 64;            // Dqk columns of K in shared memory at a time
constexpr int kKLd = kDC + 1;      // K row stride (floats): 16 key rows per warp hit distinct banks
constexpr int kVC = 16;            // keys of V in shared memory at a time
constexpr int kAttnThreads = 128;  // = 2 threads per key of a block for the scores
constexpr int kMaxDv = 2 * kAttnThreads;

struct AttnParams {
  const void *q, *k, *v;
  void* out;
  const int64_t *cu_q, *cu_k;  // [B+1]
  const int64_t* first_tile;   // [B+1]
  int64_t B;
  int H, Dqk, Dv;
  float scale;
};

inline std::size_t attn_smem(int Dqk, int Dv) {
  return sizeof(float) * (std::size_t(kQB) * Dqk + kKB * kKLd + std::size_t(kVC) * Dv + kKB * kQB + 3 * kQB);
}

template <class T>
__global__ void __launch_bounds__(kAttnThreads) attention_kernel(AttnParams p) {
  const int64_t tile = blockIdx.x;
  if (tile >= p.first_tile[p.B]) return;
  const int64_t b = find_segment(p.first_tile, p.B, tile);
  const int h = blockIdx.y, H = p.H, Dqk = p.Dqk, Dv = p.Dv;
  const int64_t q0 = p.cu_q[b], n = p.cu_q[b + 1] - q0, k0 = p.cu_k[b], L = p.cu_k[b + 1] - k0;
  const int64_t j0 = (tile - p.first_tile[b]) * kQB;  // this CTA's first query within the sequence
  const int nq = int(n - j0 < kQB ? n - j0 : kQB);
  const int64_t first_visible = L - n + j0 + 1;          // keys visible to row 0; row r sees r more
  const int64_t max_visible = first_visible + nq - 1;

  extern __shared__ __align__(16) float sm[];
  float* Qt = sm;                       // [Dqk][kQB]
  float* Ks = Qt + kQB * Dqk;           // [kKB][kKLd]
  float* Vs = Ks + kKB * kKLd;          // [kVC][Dv]
  float* Pt = Vs + kVC * Dv;            // [kKB][kQB]: scores, then probabilities
  float* s_alpha = Pt + kKB * kQB;      // [kQB]
  float* s_l = s_alpha + kQB;           // [kQB]
  int* s_nv = reinterpret_cast<int*>(s_l + kQB);  // [kQB]

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int tid = threadIdx.x;
  for (int i = tid; i < kQB * Dqk; i += kAttnThreads) {
    const int r = i / Dqk, d = i % Dqk;
    Qt[d * kQB + r] = r < nq ? to_f(q[((q0 + j0 + r) * H + h) * Dqk + d]) : 0.f;
  }

  // Scores: key kj = tid / 2, rows 8 * (tid % 2) .. + 7. Output: columns tid, tid + 128, all rows.
  const int kj = tid >> 1, rh = (tid & 1) * 8;
  const bool score_rows = rh < nq;
  float m_row = -INFINITY, l_row = 0.f;  // thread r < kQB: row r's running max and sum
  float acc[kQB][2];
#pragma unroll
  for (int r = 0; r < kQB; ++r) acc[r][0] = acc[r][1] = 0.f;

  for (int64_t kb0 = 0; kb0 < max_visible; kb0 += kKB) {
    const int nk = int(max_visible - kb0 < kKB ? max_visible - kb0 : kKB);  // keys of the block any row sees
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = 0.f;
    for (int dc = 0; dc < Dqk; dc += kDC) {
      const int dn = Dqk - dc < kDC ? Dqk - dc : kDC;
      __syncthreads();
      for (int i = tid; i < kKB * dn; i += kAttnThreads) {
        const int j = i / dn, d = i % dn;
        Ks[j * kKLd + d] = j < nk ? to_f(k[((k0 + kb0 + j) * H + h) * Dqk + dc + d]) : 0.f;
      }
      __syncthreads();
      if (score_rows) {
        for (int d = 0; d < dn; ++d) {
          const float kv = Ks[kj * kKLd + d];
          const float4 qa = *reinterpret_cast<const float4*>(Qt + (dc + d) * kQB + rh);
          const float4 qb = *reinterpret_cast<const float4*>(Qt + (dc + d) * kQB + rh + 4);
          s[0] = fmaf(qa.x, kv, s[0]);
          s[1] = fmaf(qa.y, kv, s[1]);
          s[2] = fmaf(qa.z, kv, s[2]);
          s[3] = fmaf(qa.w, kv, s[3]);
          s[4] = fmaf(qb.x, kv, s[4]);
          s[5] = fmaf(qb.y, kv, s[5]);
          s[6] = fmaf(qb.z, kv, s[6]);
          s[7] = fmaf(qb.w, kv, s[7]);
        }
      }
    }
    if (score_rows) {
#pragma unroll
      for (int i = 0; i < 8; ++i) Pt[kj * kQB + rh + i] = __fmul_rn(s[i], p.scale);
    }
    __syncthreads();
    if (tid < kQB) {  // the online-softmax step of row tid over its visible keys of the block
      const int r = tid;
      int64_t vis = r < nq ? first_visible + r - kb0 : 0;
      vis = vis < 0 ? 0 : (vis > kKB ? kKB : vis);
      const int nv = int(vis);
      float alpha = 1.f;
      if (nv > 0) {
        float mb = m_row;
        for (int j = 0; j < nv; ++j) mb = fmaxf(mb, Pt[j * kQB + r]);
        alpha = expf(m_row - mb);  // 0 on the row's first block (m = -inf)
        l_row = __fmul_rn(l_row, alpha);
        for (int j = 0; j < nv; ++j) {
          const float pj = expf(Pt[j * kQB + r] - mb);
          Pt[j * kQB + r] = pj;
          l_row = __fadd_rn(l_row, pj);
        }
        m_row = mb;
      }
      s_alpha[r] = alpha;
      s_nv[r] = nv;
    }
    __syncthreads();
    int nv[kQB];
#pragma unroll
    for (int r = 0; r < kQB; ++r) {
      nv[r] = s_nv[r];
      const float a = s_alpha[r];
      acc[r][0] = __fmul_rn(acc[r][0], a);
      acc[r][1] = __fmul_rn(acc[r][1], a);
    }
    const int c0 = tid, c1 = tid + kAttnThreads;
    for (int v0 = 0; v0 < nk; v0 += kVC) {
      const int vn = nk - v0 < kVC ? nk - v0 : kVC;
      __syncthreads();
      for (int i = tid; i < kVC * Dv; i += kAttnThreads) {
        const int j = i / Dv, c = i % Dv;
        Vs[i] = j < vn ? to_f(v[((k0 + kb0 + v0 + j) * H + h) * Dv + c]) : 0.f;
      }
      __syncthreads();
      for (int j = 0; j < vn; ++j) {
        const int key = v0 + j;
        float pr[kQB];
#pragma unroll
        for (int r4 = 0; r4 < kQB; r4 += 4) {
          const float4 pv = *reinterpret_cast<const float4*>(Pt + key * kQB + r4);
          pr[r4] = pv.x;
          pr[r4 + 1] = pv.y;
          pr[r4 + 2] = pv.z;
          pr[r4 + 3] = pv.w;
        }
        const float va = c0 < Dv ? Vs[j * Dv + c0] : 0.f;
        const float vb = c1 < Dv ? Vs[j * Dv + c1] : 0.f;
#pragma unroll
        for (int r = 0; r < kQB; ++r)
          if (key < nv[r]) {
            acc[r][0] = fmaf(pr[r], va, acc[r][0]);
            acc[r][1] = fmaf(pr[r], vb, acc[r][1]);
          }
      }
    }
  }
  if (tid < kQB) s_l[tid] = l_row;
  __syncthreads();
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int r = 0; r < kQB; ++r) {
    if (r >= nq) break;
    T* o = out + ((q0 + j0 + r) * H + h) * Dv;
    const float l = s_l[r];
    if (tid < Dv) o[tid] = from_f<T>(__fdiv_rn(acc[r][0], l));
    if (tid + kAttnThreads < Dv) o[tid + kAttnThreads] = from_f<T>(__fdiv_rn(acc[r][1], l));
  }
}


// Tensor-core attention (bf16 q, k, v; Dqk, Dv in {128, 256}): one CTA of W warps per
// (16 W queries of one sequence, head); warp w owns 16 query rows. Per 64-key block (from key
// 0), loaded once for the CTA (cp.async: K, then V):
//   S = Q K^T  [16 x 64] per warp, mma.sync m16n8k16, the k slices of Dqk in order;
//   s = S * scale (fp32), keys past a row's causal limit -inf; the row's max over the block
//   (exact, any order) and its running max m; p = exp(s - m), the row's block sum in a fixed
//   lane order and quad tree; l = l * alpha + sum, O = O * alpha;
//   O += P V   with P rounded to bf16 (FlashAttention's choice), the 16-key slices in order.
// A row whose keys all lie past its limit in a block takes alpha = 1 and p = 0: an exact no-op,
// so the rows of a CTA that see fewer keys get the same bits as when computed alone, and a
// decode query (W = 1, one live row) the bits of the same token inside a training pack (W = 4).
template <int DQK, int DV, int W>
__global__ void __launch_bounds__(32 * W) attention_mma_kernel(AttnParams p) {
  constexpr int QT = 16 * W, LDQ = DQK + 8, LDV = DV + 8;
  static_assert(DQK % 16 == 0 && DV % 16 == 0, "head widths a multiple of 16");
  const int64_t tile = blockIdx.x;
  if (tile >= p.first_tile[p.B]) return;
  const int64_t b = find_segment(p.first_tile, p.B, tile);
  const int h = blockIdx.y, H = p.H;
  const int64_t q0 = p.cu_q[b], n = p.cu_q[b + 1] - q0, k0 = p.cu_k[b], L = p.cu_k[b + 1] - k0;
  const int64_t j0 = (tile - p.first_tile[b]) * QT;
  const int nq = int(n - j0 < QT ? n - j0 : QT);
  const int64_t first_visible = L - n + j0 + 1;  // keys visible to local row 0; row r sees r more
  const int64_t max_visible = first_visible + nq - 1;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [QT][LDQ]
  auto* Ks = Qs + QT * LDQ;                                 // [64][LDQ]
  auto* Vs = Ks + kKB * LDQ;                                // [64][LDV]
  const auto* q = static_cast<const __nv_bfloat16*>(p.q);
  const auto* k = static_cast<const __nv_bfloat16*>(p.k);
  const auto* v = static_cast<const __nv_bfloat16*>(p.v);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  for (int i = tid; i < QT * (DQK / 8); i += 32 * W) {
    const int r = i / (DQK / 8), c = (i % (DQK / 8)) * 8;
    const bool ok = r < nq;
    cp_async16(Qs + r * LDQ + c, ok ? q + ((q0 + j0 + r) * H + h) * DQK + c : q, ok ? 16 : 0);
  }
  cp_async_commit();

  const int row_a = warp * 16 + g, row_b = row_a + 8;  // this thread's two local rows
  const int64_t vis_a = row_a < nq ? first_visible + row_a : 0, vis_b = row_b < nq ? first_visible + row_b : 0;
  const bool warp_live = warp * 16 < nq;
  const int64_t warp_visible = warp_live ? first_visible + (nq - 1 < warp * 16 + 15 ? nq - 1 : warp * 16 + 15) : 0;

  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
  float o[DV / 8][4];
#pragma unroll
  for (int i = 0; i < DV / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  for (int64_t kb0 = 0; kb0 < max_visible; kb0 += kKB) {
    const int64_t nk = max_visible - kb0 < kKB ? max_visible - kb0 : kKB;
    __syncthreads();  // the previous block's K and V are consumed
    for (int i = tid; i < kKB * (DQK / 8); i += 32 * W) {
      const int j = i / (DQK / 8), c = (i % (DQK / 8)) * 8;
      const bool ok = j < nk;
      cp_async16(Ks + j * LDQ + c, ok ? k + ((k0 + kb0 + j) * H + h) * DQK + c : k, ok ? 16 : 0);
    }
    cp_async_commit();
    for (int i = tid; i < kKB * (DV / 8); i += 32 * W) {
      const int j = i / (DV / 8), c = (i % (DV / 8)) * 8;
      const bool ok = j < nk;
      cp_async16(Vs + j * LDV + c, ok ? v + ((k0 + kb0 + j) * H + h) * DV + c : v, ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // Q and this block's K are in

    const bool live = warp_live && kb0 < warp_visible;
    uint32_t pa[4][4];  // P as the A fragments of the four 16-key slices
    if (live) {
      float s[8][4];
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < DQK; kk += 16) {
        uint32_t a[4];
        ldmatrix_x4(a, Qs + (warp * 16 + (lane & 15)) * LDQ + kk + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t r4[4];
          ldmatrix_x4(r4, Ks + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LDQ + kk + ((lane >> 3) & 1) * 8);
          mma_bf16(s[2 * np], a, r4[0], r4[1]);
          mma_bf16(s[2 * np + 1], a, r4[2], r4[3]);
        }
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = kb0 + nt * 8 + 2 * t + (e & 1);
          const int hi = e >> 1;
          const float z = key < (hi ? vis_b : vis_a) ? __fmul_rn(s[nt][e], p.scale) : -INFINITY;
          s[nt][e] = z;
          mx[hi] = fmaxf(mx[hi], z);
        }
      float alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 1));
        mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 2));
        const float m_new = fmaxf(m_r[hi], mx[hi]);
        alpha[hi] = m_new == -INFINITY ? 1.f : expf(m_r[hi] - m_new);  // 0 on the row's first block
        mx[hi] = m_new;
        m_r[hi] = m_new;
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hi = e >> 1;
          const float pe = s[nt][e] == -INFINITY ? 0.f : expf(s[nt][e] - mx[hi]);
          s[nt][e] = pe;
          sum[hi] = __fadd_rn(sum[hi], pe);
        }
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        sum[hi] = __fadd_rn(sum[hi], __shfl_xor_sync(0xffffffffu, sum[hi], 1));
        sum[hi] = __fadd_rn(sum[hi], __shfl_xor_sync(0xffffffffu, sum[hi], 2));
        l_r[hi] = __fadd_rn(__fmul_rn(l_r[hi], alpha[hi]), sum[hi]);
      }
#pragma unroll
      for (int i = 0; i < DV / 8; ++i) {
        o[i][0] = __fmul_rn(o[i][0], alpha[0]);
        o[i][1] = __fmul_rn(o[i][1], alpha[0]);
        o[i][2] = __fmul_rn(o[i][2], alpha[1]);
        o[i][3] = __fmul_rn(o[i][3], alpha[1]);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pa[j][0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
        pa[j][1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
        pa[j][2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
        pa[j][3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // this block's V is in
    if (live) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int pair = 0; pair < DV / 16; ++pair) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, Vs + (j * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LDV + pair * 16 + 8 * (lane >> 4));
          mma_bf16(o[2 * pair], pa[j], bv[0], bv[1]);
          mma_bf16(o[2 * pair + 1], pa[j], bv[2], bv[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // a CTA with no block still waits for its Q copies before exiting
  auto* out = static_cast<__nv_bfloat16*>(p.out);
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = hi ? row_b : row_a;
    if (r >= nq) continue;
    __nv_bfloat16* orow = out + ((q0 + j0 + r) * H + h) * DV;
#pragma unroll
    for (int i = 0; i < DV / 8; ++i) {
      const int c = i * 8 + 2 * t;
      *reinterpret_cast<__nv_bfloat162*>(orow + c) =
          __floats2bfloat162_rn(__fdiv_rn(o[i][2 * hi], l_r[hi]), __fdiv_rn(o[i][2 * hi + 1], l_r[hi]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: one warp per row; lane l sums x[l + 32 i]^2 in i order, then a fixed xor tree.

constexpr int kNormThreads = 256;

template <class T>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                T* __restrict__ y, int64_t rows, int64_t D,
                                                                float eps) {
  const int64_t row = int64_t(blockIdx.x) * (kNormThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* xr = x + row * D;
  float ss = 0.f;
  for (int64_t i = lane; i < D; i += 32) {
    const float v = to_f(xr[i]);
    ss = fmaf(v, v, ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
  const float rstd = rsqrtf(__fadd_rn(__fdiv_rn(ss, float(D)), eps));
  T* yr = y + row * D;
  for (int64_t i = lane; i < D; i += 32) {
    const T normed = from_f<T>(__fmul_rn(to_f(xr[i]), rstd));  // rounded to x's dtype before the weight
    yr[i] = from_f<T>(__fmul_rn(to_f(w[i]), to_f(normed)));
  }
}

// ---------------------------------------------------------------------------------------------
// logsumexp: one CTA per row. Thread t takes the 4-element pieces t, t + 512, ... in order
// (online max/sum per piece), then a fixed tree over the threads' (max, sum) pairs.

constexpr int kLseThreads = 512;

__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;  // both empty
  s = __fadd_rn(__fmul_rn(s, expf(m - mn)), __fmul_rn(s2, expf(m2 - mn)));
  m = mn;
}

template <class T>
__global__ void __launch_bounds__(kLseThreads) logsumexp_kernel(const T* __restrict__ x, float* __restrict__ lse,
                                                                int64_t N) {
  const T* xr = x + int64_t(blockIdx.x) * N;
  const int tid = threadIdx.x;
  float m = -INFINITY, s = 0.f;
  for (int64_t p0 = int64_t(tid) * 4; p0 < N; p0 += int64_t(kLseThreads) * 4) {
    float v[4];
    const int pn = N - p0 < 4 ? int(N - p0) : 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = i < pn ? to_f(xr[p0 + i]) : -INFINITY;
    const float mp = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
    const float mn = fmaxf(m, mp);
    if (mn == -INFINITY) continue;
    float sp = __fmul_rn(s, expf(m - mn));
#pragma unroll
    for (int i = 0; i < 4; ++i) sp = __fadd_rn(sp, expf(v[i] - mn));
    s = sp;
    m = mn;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  __shared__ float wm[kLseThreads / 32], ws[kLseThreads / 32];
  const int warp = tid / 32, lane = tid % 32;
  if (lane == 0) {
    wm[warp] = m;
    ws[warp] = s;
  }
  __syncthreads();
  if (tid == 0) {
    float M = wm[0], S = ws[0];
    for (int i = 1; i < kLseThreads / 32; ++i) lse_merge(M, S, wm[i], ws[i]);
    lse[blockIdx.x] = M == -INFINITY ? -INFINITY : __fadd_rn(M, logf(S));
  }
}

}  // namespace

at::Tensor bi_linear_cuda(const at::Tensor& x, const at::Tensor& w, at::ScalarType out_dtype) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous(), wc = w.contiguous();
  auto y = at::empty({x.size(0), w.size(0)}, x.options().dtype(out_dtype));
  gemm(xc, wc, at::Tensor(), y);
  return y;
}

at::Tensor bi_grouped_linear_cuda(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w) {
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(w.size(0) >= 1, "bi_grouped_linear: w has no groups (E = 0)");
  auto xc = x.contiguous(), wc = w.contiguous();
  auto y = at::zeros({x.size(0), w.size(1)}, x.options());  // rows no group covers stay zero
  gemm(xc, wc, counts, y);
  return y;
}

namespace {
template <int DQK, int DV, int W>
void launch_attention_mma(const AttnParams& p, int64_t tiles, int device) {
  constexpr std::size_t smem = sizeof(__nv_bfloat16) * ((16 * W + kKB) * (DQK + 8) + kKB * (DV + 8));
  static SmemOptIn opt_in;
  auto kernel = attention_mma_kernel<DQK, DV, W>;
  opt_in.raise(kernel, smem, device);
  kernel<<<dim3(unsigned(tiles), unsigned(p.H)), 32 * W, smem, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace

at::Tensor bi_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                             const at::Tensor& cu_k, double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t Tq = q.size(0), H = q.size(1), Dqk = q.size(2), Dv = v.size(2), B = cu_q.size(0) - 1;
  TORCH_CHECK(H <= 65535, "bi_attention: H = ", H, " over the grid's limit of 65535");
  auto out = at::empty({Tq, H, Dv}, q.options());
  if (Tq == 0 || B <= 0) return out;
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto cq = cu_q.to(q.device(), at::kLong).contiguous(), ck = cu_k.to(q.device(), at::kLong).contiguous();
  AttnParams p{qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), cq.data_ptr<int64_t>(),
               ck.data_ptr<int64_t>(), nullptr, B, int(H), int(Dqk), int(Dv), float(scale)};
  const int device = q.get_device();
  const bool mma = q.scalar_type() == at::kBFloat16 && Dqk == Dv && (Dqk == 256 || Dqk == 128);
  if (mma) {
    // Four warps (64 queries) per CTA for prefill/training-sized sequences, one (16) for
    // decode-sized ones; a row's chain is the same in both.
    const int W = Tq >= 32 * B ? 4 : 1;
    auto seg = segment_tiles(cq, true, B, 16 * W, q.device());
    p.first_tile = seg.data_ptr<int64_t>() + B;
    const int64_t tiles = (Tq + 16 * W - 1) / (16 * W) + B;
    if (Dqk == 256) {
      if (W == 4) launch_attention_mma<256, 256, 4>(p, tiles, device);
      else launch_attention_mma<256, 256, 1>(p, tiles, device);
    } else {
      if (W == 4) launch_attention_mma<128, 128, 4>(p, tiles, device);
      else launch_attention_mma<128, 128, 1>(p, tiles, device);
    }
    return out;
  }
  TORCH_CHECK(Dv <= kMaxDv, "bi_attention: Dv = ", Dv, " over the CUDA kernel's limit of ", kMaxDv);
  const std::size_t smem = attn_smem(int(Dqk), int(Dv));
  TORCH_CHECK(smem <= 227 * 1024, "bi_attention: Dqk = ", Dqk, " needs ", smem, " bytes of shared memory (> 227 KiB)");
  auto seg = segment_tiles(cq, true, B, kQB, q.device());
  p.first_tile = seg.data_ptr<int64_t>() + B;
  dispatch_float(q.scalar_type(), "bi_attention", [&](auto tag) {
    static SmemOptIn opt_in;
    auto kernel = attention_kernel<decltype(tag)>;
    opt_in.raise(kernel, smem, device);
    const dim3 grid(unsigned((Tq + kQB - 1) / kQB + B), unsigned(H));
    kernel<<<grid, kAttnThreads, smem, at::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor bi_rms_norm_cuda(const at::Tensor& x, const at::Tensor& w, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous(), wc = w.contiguous();
  auto y = at::empty_like(xc);
  const int64_t rows = x.size(0), D = x.size(1);
  if (rows == 0) return y;
  constexpr int64_t per_block = kNormThreads / 32;
  dispatch_float(x.scalar_type(), "bi_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T><<<unsigned((rows + per_block - 1) / per_block), kNormThreads, 0,
                         at::cuda::getCurrentCUDAStream()>>>(static_cast<const T*>(xc.data_ptr()),
                                                             static_cast<const T*>(wc.data_ptr()),
                                                             static_cast<T*>(y.data_ptr()), rows, D, float(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor bi_logsumexp_cuda(const at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous();
  const int64_t M = x.size(0), N = x.size(1);
  auto lse = at::empty({M}, x.options().dtype(at::kFloat));
  if (M == 0) return lse;
  TORCH_CHECK(M <= 2147483647, "bi_logsumexp: M = ", M, " over the grid's limit");
  dispatch_float(x.scalar_type(), "bi_logsumexp", [&](auto tag) {
    using T = decltype(tag);
    logsumexp_kernel<T><<<unsigned(M), kLseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const T*>(xc.data_ptr()), lse.data_ptr<float>(), N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return lse;
}

}  // namespace kiln::kernels::cuda
