// Decode-step routed experts (kernels/moe_decode.hpp): per (tile of 64 weight rows, expert) one
// CTA of 4 warps streams the tile's weights through a 4-stage cp.async pipeline in chunks of 64
// along K, with the expert's rows (up to 32 per pass) beside them, and multiplies them on the
// tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulation): weights as the 16-row A operand,
// the expert's rows as the 8-column B operand, so that a few rows cost no more tensor work than
// a GEMV while every weight byte is read once. Fragment layouts: kernels/mma_bf16.cuh.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/mma_bf16.cuh"
#include "kernels/moe_decode_cuda.hpp"
#include "kernels/smem_opt_in.cuh"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 128;          // 4 warps, 16 weight rows each
constexpr int kTileRows = 64;          // weight rows per CTA
constexpr int kChunk = 64;             // K per pipeline stage
constexpr int kStages = 4;             // cp.async stages in flight
constexpr int kPassRows = 32;          // the expert's rows per pass (4 mma column tiles of 8)
constexpr int kPitch = kChunk + 8;     // smem row pitch in bf16: 144 bytes, ldmatrix conflict-free
constexpr int kStageElems = (kTileRows + kPassRows) * kPitch;
constexpr std::size_t kSmemBytes = std::size_t(kStages) * kStageElems * sizeof(__nv_bfloat16);  // 55,296

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// GateUp: out = act [M, F]; the tile covers gate/up rows of 32 features f0 + [0, 32): warp w's
// A rows 0-7 are gate rows f0 + 8w + [0, 8), rows 8-15 the up rows of the same features, so a
// thread's accumulators hold gate and up of the same (feature, row) and the SwiGLU needs no
// exchange. Down: out = y [M, D]; the tile is rows d0 + [0, 64) of w2[e], warp w's A rows
// d0 + 16w + [0, 16). K: D for GateUp, F for Down (a multiple of kChunk). width: F or D.
template <bool kGateUp>
__global__ void __launch_bounds__(kThreads) experts_kernel(const __nv_bfloat16* __restrict__ x,
                                                          const int64_t* __restrict__ counts,
                                                          const __nv_bfloat16* __restrict__ w,
                                                          __nv_bfloat16* __restrict__ out, int K, int width,
                                                          float limit) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __shared__ int64_t start_s;
  const int e = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t n = counts[e];
  if (n == 0) return;  // an untouched expert: its weights are not read
  if (warp == 0) {     // the expert's first row: the sum of counts[0, e)
    int64_t s = 0;
    for (int i = lane; i < e; i += 32) s += counts[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) start_s = s;
  }
  __syncthreads();
  const int64_t start = start_s;
  const int tile0 = blockIdx.x * (kGateUp ? kTileRows / 2 : kTileRows);
  const int64_t rows_per_expert = kGateUp ? 2 * int64_t(width) : int64_t(width);
  const __nv_bfloat16* we = w + int64_t(e) * rows_per_expert * K;
  const int chunks = K / kChunk;
  // This thread's 4 weight pieces (16 bytes) and 2 row pieces per stage: fixed smem offsets and
  // global row pointers.
  const __nv_bfloat16* wsrc[4];
  int wdst[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int piece = tid + q * kThreads, i = piece >> 3, c = piece & 7;
    int64_t row;
    if (kGateUp) {
      const int ww = i >> 4, j = i & 15;
      row = j < 8 ? tile0 + 8 * ww + j : int64_t(width) + tile0 + 8 * ww + (j - 8);
    } else {
      row = tile0 + i;
    }
    wsrc[q] = we + row * K + c * 8;
    wdst[q] = i * kPitch + c * 8;
  }
  for (int64_t p0 = 0; p0 < n; p0 += kPassRows) {
    const int np = int(n - p0 < kPassRows ? n - p0 : kPassRows);
    const int tiles = (np + 7) / 8;
    const __nv_bfloat16* xsrc[2];
    int xdst[2], xbytes[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int piece = tid + q * kThreads, r = piece >> 3, c = piece & 7;
      xbytes[q] = r < np ? 16 : 0;  // rows past the expert's: zeros
      xsrc[q] = r < np ? x + (start + p0 + r) * K + c * 8 : x;
      xdst[q] = (kTileRows + r) * kPitch + c * 8;
    }
    auto load = [&](int chunk, int stage) {
      __nv_bfloat16* s = smem + stage * kStageElems;
      const int k0 = chunk * kChunk;
#pragma unroll
      for (int q = 0; q < 4; ++q) cp_async16(s + wdst[q], wsrc[q] + k0, 16);
#pragma unroll
      for (int q = 0; q < 2; ++q) cp_async16(s + xdst[q], xsrc[q] + (xbytes[q] ? k0 : 0), xbytes[q]);
    };
    float acc[4][4] = {};
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < chunks) load(s, s);
      cp_async_commit();
    }
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // chunk c landed for every thread; stage (c - 1) % kStages is read by none
      if (c + kStages - 1 < chunks) load(c + kStages - 1, (c + kStages - 1) % kStages);
      cp_async_commit();
      const __nv_bfloat16* s = smem + (c % kStages) * kStageElems;
      const __nv_bfloat16* a_rows = s + (warp * 16 + (lane & 15)) * kPitch + (lane >> 4) * 8;
#pragma unroll
      for (int kk = 0; kk < kChunk; kk += 16) {
        uint32_t a[4];
        ldmatrix_x4(a, a_rows + kk);
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          if (2 * jp >= tiles) break;
          uint32_t b[4];
          ldmatrix_x4(b, s + (kTileRows + 8 * (2 * jp + (lane >> 4)) + (lane & 7)) * kPitch + kk + ((lane >> 3) & 1) * 8);
          mma_bf16(acc[2 * jp], a, b[0], b[1]);
          if (2 * jp + 1 < tiles) mma_bf16(acc[2 * jp + 1], a, b[2], b[3]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every stage read before the next pass refills them
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= tiles) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 8 * j + 2 * t + h;  // the row within this pass
        if (r >= np) continue;
        const int64_t row = start + p0 + r;
        if (kGateUp) {
          // As the grouped-GEMM path rounds: gate and up to bf16, then the clamp, SiLU rounded.
          const float gb = fminf(round_bf16(acc[j][h]), limit);
          const float ub = fminf(fmaxf(round_bf16(acc[j][2 + h]), -limit), limit);
          const float sl = round_bf16(gb / (1.f + __expf(-gb)));
          out[row * width + tile0 + 8 * warp + g] = __float2bfloat16(sl * ub);
        } else {
          out[row * width + tile0 + 16 * warp + g] = __float2bfloat16(acc[j][h]);
          out[row * width + tile0 + 16 * warp + g + 8] = __float2bfloat16(acc[j][2 + h]);
        }
      }
    }
  }
}

template <bool kGateUp>
void launch(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w, at::Tensor& out, int K, int width,
            float limit, cudaStream_t stream) {
  static SmemOptIn opt_in;
  opt_in.raise(experts_kernel<kGateUp>, kSmemBytes, x.get_device());
  const int E = int(w.size(0));
  const dim3 grid(unsigned(kGateUp ? width / (kTileRows / 2) : width / kTileRows), unsigned(E));
  experts_kernel<kGateUp><<<grid, kThreads, kSmemBytes, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), counts.data_ptr<int64_t>(),
      reinterpret_cast<const __nv_bfloat16*>(w.data_ptr()), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), K, width,
      limit);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace

void grouped_swiglu_decode(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w1, const at::Tensor& w2,
                           float limit, at::Tensor& act, at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.size(0) == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int D = int(x.size(1)), F = int(act.size(1));
  TORCH_CHECK(D % kChunk == 0 && F % kChunk == 0, "grouped_swiglu_decode: D ", D, " and F ", F,
              " must be multiples of ", kChunk);
  launch<true>(x, counts, w1, act, /*K=*/D, /*width=*/F, limit, stream);
  launch<false>(act, counts, w2, y, /*K=*/F, /*width=*/D, 0.f, stream);
}

}  // namespace kiln::kernels::cuda
