// Absorbed MLA decode attention over the paged latent cache (kernels/mla_decode.hpp).
//
// split kernel: one CTA of 8 warps per (context chunk, sequence). The CTA keeps the sequence's
// queries (all heads, padded to 32 rows, loaded by cp.async with the first tile) in shared
// memory and streams the chunk's cache entries through a double buffer of 64-entry tiles
// (cp.async, 16-byte pieces; each entry's cache row looked up in the block table once, by one
// thread, into shared memory), so each entry is read from memory once for all heads. Per tile:
//   S = Q K^T        [32 x 64]: warp w the tile's keys 8w..8w+7, mma.sync m16n8k16 bf16
//   online softmax   (fp32, base 2: the scale folded with log2 e); row maxima across warps
//                    through shared memory, P rounded to bf16 into shared memory
//   O = O * alpha + P V   [32 x C]: warp w the output columns 16w, 16(w+8), ...; V = the
//                    tile's latent columns, fragments by ldmatrix.trans
// and writes its unnormalised O with the row max m and sum l (fp32) for the chunk.
// combine kernel: one CTA per (head, sequence): out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s.
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (g = lane / 4, t = lane % 4):
//   A (16x16, row): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16x8, col):  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C (16x8, fp32): c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1)
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "kernels/mla_decode_cuda.hpp"
#include "kernels/mma_bf16.cuh"

namespace kiln::kernels::cuda {

namespace {

constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kTile = 64;   // cache entries per tile
constexpr int kKeysPerWarp = kTile / kWarps;  // of S = Q K^T
constexpr int kKeyTiles = kKeysPerWarp / 8;   // n-tiles of 8 keys per warp
static_assert(kKeysPerWarp % 8 == 0, "whole n-tiles of keys per warp");
constexpr int kRows = 32;   // query rows: heads, padded
constexpr int kLdp = kTile + 8;  // P row stride (bf16), conflict-free fragment loads

template <int C, int R>
struct Shape {
  static constexpr int D = C + R;                // entry width
  static constexpr int DP = (D + 15) / 16 * 16;  // padded to the mma's k
  static constexpr int LD = DP + 8;              // shared row stride (bf16): 16-byte rows, no bank conflicts
  static constexpr int kPieces = D / 8;          // 16-byte pieces per entry
  static constexpr int kPairs = C / 16;          // 16-column groups of the output
  static constexpr int kPairsPerWarp = (kPairs + kWarps - 1) / kWarps;
  static constexpr std::size_t smem = sizeof(__nv_bfloat16) * (kRows * LD + 2 * kTile * LD + kRows * kLdp) +
                                      sizeof(float) * kWarps * kRows + sizeof(int64_t) * 2 * kTile;
  static_assert(C % 16 == 0 && R % 8 == 0, "latent width a multiple of 16, rope width of 8 (16-byte pieces)");
};

__device__ __forceinline__ uint32_t ld32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The A fragment of mma.m16n8k16 for this thread from a row-major bf16 tile with leading
// dimension ld, `p` at (row g, column 2t) of the 16x16 block: rows g and g+8, columns 2t and
// 2t+8 (PTX ISA, "Matrix Fragments for mma.m16n8k16").
__device__ __forceinline__ void ld_a_fragment(uint32_t (&a)[4], const __nv_bfloat16* p, int ld) {
  a[0] = ld32(p);
  a[1] = ld32(p + 8 * ld);
  a[2] = ld32(p + 8);
  a[3] = ld32(p + 8 * ld + 8);
}

// q_lat [B, H, C], q_rope [B, H, R], cache [G*Z, D], table [B, W], lengths [B];
// o_part [B, splits, H, C] fp32, ml_part [B, splits, H, 2] fp32 (m in base 2 of the scaled score, l).
template <int C, int R>
__global__ void __launch_bounds__(kThreads, 1)
    split_kernel(const __nv_bfloat16* __restrict__ q_lat, const __nv_bfloat16* __restrict__ q_rope,
                 const __nv_bfloat16* __restrict__ cache, const int64_t* __restrict__ table,
                 const int64_t* __restrict__ lengths, float* __restrict__ o_part, float* __restrict__ ml_part, int H,
                 int W, int Z, int chunk, int splits, float scale_log2) {
  using S = Shape<C, R>;
  constexpr int D = S::D, DP = S::DP, LD = S::LD;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kRows][LD]
  __nv_bfloat16* ks = qs + kRows * LD;                               // [2][kTile][LD]
  __nv_bfloat16* ps = ks + 2 * kTile * LD;                           // [kRows][kLdp]
  float* red = reinterpret_cast<float*>(ps + kRows * kLdp);          // [kWarps][kRows]
  int64_t* rows = reinterpret_cast<int64_t*>(red + kWarps * kRows);  // [2][kTile] cache offsets (-1: none)

  const int b = blockIdx.y, split = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
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

  // Every thread issues its 16-byte pieces of a tile without waiting on a page lookup: one
  // thread per entry looks its row up first (all at once), then the CTA syncs. The caller
  // syncs between a stage's last reads and its next load.
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

  // Queries by cp.async too, in the first tile's group: row h < H of q_latent then q_rope (both
  // 16-byte aligned, the launcher checks), rows >= H zero-filled; the columns >= D (only when
  // D is not a multiple of 16) and the entries' padding columns set to zero here.
  constexpr int kQPieces = C / 8 + R / 8;
  for (int i = tid; i < kRows * kQPieces; i += kThreads) {
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
    for (int i = tid; i < kRows * (DP - D); i += kThreads) qs[(i / (DP - D)) * LD + D + i % (DP - D)] = zero;
    for (int i = tid; i < 2 * kTile * (DP - D); i += kThreads) {
      const int r = i / (DP - D), d = D + i % (DP - D);
      ks[r * LD + d] = zero;
    }
  }

  // This thread's query rows: g, g+8 (m-tile 0), 16+g, 24+g (m-tile 1).
  float m_row[4], l_row[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m_row[i] = -INFINITY;
    l_row[i] = 0.f;
  }
  float o[S::kPairsPerWarp][2][2][4];
#pragma unroll
  for (int pp = 0; pp < S::kPairsPerWarp; ++pp)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[pp][mt][nt][e] = 0.f;

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
    const __nv_bfloat16* kt = ks + (it & 1) * kTile * LD;

    // S = Q K^T over this warp's kKeysPerWarp keys.
    float s[2][kKeyTiles][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll 4
    for (int kk = 0; kk < DP; kk += 16) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        ld_a_fragment(a[mt], qs + (mt * 16 + g) * LD + kk + 2 * t, LD);
      }
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt) {
        const __nv_bfloat16* k_ = kt + (warp * kKeysPerWarp + nt * 8 + g) * LD + kk + 2 * t;
        const uint32_t b0 = ld32(k_), b1 = ld32(k_ + 8);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) mma_bf16(s[mt][nt], a[mt], b0, b1);
      }
    }

    // Online softmax. Element (mt, nt, e): row index i = 2 mt + e / 2, key
    // warp * kKeysPerWarp + nt*8 + 2t + e%2.
    float tile_max[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) tile_max[i] = -INFINITY;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + warp * kKeysPerWarp + nt * 8 + 2 * t + (e & 1);
          const float z = key < end ? s[mt][nt][e] * scale_log2 : -INFINITY;
          s[mt][nt][e] = z;
          tile_max[2 * mt + (e >> 1)] = fmaxf(tile_max[2 * mt + (e >> 1)], z);
        }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
    }
    if (t == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp * kRows + 8 * i + g] = tile_max[i];  // row 8i + g
    }
    __syncthreads();
    float alpha[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float mx = red[8 * i + g];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, red[w * kRows + 8 * i + g]);
      const float m_new = fmaxf(m_row[i], mx);  // finite: the tile holds a key of the sequence
      alpha[i] = exp2f(m_row[i] - m_new);
      m_row[i] = m_new;
      l_row[i] *= alpha[i];
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int i = 2 * mt + hi;
          const float p0 = exp2f(s[mt][nt][2 * hi] - m_row[i]), p1 = exp2f(s[mt][nt][2 * hi + 1] - m_row[i]);
          l_row[i] += p0 + p1;
          *reinterpret_cast<__nv_bfloat162*>(ps + (16 * mt + 8 * hi + g) * kLdp + warp * kKeysPerWarp + nt * 8 +
                                             2 * t) =
              __floats2bfloat162_rn(p0, p1);
        }
#pragma unroll
    for (int pp = 0; pp < S::kPairsPerWarp; ++pp)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[pp][mt][nt][e] *= alpha[2 * mt + (e >> 1)];
    __syncthreads();

    // O += P V: V = the tile's latent columns [kTile, C].
#pragma unroll
    for (int kk = 0; kk < kTile; kk += 16) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        ld_a_fragment(a[mt], ps + (mt * 16 + g) * kLdp + kk + 2 * t, kLdp);
      }
#pragma unroll
      for (int pp = 0; pp < S::kPairsPerWarp; ++pp) {
        const int pair = warp + pp * kWarps;
        if (S::kPairs % kWarps != 0 && pair >= S::kPairs) break;
        // Matrices: (keys kk..+7, cols c0..+7), (keys kk+8.., c0..), (kk.., c0+8..), (kk+8.., c0+8..).
        const int mi = lane >> 3, r = lane & 7;
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, kt + (kk + r + 8 * (mi & 1)) * LD + pair * 16 + 8 * (mi >> 1));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_bf16(o[pp][mt][0], a[mt], bv[0], bv[1]);
          mma_bf16(o[pp][mt][1], a[mt], bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // the next tile's load reuses this stage, its softmax ps and red
  }

  // l: this thread's keys -> the quad's -> every warp's.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    l_row[i] += __shfl_xor_sync(0xffffffffu, l_row[i], 1);
    l_row[i] += __shfl_xor_sync(0xffffffffu, l_row[i], 2);
  }
  if (t == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp * kRows + 8 * i + g] = l_row[i];
  }
  __syncthreads();
  if (warp == 0 && t == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = 8 * i + g;
      if (h >= H) continue;
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) l += red[w * kRows + h];
      ml[2 * h] = m_row[i];
      ml[2 * h + 1] = l;
    }
  }
  float* op = o_part + (int64_t(b) * splits + split) * H * C;
#pragma unroll
  for (int pp = 0; pp < S::kPairsPerWarp; ++pp) {
    const int pair = warp + pp * kWarps;
    if (S::kPairs % kWarps != 0 && pair >= S::kPairs) break;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int h = 16 * mt + 8 * hi + g;
          if (h >= H) continue;
          const int c = pair * 16 + nt * 8 + 2 * t;
          *reinterpret_cast<float2*>(op + int64_t(h) * C + c) =
              make_float2(o[pp][mt][nt][2 * hi], o[pp][mt][nt][2 * hi + 1]);
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

template <int C, int R>
void launch(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
            const at::Tensor& block_table, const at::Tensor& lengths, double scale, at::Tensor& out) {
  using S = Shape<C, R>;
  const int64_t B = q_latent.size(0), H = q_latent.size(1), W = block_table.size(1), Z = cache.size(1);
  const int64_t cap = W * Z;
  // Chunks per sequence from the static shapes: about two CTAs per SM over the batch, at
  // least one tile each.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t most = (cap + kTile - 1) / kTile;
  int64_t splits = std::max<int64_t>(1, std::min<int64_t>((2 * sms + B - 1) / B, most));
  int64_t chunk = (cap + splits - 1) / splits;
  chunk = (chunk + kTile - 1) / kTile * kTile;
  splits = (cap + chunk - 1) / chunk;
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
  auto kernel = split_kernel<C, R>;
  static_assert(S::smem <= 227 * 1024, "shared memory of the split kernel");
  static std::array<std::atomic<bool>, 64> raised{};  // per device, once (not again under graph capture)
  const int device = q_latent.get_device();
  if (device >= int(raised.size()) || !raised[std::size_t(device)].load()) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::smem)));
    if (device < int(raised.size())) raised[std::size_t(device)].store(true);
  }
  const float scale_log2 = float(scale * 1.4426950408889634);
  kernel<<<dim3(unsigned(splits), unsigned(B)), kThreads, S::smem, stream>>>(
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
  if (C == 512 && R == 64) launch<512, 64>(q_latent, q_rope, cache, block_table, lengths, scale, out);
  else if (C == 32 && R == 8) launch<32, 8>(q_latent, q_rope, cache, block_table, lengths, scale, out);
  else TORCH_CHECK(false, "mla_decode_attention: no kernel for latent width ", C, " and rope width ", R);
}

}  // namespace kiln::kernels::cuda
