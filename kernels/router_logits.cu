// The router's fp32 logits from bf16 operands (kernels/router_logits.hpp): each CTA a block of y,
// x's and w's 32-wide K slices widened to fp32 in shared memory (double-buffered: the next
// slice's global loads in flight while this one is summed), each thread a block of outputs
// summed over k in order. Three block shapes by the row count (router_logits_tile_for), the same
// bits in each.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/router_logits_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kBK = 32, kThreads = 256;

// 8 bf16 (one 16-byte load) widened to fp32.
__device__ __forceinline__ void widen(const uint4& v, float (&f)[8]) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x, f[2 * i + 1] = p.y;
  }
}

template <int N>
__device__ __forceinline__ void load_vec(float (&v)[N], const float* p) {
  if constexpr (N == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else if constexpr (N == 2) {
    const float2 q = *reinterpret_cast<const float2*>(p);
    v[0] = q.x, v[1] = q.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = p[i];
  }
}

// One operand's B rows of a 32-wide K slice (x's block of rows or w's of columns): brought in as
// 16-byte vectors of 8 bf16 into registers (load), then widened into shared memory k-major
// (store: dst[k][row]). K % 8 == 0: a vector lies wholly before K or wholly past it (zeros there,
// never summed).
template <int B>
struct SliceRows {
  static constexpr int kVec = B * kBK / 8, kPer = (kVec + kThreads - 1) / kThreads;  // vectors per slice, per thread
  uint4 v[kPer];
  __device__ __forceinline__ void load(const __nv_bfloat16* base, int64_t ld, int rows, int K, int k0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int t = threadIdx.x + i * kThreads, r = t / (kBK / 8), k = k0 + (t % (kBK / 8)) * 8;
      v[i] = t < kVec && r < rows && k < K ? *reinterpret_cast<const uint4*>(base + int64_t(r) * ld + k)
                                           : make_uint4(0, 0, 0, 0);
    }
  }
  __device__ __forceinline__ void store(float (&dst)[kBK][B]) const {
    float f[8];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int t = threadIdx.x + i * kThreads, r = t / (kBK / 8), k = (t % (kBK / 8)) * 8;
      if (t >= kVec) break;
      widen(v[i], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[k + j][r] = f[j];
    }
  }
};

// y [M, N] = x [M, K] (row stride ldx) w [N, K]^T, one BM x BN block of y per CTA, a TM x TN block
// per thread (thread (ty, tx) = (tid / (BN / TN), tid % (BN / TN)): rows m0 + TM ty .., columns
// n0 + TN tx ..). Each 32-wide K slice of x's and w's rows comes in as 16-byte vectors of 8 bf16
// (the next slice's loads in flight while this one is summed), widened into shared memory
// k-major ([k][m], [k][n]), where a thread reads its TM rows and TN columns at one k. The tile
// decides only who sums an output, never the order: every output is the same sequence of adds
// over k = 0 .. K-1 in every configuration.
template <int BM, int BN, int TM, int TN>
__global__ void __launch_bounds__(kThreads) router_logits_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx,
                                                                 const __nv_bfloat16* __restrict__ w,
                                                                 float* __restrict__ y, int M, int N, int K) {
  static_assert((BM / TM) * (BN / TN) == kThreads, "one thread per TM x TN block");
  __shared__ __align__(16) float xs[2][kBK][BM];
  __shared__ __align__(16) float ws[2][kBK][BN];
  const int tid = threadIdx.x, tx = tid % (BN / TN), ty = tid / (BN / TN);
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  SliceRows<BM> sx;
  SliceRows<BN> sw;
  auto load = [&](int k0) {
    sx.load(x + int64_t(m0) * ldx, ldx, M - m0, K, k0);
    sw.load(w + int64_t(n0) * K, K, N - n0, K, k0);
  };
  auto store = [&](int buf) {
    sx.store(xs[buf]);
    sw.store(ws[buf]);
  };
  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
  auto step = [&](int buf, int kk) {
    float a[TM], b[TN];
    load_vec(a, &xs[buf][kk][TM * ty]);
    load_vec(b, &ws[buf][kk][TN * tx]);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = __fmaf_rn(a[i], b[j], acc[i][j]);  // exact product: one rounding
  };
  load(0);
  store(0);
  __syncthreads();
  int buf = 0;
  for (int k0 = 0; k0 < K; k0 += kBK) {
    const bool more = k0 + kBK < K;
    if (more) load(k0 + kBK);         // in flight while this slice is summed
    const int kn = min(kBK, K - k0);  // the same for every thread: no zero is ever added
    if (kn == kBK) {
#pragma unroll
      for (int kk = 0; kk < kBK; ++kk) step(buf, kk);
    } else {
      for (int kk = 0; kk < kn; ++kk) step(buf, kk);
    }
    if (more) {
      store(buf ^ 1);  // the other buffer: last read before the previous barrier
      __syncthreads();
      buf ^= 1;
    }
  }
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int m = m0 + TM * ty + i;
    if (m >= M) break;
    float* yr = y + int64_t(m) * N;
#pragma unroll
    for (int j = 0; j < TN; ++j)
      if (n0 + TN * tx + j < N) yr[n0 + TN * tx + j] = acc[i][j];
  }
}

template <int BM, int BN, int TM, int TN>
void launch(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int M = int(x.size(0)), N = int(w.size(0)), K = int(x.size(1));
  const dim3 grid((M + BM - 1) / BM, (N + BN - 1) / BN);
  router_logits_kernel<BM, BN, TM, TN><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), M > 1 ? x.stride(0) : K,
      reinterpret_cast<const __nv_bfloat16*>(w.data_ptr()), y.data_ptr<float>(), M, N, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace

int router_logits_tile_for(int64_t M, int64_t N) {
  (void)N;
  return M >= kRouterLogitsLargeFrom ? 0 : M >= kRouterLogitsMediumFrom ? 1 : 2;
}

void router_logits(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, int tile) {
  const c10::cuda::CUDAGuard guard(x.device());
  if (tile < 0) tile = router_logits_tile_for(x.size(0), w.size(0));
  switch (tile) {
    case 0: launch<64, 64, 4, 4>(x, w, y); break;
    case 1: launch<32, 32, 2, 2>(x, w, y); break;
    case 2: launch<16, 16, 1, 1>(x, w, y); break;
    default: TORCH_CHECK(false, "router_logits: tile configuration ", tile, " (0, 1 or 2 expected)");
  }
}

}  // namespace kiln::kernels::cuda
