// Decode-step routed experts (kernels/moe_decode.hpp): a block per (8 output rows, expert), a
// warp per output row whose weights it holds in registers, looping over the expert's rows.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/moe_decode_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kWarps = 8;     // output rows per block
constexpr int kRowGroup = 4;  // the expert's rows per pass over the held weights

__device__ __forceinline__ void unpack8(const uint4& v, float f[8]) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// The first row of expert e: the sum of counts[0, e), by one warp.
__device__ __forceinline__ int64_t expert_start(const int64_t* __restrict__ counts, int e, int lane) {
  int64_t s = 0;
  for (int i = lane; i < e; i += 32) s += counts[i];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// act[r, f] = bf16(silu(bf16(gate)) * bf16(up)) (clamped at limit) for the rows r of expert
// blockIdx.y, f = blockIdx.x * kWarps + warp. K = D = KC * 256: lane l holds chunks c*32 + l.
template <int KC>
__global__ void __launch_bounds__(kWarps * 32) gate_up_kernel(const __nv_bfloat16* __restrict__ x,
                                                             const int64_t* __restrict__ counts,
                                                             const __nv_bfloat16* __restrict__ w1,
                                                             __nv_bfloat16* __restrict__ act, int F, float limit) {
  constexpr int K = KC * 256;
  const int e = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = counts[e];
  const int f = blockIdx.x * kWarps + warp;
  if (n == 0 || f >= F) return;
  const auto* wg = reinterpret_cast<const uint4*>(w1 + (int64_t(e) * 2 * F + f) * K);
  const auto* wu = reinterpret_cast<const uint4*>(w1 + (int64_t(e) * 2 * F + F + f) * K);
  uint4 g[KC], u[KC];
#pragma unroll
  for (int c = 0; c < KC; ++c) {
    g[c] = __ldcs(wg + c * 32 + lane);
    u[c] = __ldcs(wu + c * 32 + lane);
  }
  const int64_t start = expert_start(counts, e, lane);
  for (int64_t r0 = 0; r0 < n; r0 += kRowGroup) {
    float ag[kRowGroup] = {}, au[kRowGroup] = {};
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      float gf[8], uf[8];
      unpack8(g[c], gf);
      unpack8(u[c], uf);
#pragma unroll
      for (int rr = 0; rr < kRowGroup; ++rr) {
        if (r0 + rr >= n) break;
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (start + r0 + rr) * K) + c * 32 + lane);
        float xf[8];
        unpack8(xv, xf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          ag[rr] = fmaf(gf[i], xf[i], ag[rr]);
          au[rr] = fmaf(uf[i], xf[i], au[rr]);
        }
      }
    }
#pragma unroll
    for (int rr = 0; rr < kRowGroup; ++rr) {
      ag[rr] = warp_sum(ag[rr]);
      au[rr] = warp_sum(au[rr]);
    }
    if (lane == 0)
#pragma unroll
      for (int rr = 0; rr < kRowGroup; ++rr) {
        if (r0 + rr >= n) break;
        const float gb = fminf(round_bf16(ag[rr]), limit), ub = fminf(fmaxf(round_bf16(au[rr]), -limit), limit);
        const float s = round_bf16(gb / (1.f + __expf(-gb)));
        act[(start + r0 + rr) * F + f] = __float2bfloat16(s * ub);
      }
  }
}

// y[r, d] = bf16(sum_f act[r, f] w2[e, d, f]) for the rows r of expert blockIdx.y, d =
// blockIdx.x * kWarps + warp. K = F = KC * 256.
template <int KC>
__global__ void __launch_bounds__(kWarps * 32) down_kernel(const __nv_bfloat16* __restrict__ act,
                                                          const int64_t* __restrict__ counts,
                                                          const __nv_bfloat16* __restrict__ w2,
                                                          __nv_bfloat16* __restrict__ y, int D) {
  constexpr int K = KC * 256;
  const int e = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = counts[e];
  const int d = blockIdx.x * kWarps + warp;
  if (n == 0 || d >= D) return;
  const auto* w = reinterpret_cast<const uint4*>(w2 + (int64_t(e) * D + d) * K);
  uint4 wv[KC];
#pragma unroll
  for (int c = 0; c < KC; ++c) wv[c] = __ldcs(w + c * 32 + lane);
  const int64_t start = expert_start(counts, e, lane);
  for (int64_t r0 = 0; r0 < n; r0 += kRowGroup) {
    float acc[kRowGroup] = {};
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      float wf[8];
      unpack8(wv[c], wf);
#pragma unroll
      for (int rr = 0; rr < kRowGroup; ++rr) {
        if (r0 + rr >= n) break;
        const uint4 av = __ldg(reinterpret_cast<const uint4*>(act + (start + r0 + rr) * K) + c * 32 + lane);
        float af[8];
        unpack8(av, af);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[rr] = fmaf(wf[i], af[i], acc[rr]);
      }
    }
#pragma unroll
    for (int rr = 0; rr < kRowGroup; ++rr) acc[rr] = warp_sum(acc[rr]);
    if (lane == 0)
#pragma unroll
      for (int rr = 0; rr < kRowGroup; ++rr) {
        if (r0 + rr >= n) break;
        y[(start + r0 + rr) * D + d] = __float2bfloat16(acc[rr]);
      }
  }
}

template <int KC>
void launch_gate_up(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w1, at::Tensor& act, float limit,
                    cudaStream_t stream) {
  const int E = int(w1.size(0)), F = int(act.size(1));
  const dim3 grid(unsigned((F + kWarps - 1) / kWarps), unsigned(E));
  gate_up_kernel<KC><<<grid, kWarps * 32, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), counts.data_ptr<int64_t>(),
      reinterpret_cast<const __nv_bfloat16*>(w1.data_ptr()), reinterpret_cast<__nv_bfloat16*>(act.data_ptr()), F,
      limit);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int KC>
void launch_down(const at::Tensor& act, const at::Tensor& counts, const at::Tensor& w2, at::Tensor& y,
                 cudaStream_t stream) {
  const int E = int(w2.size(0)), D = int(y.size(1));
  const dim3 grid(unsigned((D + kWarps - 1) / kWarps), unsigned(E));
  down_kernel<KC><<<grid, kWarps * 32, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(act.data_ptr()), counts.data_ptr<int64_t>(),
      reinterpret_cast<const __nv_bfloat16*>(w2.data_ptr()), reinterpret_cast<__nv_bfloat16*>(y.data_ptr()), D);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace

void grouped_swiglu_decode(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w1, const at::Tensor& w2,
                           float limit, at::Tensor& act, at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.size(0) == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  switch (x.size(1) / 256) {  // D (moe_decode.cpp checked the widths)
    case 1: launch_gate_up<1>(x, counts, w1, act, limit, stream); break;
    case 2: launch_gate_up<2>(x, counts, w1, act, limit, stream); break;
    case 4: launch_gate_up<4>(x, counts, w1, act, limit, stream); break;
    case 6: launch_gate_up<6>(x, counts, w1, act, limit, stream); break;
    case 8: launch_gate_up<8>(x, counts, w1, act, limit, stream); break;
    default: TORCH_CHECK(false, "grouped_swiglu_decode: hidden width ", x.size(1), " is not compiled");
  }
  switch (act.size(1) / 256) {  // F
    case 1: launch_down<1>(act, counts, w2, y, stream); break;
    case 2: launch_down<2>(act, counts, w2, y, stream); break;
    case 4: launch_down<4>(act, counts, w2, y, stream); break;
    case 6: launch_down<6>(act, counts, w2, y, stream); break;
    case 8: launch_down<8>(act, counts, w2, y, stream); break;
    case 12: launch_down<12>(act, counts, w2, y, stream); break;
    case 16: launch_down<16>(act, counts, w2, y, stream); break;
    default: TORCH_CHECK(false, "grouped_swiglu_decode: expert width ", act.size(1), " is not compiled");
  }
}

}  // namespace kiln::kernels::cuda
