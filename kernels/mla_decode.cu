// Absorbed MLA decode attention over the paged latent cache (kernels/mla_decode.hpp).
//
// split kernel: one CTA of 8 warps per (context chunk, sequence). It streams the chunk's cache
// entries through a double buffer of 64-entry tiles in shared memory (cp.async, 16-byte pieces;
// each entry's cache row looked up in the block table once, by one thread), so each entry is
// read from memory once for all heads. The heads are the mma's N dimension (NT n-tiles of 8
// heads, padded; 20 heads: 3): the queries are B fragments loaded once (with the first tile)
// into registers and held for the whole chunk, so per tile only the cache is read from shared
// memory. Warp w = (key group kg = w / 4, D quarter dq = w % 4). Per tile:
//   S^T = K Q^T      [64 keys x 8NT heads]: warp (kg, dq) keys 32kg..32kg+31 (two m-tiles, A
//                    fragments by ldmatrix) over its quarter of the entry's C+R columns; the
//                    four quarters' partial scores summed in shared memory in quarter order
//   online softmax   warp w: heads w, w+8, ... (lane: keys lane, lane+32), fp32, base 2 (the
//                    scale folded with log2 e); P rounded to bf16 into shared memory
//                    [head][key], each head's rescale alpha beside it
//   O^T = O^T alpha + V^T P^T   [C x 8NT]: warp w the latent columns 16(w + 8j)..+15 (A
//                    fragments of V^T by ldmatrix.trans), P^T as B fragments
// and writes its unnormalised O with each head's max m and sum l (fp32) for the chunk.
// combine kernel: one CTA per (head, sequence): out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s.
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (g = lane / 4, t = lane % 4):
//   A (16x16, row): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16x8, col):  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C (16x8, fp32): c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "kernels/mla_decode_cuda.hpp"
#include "kernels/mma_bf16.cuh"
#include "kernels/smem_opt_in.cuh"

namespace kiln::kernels::cuda {

namespace {

constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kTile = 64;   // cache entries per tile
constexpr int kLdp = kTile + 8;  // P row stride (bf16), conflict-free fragment loads

__device__ __forceinline__ uint32_t ld32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// C latent width, R rope width, NT n-tiles of 8 heads (H <= 8 NT).
template <int C, int R, int NT>
struct Shape {
  static constexpr int D = C + R, DP = (D + 15) / 16 * 16, LD = DP + 8;
  static constexpr int kPieces = D / 8;
  static constexpr int KK = DP / 16;             // k-steps of 16 over an entry
  static constexpr int KQ = (KK + 3) / 4;        // of them per D quarter
  static constexpr int NH = NT * 8;              // heads, padded
  static constexpr int PSTR = NH + 1;            // partial-score row stride (fp32): conflict-free column reads
  static constexpr int kMTiles = C / 16;         // output m-tiles (16 latent columns)
  static constexpr int kMtPerWarp = (kMTiles + kWarps - 1) / kWarps;
  // Queries [NH][LD] bf16 (then reused for the partial scores [4][kTile][PSTR] fp32), the cache
  // double buffer [2][kTile][LD], P [NH][kLdp] bf16, alpha [NH] fp32, cache offsets [2][kTile].
  static constexpr std::size_t q_bytes = sizeof(__nv_bfloat16) * NH * LD;
  static constexpr std::size_t part_bytes = sizeof(float) * 4 * kTile * PSTR;
  static constexpr std::size_t head_bytes = ((q_bytes > part_bytes ? q_bytes : part_bytes) + 15) / 16 * 16;
  static constexpr std::size_t smem = head_bytes + sizeof(__nv_bfloat16) * (2 * kTile * LD + NH * kLdp) +
                                      sizeof(float) * NH + sizeof(int64_t) * 2 * kTile;
  static_assert(C % 16 == 0 && R % 8 == 0, "latent width a multiple of 16, rope width of 8 (16-byte pieces)");
  static_assert(kWarps == 8 && kTile == 64, "8 warps: 2 key groups of 32 x 4 D quarters");
};

template <int C, int R, int NT>
__global__ void __launch_bounds__(kThreads, 1)
    split_kernel(const __nv_bfloat16* __restrict__ q_lat, const __nv_bfloat16* __restrict__ q_rope,
                   const __nv_bfloat16* __restrict__ cache, const int64_t* __restrict__ table,
                   const int64_t* __restrict__ lengths, float* __restrict__ o_part, float* __restrict__ ml_part, int H,
                   int W, int Z, int chunk, int splits, float scale_log2) {
  using S = Shape<C, R, NT>;
  constexpr int D = S::D, DP = S::DP, LD = S::LD, NH = S::NH, KQ = S::KQ, PSTR = S::PSTR;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);             // [NH][LD]
  float* part = reinterpret_cast<float*>(smem_raw);                           // [4][kTile][PSTR], after Q
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(smem_raw + S::head_bytes);  // [2][kTile][LD]
  __nv_bfloat16* ps = ks + 2 * kTile * LD;                                    // [NH][kLdp]
  float* alpha_s = reinterpret_cast<float*>(ps + NH * kLdp);                  // [NH]
  int64_t* rows = reinterpret_cast<int64_t*>(alpha_s + NH);                   // [2][kTile] (-1: none)

  const int b = blockIdx.y, split = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kg = warp >> 2, dq = warp & 3;
  const int64_t cap = int64_t(W) * Z;
  int64_t len = lengths[b];
  len = len < 0 ? 0 : (len > cap ? cap : len);
  const int start = split * chunk;
  const int end = int(len < int64_t(start) + chunk ? len : int64_t(start) + chunk);
  float* ml = ml_part + (int64_t(b) * splits + split) * H * 2;
  if (start >= end) {  // nothing of this sequence in the chunk: the combine skips it
    for (int h = tid; h < H; h += kThreads) {
      ml[2 * h] = -INFINITY;
      ml[2 * h + 1] = 0.f;
    }
    return;
  }
  const int64_t* row_pages = table + int64_t(b) * W;
  auto load_tile = [&](int stage, int k0) {
    int64_t* ro = rows + stage * kTile;
    if (tid < kTile) {
      const int pos = k0 + tid;
      ro[tid] = pos < end ? (row_pages[pos / Z] * Z + pos % Z) * D : -1;
    }
    __syncthreads();
    __nv_bfloat16* dst = ks + stage * kTile * LD;
    for (int i = tid; i < kTile * S::kPieces; i += kThreads) {
      const int r = i / S::kPieces, piece = i - r * S::kPieces;
      const int64_t off = ro[r];
      cp_async16(dst + r * LD + piece * 8, off >= 0 ? cache + off + piece * 8 : cache, off >= 0 ? 16 : 0);
    }
    cp_async_commit();
  };

  // Queries by cp.async in the first tile's group (rows >= H zero-filled); padding columns
  // (D not a multiple of 16) zeroed here, P's padded heads zeroed once (alpha 0 there).
  constexpr int kQPieces = C / 8 + R / 8;
  for (int i = tid; i < NH * kQPieces; i += kThreads) {
    const int h = i / kQPieces, piece = i - h * kQPieces;
    const __nv_bfloat16* src = q_lat;
    int bytes = 0;
    if (h < H) {
      src = piece < C / 8 ? q_lat + (int64_t(b) * H + h) * C + piece * 8
                          : q_rope + (int64_t(b) * H + h) * R + (piece - C / 8) * 8;
      bytes = 16;
    }
    cp_async16(qs + h * LD + piece * 8, src, bytes);
  }
  load_tile(0, start);
  const __nv_bfloat16 zero = __float2bfloat16(0.f);
  if constexpr (DP > D) {
    for (int i = tid; i < NH * (DP - D); i += kThreads) qs[(i / (DP - D)) * LD + D + i % (DP - D)] = zero;
    for (int i = tid; i < 2 * kTile * (DP - D); i += kThreads) ks[(i / (DP - D)) * LD + D + i % (DP - D)] = zero;
  }
  for (int i = tid; i < (NH - H) * kLdp; i += kThreads) ps[H * kLdp + i] = zero;
  for (int h = H + tid; h < NH; h += kThreads) alpha_s[h] = 0.f;

  // This warp's heads (softmax): w + 8j, j < NT; running max and this lane's share of the sum.
  float m_h[NT], l_h[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    m_h[j] = -INFINITY;
    l_h[j] = 0.f;
  }
  float o[S::kMtPerWarp][NT][4];
#pragma unroll
  for (int j = 0; j < S::kMtPerWarp; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][nt][e] = 0.f;
  uint32_t qb[KQ][NT][2];  // B fragments of Q^T over this warp's D quarter, loaded with the first tile

  const int tiles = (end - start + kTile - 1) / kTile;
  for (int it = 0; it < tiles; ++it) {
    const int k0 = start + it * kTile;
    if (it + 1 < tiles) {
      load_tile((it + 1) & 1, k0 + kTile);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int j = 0; j < KQ; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int kk = dq * KQ + j;
          const __nv_bfloat16* q = qs + (nt * 8 + g) * LD + kk * 16 + 2 * t;
          qb[j][nt][0] = kk < S::KK ? ld32(q) : 0u;
          qb[j][nt][1] = kk < S::KK ? ld32(q + 8) : 0u;
        }
      __syncthreads();  // the queries' shared memory becomes the partial scores
    }
    const __nv_bfloat16* kt = ks + (it & 1) * kTile * LD;

    // S^T partial: keys 32kg + 16mt + (g, g+8), heads nt*8 + 2t (+1), this warp's D quarter.
    float s[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
    {
      const int mi = lane >> 3, r = lane & 7;
#pragma unroll
      for (int j = 0; j < KQ; ++j) {
        const int kk = dq * KQ + j;
        if (KQ * 4 != S::KK && kk >= S::KK) break;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          // Matrices (keys 0-7, k 0-7), (keys 8-15, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 8-15).
          uint32_t a[4];
          ldmatrix_x4(a, kt + (32 * kg + 16 * mt + r + 8 * (mi & 1)) * LD + kk * 16 + 8 * (mi >> 1));
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_bf16(s[mt][nt], a, qb[j][nt][0], qb[j][nt][1]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = 32 * kg + 16 * mt + g + 8 * (e >> 1), h = nt * 8 + 2 * t + (e & 1);
          part[(dq * kTile + key) * PSTR + h] = s[mt][nt][e];
        }
    __syncthreads();

    // Online softmax per head, lane: keys lane and lane + 32 of the tile.
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int h = warp + 8 * j;
      if (h >= H) break;  // warp-uniform
      float z[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int key = lane + 32 * i;
        const float sc = ((part[key * PSTR + h] + part[(kTile + key) * PSTR + h]) + part[(2 * kTile + key) * PSTR + h]) +
                         part[(3 * kTile + key) * PSTR + h];
        z[i] = k0 + key < end ? sc * scale_log2 : -INFINITY;
      }
      float mx = fmaxf(z[0], z[1]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_h[j], mx);  // finite: the tile holds a key of the sequence
      const float alpha = exp2f(m_h[j] - m_new);
      m_h[j] = m_new;
      const float p0 = exp2f(z[0] - m_new), p1 = exp2f(z[1] - m_new);
      l_h[j] = l_h[j] * alpha + (p0 + p1);
      ps[h * kLdp + lane] = __float2bfloat16(p0);
      ps[h * kLdp + lane + 32] = __float2bfloat16(p1);
      if (lane == 0) alpha_s[h] = alpha;
    }
    __syncthreads();

    // O^T = O^T * alpha + V^T P^T over the tile's 64 keys.
#pragma unroll
    for (int j = 0; j < S::kMtPerWarp; ++j) {
      if (S::kMTiles % kWarps != 0 && warp + kWarps * j >= S::kMTiles) break;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float a0 = alpha_s[nt * 8 + 2 * t], a1 = alpha_s[nt * 8 + 2 * t + 1];
        o[j][nt][0] *= a0;
        o[j][nt][1] *= a1;
        o[j][nt][2] *= a0;
        o[j][nt][3] *= a1;
      }
    }
    {
      const int mi = lane >> 3, r = lane & 7;
#pragma unroll
      for (int kk = 0; kk < kTile; kk += 16) {
        uint32_t bp[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const __nv_bfloat16* p_ = ps + (nt * 8 + g) * kLdp + kk + 2 * t;
          bp[nt][0] = ld32(p_);
          bp[nt][1] = ld32(p_ + 8);
        }
#pragma unroll
        for (int j = 0; j < S::kMtPerWarp; ++j) {
          const int c0 = (warp + kWarps * j) * 16;
          if (S::kMTiles % kWarps != 0 && c0 >= C) break;
          // Matrices of V [key][c]: (keys 0-7, c 0-7), (keys 0-7, c 8-15), (keys 8-15, c 0-7),
          // (keys 8-15, c 8-15), transposed: the A fragment of V^T [c][key].
          uint32_t a[4];
          ldmatrix_x4_trans(a, kt + (kk + r + 8 * (mi >> 1)) * LD + c0 + 8 * (mi & 1));
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_bf16(o[j][nt], a, bp[nt][0], bp[nt][1]);
        }
      }
    }
    __syncthreads();  // the next tile's load reuses this stage; its scores reuse part, ps and alpha
  }

#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int h = warp + 8 * j;
    if (h >= H) break;
    float l = l_h[j];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) {
      ml[2 * h] = m_h[j];
      ml[2 * h + 1] = l;
    }
  }
  float* op = o_part + (int64_t(b) * splits + split) * H * C;
#pragma unroll
  for (int j = 0; j < S::kMtPerWarp; ++j) {
    const int c0 = (warp + kWarps * j) * 16;
    if (S::kMTiles % kWarps != 0 && c0 >= C) break;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = nt * 8 + 2 * t + (e & 1), c = c0 + g + 8 * (e >> 1);
        if (h < H) op[int64_t(h) * C + c] = o[j][nt][e];
      }
  }
}

// One CTA per (head, sequence): weights 2^(m_s - M) in shared memory, then the columns.
__global__ void combine_kernel(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                               __nv_bfloat16* __restrict__ out, int H, int C, int splits) {
  extern __shared__ float wts[];  // [splits]
  __shared__ float inv_l;
  const int h = blockIdx.x, b = blockIdx.y;
  const float* ml = ml_part + int64_t(b) * splits * H * 2;
  if (threadIdx.x == 0) {
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, ml[(int64_t(s) * H + h) * 2]);
    float L = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float m = ml[(int64_t(s) * H + h) * 2];
      const float w = m == -INFINITY ? 0.f : exp2f(m - M);
      wts[s] = w;
      L += w * ml[(int64_t(s) * H + h) * 2 + 1];
    }
    inv_l = L > 0.f ? 1.f / L : 0.f;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < splits; ++s)
      if (wts[s] != 0.f) acc += wts[s] * o_part[((int64_t(b) * splits + s) * H + h) * C + c];
    out[(int64_t(b) * H + h) * C + c] = __float2bfloat16(acc * inv_l);
  }
}

// Chunks per sequence from the static shapes (B, the table's W*Z capacity, the SM count): as
// many as fill the SMs with one wave of CTAs (one resident per SM), at least one, at most one
// per tile. Measured on an H200 (docs/benchmarks.md): one chunk per sequence is fastest from
// batch 128 up, four at batch 32; more chunks per sequence than one wave only add CTA set-up and
// partial results to combine. Returns {splits, chunk}.
std::pair<int64_t, int64_t> choose_splits(int64_t B, int64_t cap, int sms) {
  const int64_t tiles = (cap + kTile - 1) / kTile;
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(sms / B, tiles));  // B >= 1: the launcher returns on 0
  const int64_t chunk = (tiles + want - 1) / want * kTile;
  return {(cap + chunk - 1) / chunk, chunk};
}

template <int C, int R, int NT>
void launch(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
            const at::Tensor& block_table, const at::Tensor& lengths, double scale, at::Tensor& out) {
  using S = Shape<C, R, NT>;
  const int64_t B = q_latent.size(0), H = q_latent.size(1), W = block_table.size(1), Z = cache.size(1);
  const int64_t cap = W * Z;
  if (B == 0 || H == 0) return;  // nothing to attend (an empty grid is not a launch)
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto [splits, chunk] = choose_splits(B, cap, sms);
  // The split kernel loads the queries in 16-byte pieces: rows of contiguous tensors whose
  // starts are 16-byte aligned (a view at an odd offset is copied).
  const auto aligned = [](const at::Tensor& t) {
    return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
  };
  const at::Tensor ql = aligned(q_latent), qr = aligned(q_rope);
  auto f32 = q_latent.options().dtype(at::kFloat);
  auto o_part = at::empty({B, splits, H, C}, f32);
  auto ml_part = at::empty({B, splits, H, 2}, f32);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto kernel = split_kernel<C, R, NT>;
  const std::size_t smem = S::smem;
  static_assert(S::smem <= 227 * 1024, "shared memory of the split kernel");
  static SmemOptIn opt_in;
  opt_in.raise(kernel, smem, q_latent.get_device());
  const float scale_log2 = float(scale * 1.4426950408889634);
  kernel<<<dim3(unsigned(splits), unsigned(B)), kThreads, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(ql.data_ptr()), static_cast<const __nv_bfloat16*>(qr.data_ptr()),
      static_cast<const __nv_bfloat16*>(cache.data_ptr()), static_cast<const int64_t*>(block_table.data_ptr()),
      static_cast<const int64_t*>(lengths.data_ptr()), static_cast<float*>(o_part.data_ptr()),
      static_cast<float*>(ml_part.data_ptr()), int(H), int(W), int(Z), int(chunk), int(splits), scale_log2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  combine_kernel<<<dim3(unsigned(H), unsigned(B)), 128, sizeof(float) * std::size_t(splits), stream>>>(
      static_cast<const float*>(o_part.data_ptr()), static_cast<const float*>(ml_part.data_ptr()),
      static_cast<__nv_bfloat16*>(out.data_ptr()), int(H), C, int(splits));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool mla_decode_widths_supported(int64_t c, int64_t r) { return (c == 512 && r == 64) || (c == 32 && r == 8); }

void mla_decode_attention(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
                          const at::Tensor& block_table, const at::Tensor& lengths, double scale, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(q_latent.device());
  const int64_t C = q_latent.size(2), R = q_rope.size(2);
  const int64_t H = q_latent.size(1);
  if (C == 512 && R == 64) {
    if (H <= 16) launch<512, 64, 2>(q_latent, q_rope, cache, block_table, lengths, scale, out);
    else if (H <= 24) launch<512, 64, 3>(q_latent, q_rope, cache, block_table, lengths, scale, out);
    else launch<512, 64, 4>(q_latent, q_rope, cache, block_table, lengths, scale, out);
  } else if (C == 32 && R == 8) {
    launch<32, 8, 4>(q_latent, q_rope, cache, block_table, lengths, scale, out);
  }
  else TORCH_CHECK(false, "mla_decode_attention: no kernel for latent width ", C, " and rope width ", R);
}

}  // namespace kiln::kernels::cuda
