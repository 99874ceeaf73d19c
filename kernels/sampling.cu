// Batched token sampling (kernels/sampling.hpp). A row is either
// - plain (greedy, or no top-k / top-p): split over a cluster of kCluster CTAs of 512 threads
//   (Hopper thread-block clusters; the CTAs exchange their shares through distributed shared
//   memory), each CTA one contiguous slice of the vocabulary: pass 1 over its slice, the
//   cluster's statistics merged in rank order by every CTA, then each CTA's kept mass per warp
//   chunk, the CTA holding u * total found in rank order, its chunk, and the entry inside it
//   (block_find);
// - filtered (top-k or top-p on): one CTA for the whole row (the cluster's other CTAs exit):
//   pass 1: online max / sum of exp / sum of exp * x over x = logits / T, and the arg-max;
//   top-k (if on): radix select of the k-th largest e = exp(x - max), four 8-bit digit passes;
//   top-p (if on): the same descent over digit histograms of kept mass (fixed point, 2^-32 of the
//     largest e, so that sums are exact and the choice deterministic), to the smallest kept e;
//   inverse CDF: kept mass per warp chunk, then the CTA finds the entry inside the chunk holding
//   u * total (block_find).
// Every reduction has a fixed order: the same inputs give the same token on every run. The
// passes over a row issue kGroups 16-byte loads per thread before taking them in index order.
#include <ATen/cuda/CUDAContext.h>
#include <cooperative_groups.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/philox.hpp"
#include "kernels/sampling_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kGroups = 4;  // 16-byte groups of 4 entries in flight per thread in the passes over a row
constexpr int kCluster = 8;  // CTAs per plain row (the portable cluster size)
constexpr double kMassScale = 4294967296.0;  // 2^32: e in [0, 1] as fixed point

struct Soft {
  float m, s, w;  // running max of x, sum exp(x - m), sum exp(x - m) * x
};

__device__ inline void soft_add(Soft& a, float x) {
  if (!(x > -INFINITY)) return;  // -inf (masked) or NaN: no mass
  if (x > a.m) {
    const float c = __expf(a.m - x);
    a.s = a.s * c + 1.f;
    a.w = a.w * c + x;
    a.m = x;
  } else {
    const float e = __expf(x - a.m);
    a.s += e;
    a.w += e * x;
  }
}

__device__ inline Soft soft_merge(Soft a, Soft b) {
  if (b.m == -INFINITY) return a;
  if (a.m == -INFINITY) return b;
  const float m = fmaxf(a.m, b.m), ca = __expf(a.m - m), cb = __expf(b.m - m);
  return Soft{m, a.s * ca + b.s * cb, a.w * ca + b.w * cb};
}

// The larger (value, index); equal values: the lower index.
__device__ inline void argmax_merge(float& v, int64_t& i, float ov, int64_t oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

__device__ inline unsigned long long warp_sum_u64(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ inline float warp_sum_f(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct Row {
  const float* logits;
  int64_t V;
  float T, m;  // temperature (1 for greedy rows), max of logits / T
  bool vec;    // 16-byte loads: the row's start 16-byte aligned
  __device__ float e(int64_t i) const { return e_of(logits[i]); }
  __device__ float e_of(float logit) const {
    const float x = logit / T;
    return x > -INFINITY ? __expf(x - m) : 0.f;
  }
};

// Entries i..i+3 of the row (-inf past hi): one 16-byte load when `vec` (the row's start
// 16-byte aligned and i a multiple of 4) and the group is whole, else element by element.
__device__ inline float4 load4(const float* __restrict__ row, int64_t i, int64_t hi, bool vec) {
  if (vec && i + 4 <= hi) return *reinterpret_cast<const float4*>(row + i);
  return make_float4(i < hi ? row[i] : -INFINITY, i + 1 < hi ? row[i + 1] : -INFINITY,
                     i + 2 < hi ? row[i + 2] : -INFINITY, i + 3 < hi ? row[i + 3] : -INFINITY);
}
__device__ inline float at4(const float4& v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

__device__ inline unsigned long long fixed_mass(float e) { return (unsigned long long)(double(e) * kMassScale); }

// Histogram of the digit (bits >> shift) & 255 of e over the entries with e >= floor_e and
// (bits & mask) == prefix: counts and fixed-point mass per digit, in shared memory.
__device__ void digit_histogram(const Row& r, float floor_e, uint32_t prefix, uint32_t mask, int shift,
                                unsigned* count, unsigned long long* mass) {
  const int tid = threadIdx.x, lane = tid & 31;
  for (int i = tid; i < 256; i += kThreads) {
    count[i] = 0;
    mass[i] = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < r.V; base += kThreads) {  // the whole warp in every iteration
    const int64_t i = base + tid;
    const float e = i < r.V ? r.e(i) : 0.f;
    const uint32_t bits = __float_as_uint(e);
    const unsigned key = i < r.V && e >= floor_e && (bits & mask) == prefix ? (bits >> shift) & 255u : 256u;
    unsigned todo = __ballot_sync(0xffffffffu, key != 256u);
    while (todo) {  // one round per distinct digit in the warp
      const int leader = __ffs(todo) - 1;
      const unsigned k = __shfl_sync(0xffffffffu, key, leader);
      const bool mine = key == k;
      const unsigned group = __ballot_sync(0xffffffffu, mine);
      const unsigned long long s = warp_sum_u64(mine ? fixed_mass(e) : 0ull);
      if (lane == leader) {
        atomicAdd(&count[k], unsigned(__popc(group)));
        atomicAdd(&mass[k], s);
      }
      todo &= ~group;
    }
  }
  __syncthreads();
}

// Pass 1 over entries [lo, hi) of the row: softmax statistics of x = logits / T and the arg-max
// of the logits, each thread's entries in index order, then the warp's tree, then the warps in
// order. The result in every thread of the CTA.
__device__ void block_soft_argmax(const Row& r, int64_t lo, int64_t hi, Soft& st, float& bv, int64_t& bi) {
  __shared__ Soft s_soft[kWarps];
  __shared__ float s_bv[kWarps];
  __shared__ int64_t s_bi[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  st = Soft{-INFINITY, 0.f, 0.f};
  bv = -INFINITY;
  bi = INT64_MAX;
  // Thread tid takes the groups of 4 entries at lo + 4 (tid + k kThreads), kGroups of them in
  // flight, then each group's entries in index order (lo is a multiple of 4).
  for (int64_t i0 = lo + 4 * int64_t(tid); i0 < hi; i0 += int64_t(4 * kGroups) * kThreads) {
    float4 v[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) v[j] = load4(r.logits, i0 + int64_t(4 * j) * kThreads, hi, r.vec);
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t i = i0 + int64_t(4 * j) * kThreads + q;
        const float l = at4(v[j], q);
        if (i >= hi) break;
        soft_add(st, l / r.T);
        if (l > bv) {
          bv = l;
          bi = i;
        }
      }
  }
  for (int o = 16; o > 0; o >>= 1) {
    st = soft_merge(st, Soft{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o),
                             __shfl_xor_sync(0xffffffffu, st.w, o)});
    argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  }
  if (lane == 0) {
    s_soft[warp] = st;
    s_bv[warp] = bv;
    s_bi[warp] = bi;
  }
  __syncthreads();
  st = s_soft[0];
  bv = s_bv[0];
  bi = s_bi[0];
  for (int w = 1; w < kWarps; ++w) {
    st = soft_merge(st, s_soft[w]);
    argmax_merge(bv, bi, s_bv[w], s_bi[w]);
  }
}

// The kept mass (e >= keep_e) of entries [begin, end), summed by one warp: each lane's groups
// of 4 entries in index order (kGroups in flight), then the warp's tree. The result in every lane.
__device__ float warp_kept_mass(const Row& r, int64_t begin, int64_t end, float keep_e) {
  const int lane = threadIdx.x & 31;
  float part = 0.f;
  for (int64_t i0 = begin + 4 * lane; i0 < end; i0 += 4 * 32 * kGroups) {  // begin: a multiple of 4
    float4 v[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) v[j] = load4(r.logits, i0 + 4 * 32 * j, end, r.vec);
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (i0 + 4 * 32 * j + q >= end) break;
        const float e = r.e_of(at4(v[j], q));
        part += e >= keep_e ? e : 0.f;
      }
  }
  return warp_sum_f(part);
}

// Of entries [cb, ce), the first whose kept mass (e >= keep_e, e > 0) from cb exceeds `left`,
// found by the whole CTA: thread i takes the i-th contiguous run of ceil((ce - cb) / kThreads)
// entries, the runs' masses are scanned in thread order (each run's range starts exactly where
// the one before it ends), and the thread whose range holds `left` walks its run. When rounding
// finds none: the last kept entry of [cb, ce), else `fallback`. Every thread of the CTA calls
// it; the result in every thread.
__device__ int64_t block_find(const Row& r, int64_t cb, int64_t ce, float keep_e, float left, int64_t fallback) {
  __shared__ float s_wsum[kWarps];
  __shared__ long long s_found, s_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t per = (ce - cb + kThreads - 1) / kThreads;
  const int64_t b0 = cb + tid * per < ce ? cb + tid * per : ce, b1 = b0 + per < ce ? b0 + per : ce;
  auto kept = [&](int64_t i) {
    const float e = r.e(i);
    return e >= keep_e && e > 0.f ? e : 0.f;
  };
  float sum = 0.f;
  long long last = -1;
  for (int64_t i = b0; i < b1; ++i) {
    const float e = kept(i);
    sum += e;
    if (e > 0.f) last = i;
  }
  float incl = sum;  // inclusive scan over the warp, then the warps before
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  float excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = 0.f;
  if (lane == 31) s_wsum[warp] = incl;
  if (tid == 0) {
    s_found = -1;
    s_last = -1;
  }
  __syncthreads();
  float before = 0.f;
  for (int w = 0; w < warp; ++w) before += s_wsum[w];
  const float lo = before + excl, hi = before + incl;  // this run's share of [0, total)
  if (sum > 0.f && lo <= left && left < hi) {
    float run = lo;
    long long found = last;  // rounding inside the run: its last kept entry
    for (int64_t i = b0; i < b1; ++i) {
      const float e = kept(i);
      if (e > 0.f && run + e > left) {
        found = i;
        break;
      }
      run += e;
    }
    atomicMax(&s_found, found);  // ranges are disjoint: one writer, unless rounding makes two
  }
  if (last >= 0) atomicMax(&s_last, last);
  __syncthreads();
  return s_found >= 0 ? int64_t(s_found) : (s_last >= 0 ? int64_t(s_last) : fallback);
}

// Of n masses in order, the index whose running sum first exceeds `left` (rounding: the last
// with mass), and `left` minus the masses before it.
__device__ inline int pick_chunk(const float* mass, int n, float left, float& rest) {
  float before = 0.f;
  int i = 0, last = 0;
  for (; i < n; ++i) {
    if (mass[i] > 0.f) last = i;
    if (before + mass[i] > left) break;
    before += mass[i];
  }
  if (i == n) i = last;
  rest = left - before;
  return i;
}

// A filtered row (top-k or top-p on), or any row: one CTA for the whole row.
__device__ void sample_full_row(const float* __restrict__ logits, int64_t V, int64_t b, double Td, int64_t k,
                                double p, int64_t seed, int64_t step, double* __restrict__ out) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool greedy = !(Td > 0);
  Row r{logits + b * V, V, greedy ? 1.f : float(Td), 0.f, V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0};

  __shared__ float s_chunk[kWarps];
  __shared__ unsigned s_count[256];
  __shared__ unsigned long long s_mass[256], s_total[kWarps];
  __shared__ uint32_t s_prefix;
  __shared__ unsigned long long s_above;
  __shared__ float s_target;
  __shared__ int s_warp;

  // Pass 1: softmax statistics of x = logits / T, and the arg-max of the logits.
  Soft st;
  float bv;
  int64_t bi;
  block_soft_argmax(r, 0, V, st, bv, bi);
  r.m = st.m;
  const float log_z = st.m + logf(st.s);
  const float entropy = log_z - st.w / st.s;

  int64_t token = bi == INT64_MAX ? 0 : bi;
  if (!greedy) {
    float keep_e = 0.f;  // the kept entries: e >= keep_e
    if (k > 0 && k < V) {  // the k-th largest e, digit by digit from the top
      uint32_t prefix = 0, mask = 0;
      int64_t rank = k;  // of the entries matching prefix, the rank-th largest
      for (int shift = 24; shift >= 0; shift -= 8) {
        digit_histogram(r, 0.f, prefix, mask, shift, s_count, s_mass);
        if (tid == 0) {
          int64_t above = 0;
          int d = 255;
          for (; d > 0; --d) {
            if (above + s_count[d] >= rank) break;
            above += s_count[d];
          }
          s_above = (unsigned long long)above;
          s_prefix = prefix | (uint32_t(d) << shift);
        }
        __syncthreads();
        rank -= int64_t(s_above);
        prefix = s_prefix;
        mask |= 255u << shift;
        __syncthreads();
      }
      keep_e = __uint_as_float(prefix);
    }
    if (p < 1.0) {  // the smallest e whose kept mass strictly above is < p * the kept mass
      unsigned long long total = 0;
      for (int64_t i = tid; i < V; i += kThreads) {
        const float e = r.e(i);
        if (e >= keep_e) total += fixed_mass(e);
      }
      total = warp_sum_u64(total);
      if (lane == 0) s_total[warp] = total;
      __syncthreads();
      total = 0;
      for (int w = 0; w < kWarps; ++w) total += s_total[w];
      const double limit = p * double(total);
      uint32_t prefix = 0, mask = 0;
      unsigned long long above = 0;
      for (int shift = 24; shift >= 0; shift -= 8) {
        digit_histogram(r, keep_e, prefix, mask, shift, s_count, s_mass);
        if (tid == 0) {
          unsigned long long a = above, chosen_above = above;
          int chosen = -1;
          for (int d = 255; d >= 0; --d) {
            if (s_count[d] == 0) continue;
            if (!(double(a) < limit)) break;
            chosen = d;
            chosen_above = a;
            a += s_mass[d];
          }
          s_prefix = chosen < 0 ? prefix : prefix | (uint32_t(chosen) << shift);
          s_above = chosen_above;
        }
        __syncthreads();
        prefix = s_prefix;
        above = s_above;
        mask |= 255u << shift;
        __syncthreads();
      }
      keep_e = fmaxf(keep_e, __uint_as_float(prefix));
    }
    // Inverse CDF over the kept mass, in vocabulary order: warp w holds entries [w C, (w+1) C).
    const int64_t C = ((V + kWarps - 1) / kWarps + 31) / 32 * 32;
    const int64_t begin = int64_t(warp) * C, end = begin + C < V ? begin + C : V;
    const float part = warp_kept_mass(r, begin, end, keep_e);
    if (lane == 0) s_chunk[warp] = part;
    __syncthreads();
    if (tid == 0) {
      float total = 0.f;
      for (int w = 0; w < kWarps; ++w) total += s_chunk[w];
      const float u = philox_uniform(uint64_t(seed), uint64_t(step));
      float rest;
      s_warp = pick_chunk(s_chunk, kWarps, u * (1.f - 1e-6f) * total, rest);
      s_target = rest;
    }
    __syncthreads();
    const int64_t cb = int64_t(s_warp) * C, ce = cb + C < V ? cb + C : V;
    token = block_find(r, cb, ce, keep_e, s_target, token);
  }
  if (tid == 0) {
    out[b * 3 + 0] = double(token);
    out[b * 3 + 1] = double(r.logits[token] / r.T - log_z);
    out[b * 3 + 2] = double(entropy);
  }
}

// One CTA's pass 1 over its slice of a plain row.
struct Share {
  Soft st;
  float bv;
  int64_t bi;
};

// A plain row (greedy, or no filter) over the cluster: CTA c holds entries [c L, (c+1) L).
__device__ void sample_split_row(const float* __restrict__ logits, int64_t V, int64_t b, double Td, int64_t seed,
                                 int64_t step, double* __restrict__ out) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool greedy = !(Td > 0);
  Row r{logits + b * V, V, greedy ? 1.f : float(Td), 0.f, V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0};
  const int64_t L = ((V + kCluster - 1) / kCluster + 31) / 32 * 32;
  const int64_t lo = int64_t(rank) * L < V ? int64_t(rank) * L : V, hi = lo + L < V ? lo + L : V;

  __shared__ Share s_share, s_all;
  __shared__ float s_warp_mass[kWarps], s_cta_mass[kCluster];
  __shared__ float s_target;
  __shared__ int s_chosen, s_warp;

  Soft st;
  float bv;
  int64_t bi;
  block_soft_argmax(r, lo, hi, st, bv, bi);
  if (tid == 0) s_share = Share{st, bv, bi};
  cluster.sync();  // every CTA's share written
  if (tid == 0) {  // merged in rank order by every CTA: the same statistics in all of them
    Share all = *cluster.map_shared_rank(&s_share, 0);
    for (int c = 1; c < kCluster; ++c) {
      const Share o = *cluster.map_shared_rank(&s_share, c);
      all.st = soft_merge(all.st, o.st);
      argmax_merge(all.bv, all.bi, o.bv, o.bi);
    }
    s_all = all;
  }
  __syncthreads();
  const Share all = s_all;
  r.m = all.st.m;
  const float log_z = all.st.m + logf(all.st.s);
  const float entropy = log_z - all.st.w / all.st.s;
  const int64_t argmax = all.bi == INT64_MAX ? 0 : all.bi;
  if (greedy) {
    cluster.sync();  // no CTA leaves while another reads its share
    if (rank == 0 && tid == 0) {
      out[b * 3 + 0] = double(argmax);
      out[b * 3 + 1] = double(r.logits[argmax] - log_z);
      out[b * 3 + 2] = double(entropy);
    }
    return;
  }
  // The slice's mass per warp chunk: warp w holds [lo + w Cw, lo + (w+1) Cw).
  const int64_t Cw = ((hi - lo + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int64_t wb = lo + int64_t(warp) * Cw < hi ? lo + int64_t(warp) * Cw : hi, we = wb + Cw < hi ? wb + Cw : hi;
  const float part = warp_kept_mass(r, wb, we, 0.f);
  if (lane == 0) s_warp_mass[warp] = part;
  __syncthreads();
  if (tid == 0) {
    float m = 0.f;
    for (int w = 0; w < kWarps; ++w) m += s_warp_mass[w];
    s_cta_mass[rank] = m;
  }
  cluster.sync();  // every CTA's mass written (each CTA's own s_cta_mass[rank])
  if (tid == 0) {  // the CTA holding u * total, the same choice in every CTA
    float mass[kCluster], total = 0.f;
    for (int c = 0; c < kCluster; ++c) {
      mass[c] = cluster.map_shared_rank(s_cta_mass, c)[c];
      total += mass[c];
    }
    const float u = philox_uniform(uint64_t(seed), uint64_t(step));
    float rest;
    s_chosen = pick_chunk(mass, kCluster, u * (1.f - 1e-6f) * total, rest);
    s_target = rest;
  }
  cluster.sync();  // no CTA leaves while another reads its mass
  if (s_chosen != rank) return;
  if (tid == 0) {
    float rest;
    s_warp = pick_chunk(s_warp_mass, kWarps, s_target, rest);
    s_target = rest;
  }
  __syncthreads();
  const int64_t cb = lo + int64_t(s_warp) * Cw < hi ? lo + int64_t(s_warp) * Cw : hi, ce = cb + Cw < hi ? cb + Cw : hi;
  const int64_t token = block_find(r, cb, ce, 0.f, s_target, argmax);
  if (tid == 0) {
    out[b * 3 + 0] = double(token);
    out[b * 3 + 1] = double(r.logits[token] / r.T - log_z);
    out[b * 3 + 2] = double(entropy);
  }
}

// Grid: kCluster CTAs per row, row b's cluster at blocks [b kCluster, (b+1) kCluster).
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads, 2)
    sample_kernel(const float* __restrict__ logits, int64_t V, const double* __restrict__ temperature,
                  const int64_t* __restrict__ top_k, const double* __restrict__ top_p,
                  const int64_t* __restrict__ seed, const int64_t* __restrict__ step, double* __restrict__ out) {
  const int64_t b = blockIdx.x / kCluster;
  const double T = temperature[b];
  const int64_t k = top_k[b];
  const double p = top_p[b];
  if (T > 0 && ((k > 0 && k < V) || p < 1.0)) {  // filtered: the cluster's first CTA alone
    if (blockIdx.x % kCluster == 0) sample_full_row(logits, V, b, T, k, p, seed[b], step[b], out);
    return;
  }
  sample_split_row(logits, V, b, T, seed[b], step[b], out);
}
}  // namespace

void sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                 const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& step, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t B = logits.size(0), V = logits.size(1);
  if (B == 0) return;
  TORCH_CHECK(B <= int64_t(INT32_MAX) / kCluster, "sample_rows: ", B, " rows");
  sample_kernel<<<unsigned(B * kCluster), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      logits.data_ptr<float>(), V, temperature.data_ptr<double>(), top_k.data_ptr<int64_t>(),
      top_p.data_ptr<double>(), seed.data_ptr<int64_t>(), step.data_ptr<int64_t>(), out.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
