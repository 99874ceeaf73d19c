// Batched token sampling (kernels/sampling.hpp). Every row runs on a cluster of kCluster CTAs of
// 512 threads (Hopper thread-block clusters; the CTAs exchange their shares through distributed
// shared memory), each CTA one contiguous slice of the vocabulary, which it reads from global
// memory once and keeps in shared memory for the rest of the row:
// 1. pass 1 over the slice: online max / sum of exp / sum of exp * x over x = logits / T, and the
//    arg-max; the cluster's statistics merged in rank order by every CTA; greedy rows end here;
// 2. the slice's logits replaced by e = exp(x - max) in shared memory;
// 3. rows with top-k or top-p: the threshold on e found by a radix select over e's bits (three
//    10-bit digits; e in [0, 1] has < 2^30 bit patterns, ordered as the values): each pass, every
//    CTA's histogram of its candidates (counts, and for top-p fixed-point masses, 2^-32 of the
//    largest e, so that sums are exact integers and the choice does not depend on the order of
//    the shared-memory atomics), the cluster's histograms summed per digit by every CTA, the
//    digit chosen from the suffix sums by the whole CTA. Top-k: the k-th largest e. Top-p (after
//    top-k): the smallest kept e whose kept mass strictly above is < p * the kept mass;
// 4. inverse CDF over the kept entries in vocabulary order: the slice's kept mass per warp chunk,
//    the CTA holding u * total found in rank order, its chunk, and the entry inside it
//    (block_find).
// Every floating-point reduction has a fixed order and the integer ones are exact: the same
// inputs give the same token on every run. Shared memory per CTA: the slice (kernels/
// sampling_cuda.hpp's kMaxVocab bounds it) and two histograms (double-buffered, so that one
// cluster barrier per pass separates a pass's reads of the other CTAs' histograms from their
// reuse).
#include <ATen/cuda/CUDAContext.h>
#include <cooperative_groups.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/philox.hpp"
#include "kernels/sampling_cuda.hpp"
#include "kernels/smem_opt_in.cuh"

namespace kiln::kernels::cuda {

namespace {
namespace cg = cooperative_groups;
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kGroups = 4;   // 16-byte groups of 4 entries in flight per thread in pass 1
constexpr int kCluster = 8;  // CTAs per row (the portable cluster size)
constexpr int kDigitBits = 10, kBins = 1 << kDigitBits, kDigits = 3;  // keys: e's bits, < 2^30
constexpr double kMassScale = 4294967296.0;  // 2^32: e in [0, 1] as fixed point

// Entries per CTA: the row split in kCluster slices, each a multiple of 4 entries (whole 16-byte
// groups, so that every slice of an aligned row starts aligned).
constexpr int64_t slice_length(int64_t V) { return ((V + kCluster - 1) / kCluster + 3) / 4 * 4; }
static_assert(slice_length(kMaxVocab) * 4 + 2 * kBins * 12 + 4096 <= 227 * 1024, "shared memory of kMaxVocab");

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

__device__ inline float warp_sum_f(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ inline unsigned long long fixed_mass(float e) { return (unsigned long long)(double(e) * kMassScale); }

// Entries i..i+3 of the row (-inf past hi): one 16-byte load when `vec` (the row's start
// 16-byte aligned and i a multiple of 4) and the group is whole, else element by element.
__device__ inline float4 load4(const float* __restrict__ row, int64_t i, int64_t hi, bool vec) {
  if (vec && i + 4 <= hi) return *reinterpret_cast<const float4*>(row + i);
  return make_float4(i < hi ? row[i] : -INFINITY, i + 1 < hi ? row[i + 1] : -INFINITY,
                     i + 2 < hi ? row[i + 2] : -INFINITY, i + 3 < hi ? row[i + 3] : -INFINITY);
}
__device__ inline float at4(const float4& v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

struct Share {  // one CTA's pass 1
  Soft st;
  float bv;
  int64_t bi;
};

struct Hist {  // one CTA's histogram of a digit: candidates and their fixed-point mass per digit
  unsigned count[kBins];
  unsigned mass_lo[kBins], mass_hi[kBins];  // the mass's low and high 32 bits
  __device__ unsigned long long mass(int d) const { return (unsigned long long)mass_hi[d] << 32 | mass_lo[d]; }
};

// h.mass(d) += x by 32-bit atomics (64-bit ones on shared memory are compare-and-swap loops):
// the low word's add returns the old value, so the thread whose add wraps it carries one into
// the high word, and the pair ends exact whatever the order.
__device__ inline void add_mass(Hist& h, unsigned d, unsigned long long x) {
  const unsigned lo = unsigned(x), old = atomicAdd(&h.mass_lo[d], lo);
  const unsigned hi = unsigned(x >> 32) + (old + lo < old ? 1u : 0u);
  if (hi) atomicAdd(&h.mass_hi[d], hi);
}

// Exclusive prefix sum of v over the CTA's threads in thread order, and the CTA's total. Every
// thread calls it.
__device__ unsigned long long block_exclusive_scan(unsigned long long v, unsigned long long& total) {
  __shared__ unsigned long long s_warp[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned long long incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  unsigned long long before = 0;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += s_warp[w];
    total += s_warp[w];
  }
  __syncthreads();  // s_warp free for the next call
  return before + incl - v;
}

// Pass 1 over the slice [lo, hi) of the row: copies it to `cache` (cache[j] = logits[lo + j], whole
// groups of 4, -inf past hi) and computes the softmax statistics of x = logits / T and the arg-max
// of the logits, each thread's entries in index order, then the warp's tree, then the warps in
// order. The result in every thread of the CTA.
__device__ void load_slice(const float* __restrict__ row, int64_t lo, int64_t hi, bool vec, float T,
                           float* __restrict__ cache, Share& out) {
  __shared__ Share s_part[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  Soft st{-INFINITY, 0.f, 0.f};
  float bv = -INFINITY;
  int64_t bi = INT64_MAX;
  // Thread tid takes the groups of 4 entries at lo + 4 (tid + k kThreads), kGroups of them in
  // flight, then each group's entries in index order (lo is a multiple of 4).
  for (int64_t i0 = lo + 4 * int64_t(tid); i0 < hi; i0 += int64_t(4 * kGroups) * kThreads) {
    float4 v[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) v[j] = load4(row, i0 + int64_t(4 * j) * kThreads, hi, vec);
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const int64_t g = i0 + int64_t(4 * j) * kThreads;
      if (g >= hi) break;
      *reinterpret_cast<float4*>(cache + (g - lo)) = v[j];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float l = at4(v[j], q);
        if (g + q >= hi) break;
        soft_add(st, l / T);
        if (l > bv) {
          bv = l;
          bi = g + q;
        }
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    st = soft_merge(st, Soft{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o),
                             __shfl_xor_sync(0xffffffffu, st.w, o)});
    argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  }
  if (lane == 0) s_part[warp] = Share{st, bv, bi};
  __syncthreads();
  out = s_part[0];
  for (int w = 1; w < kWarps; ++w) {
    out.st = soft_merge(out.st, s_part[w].st);
    argmax_merge(out.bv, out.bi, s_part[w].bv, s_part[w].bi);
  }
}

// The CTA's histogram of digit (key >> shift) & (kBins - 1) over the slice's n entries e (in
// shared memory) with key >= floor and (key & mask) == prefix, key = e's bits; masses only when
// `with_mass`. The integer atomics make the result independent of their order.
__device__ void slice_histogram(const float* __restrict__ e, int n, uint32_t floor, uint32_t prefix, uint32_t mask,
                                int shift, bool with_mass, Hist& h) {
  const int tid = threadIdx.x;
  for (int i = tid; i < kBins; i += kThreads) {
    h.count[i] = 0;
    h.mass_lo[i] = 0;
    h.mass_hi[i] = 0;
  }
  __syncthreads();
  for (int j = tid; j < n; j += kThreads) {
    const float v = e[j];
    const uint32_t key = __float_as_uint(v);
    if (key >= floor && (key & mask) == prefix) {
      const unsigned d = (key >> shift) & (kBins - 1);
      atomicAdd(&h.count[d], 1u);
      if (with_mass) add_mass(h, d, fixed_mass(v));
    }
  }
  __syncthreads();
}

// Thread t's two digits, in descending order over the CTA: kBins - 1 - 2t and kBins - 2 - 2t.
static_assert(kBins == 2 * kThreads, "two digits per thread");
struct Digits {
  int d0, d1;                        // d0 = d1 + 1
  unsigned long long c0, c1;         // candidates of the cluster per digit
  unsigned long long m0, m1;         // their mass
};

// The cluster's histograms (every CTA's `h`, after a cluster barrier) summed per digit for this
// thread's two digits.
__device__ Digits cluster_digits(cg::cluster_group& cluster, Hist& h, bool with_mass) {
  Digits g;
  g.d0 = kBins - 1 - 2 * int(threadIdx.x);
  g.d1 = g.d0 - 1;
  g.c0 = g.c1 = g.m0 = g.m1 = 0;
  for (int c = 0; c < kCluster; ++c) {
    const Hist* o = cluster.map_shared_rank(&h, c);
    g.c0 += o->count[g.d0];
    g.c1 += o->count[g.d1];
    if (with_mass) {
      g.m0 += o->mass(g.d0);
      g.m1 += o->mass(g.d1);
    }
  }
  return g;
}

// Of the first n entries e of the slice, the mass kept (e's bits >= keep, e > 0), summed in index
// order per lane over groups of 4, then the warp's tree; [begin, end): a multiple of 4 each.
__device__ float warp_kept_mass(const float* __restrict__ e, int begin, int end, uint32_t keep) {
  const int lane = threadIdx.x & 31;
  float part = 0.f;
  for (int j0 = begin + 4 * lane; j0 < end; j0 += 4 * 32) {
    const float4 v = *reinterpret_cast<const float4*>(e + j0);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float x = at4(v, q);
      if (j0 + q < end && __float_as_uint(x) >= keep && x > 0.f) part += x;
    }
  }
  return warp_sum_f(part);
}

// Of entries [cb, ce) of the slice, the first whose kept mass (e's bits >= keep, e > 0) from cb
// exceeds `left`, found by the whole CTA: thread i takes the i-th contiguous run of
// ceil((ce - cb) / kThreads) entries, the runs' masses are scanned in thread order (each run's
// range starts exactly where the one before it ends), and the thread whose range holds `left`
// walks its run. When rounding finds none: the last kept entry of [cb, ce), else -1. Every thread
// of the CTA calls it; the result (a slice index) in every thread.
__device__ int block_find(const float* __restrict__ e, int cb, int ce, uint32_t keep, float left) {
  __shared__ float s_wsum[kWarps];
  __shared__ int s_found, s_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (ce - cb + kThreads - 1) / kThreads;
  const int b0 = cb + tid * per < ce ? cb + tid * per : ce, b1 = b0 + per < ce ? b0 + per : ce;
  auto kept = [&](int i) {
    const float x = e[i];
    return __float_as_uint(x) >= keep && x > 0.f ? x : 0.f;
  };
  float sum = 0.f;
  int last = -1;
  for (int i = b0; i < b1; ++i) {
    const float x = kept(i);
    sum += x;
    if (x > 0.f) last = i;
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
    int found = last;  // rounding inside the run: its last kept entry
    for (int i = b0; i < b1; ++i) {
      const float x = kept(i);
      if (x > 0.f && run + x > left) {
        found = i;
        break;
      }
      run += x;
    }
    atomicMax(&s_found, found);  // ranges are disjoint: one writer, unless rounding makes two
  }
  if (last >= 0) atomicMax(&s_last, last);
  __syncthreads();
  return s_found >= 0 ? s_found : s_last;
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

// Grid: kCluster CTAs per row, row b's cluster at blocks [b kCluster, (b+1) kCluster); dynamic
// shared memory: slice_length(V) floats.
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads, 2)
    sample_kernel(const float* __restrict__ logits, int64_t V, const double* __restrict__ temperature,
                  const int64_t* __restrict__ top_k, const double* __restrict__ top_p,
                  const int64_t* __restrict__ seed, const int64_t* __restrict__ step, double* __restrict__ out) {
  extern __shared__ float4 s_cache4[];
  float* const cache = reinterpret_cast<float*>(s_cache4);
  __shared__ Share s_share, s_all;
  __shared__ Hist s_hist[2];
  __shared__ float s_warp_mass[kWarps], s_cta_mass[kCluster];
  __shared__ float s_target;
  __shared__ int s_chosen, s_warp, s_digit;
  __shared__ unsigned long long s_above;

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t b = blockIdx.x / kCluster;
  const double Td = temperature[b];
  const bool greedy = !(Td > 0);
  const float T = greedy ? 1.f : float(Td);
  const float* row = logits + b * V;
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  const int64_t L = slice_length(V);
  const int64_t lo = int64_t(rank) * L < V ? int64_t(rank) * L : V, hi = lo + L < V ? lo + L : V;
  const int n = int(hi - lo);

  // 1. Pass 1, merged in rank order by every CTA: the same statistics in all of them.
  Share mine;
  load_slice(row, lo, hi, vec, T, cache, mine);
  if (tid == 0) s_share = mine;
  cluster.sync();  // every CTA's share written
  if (tid == 0) {
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
  const float m = all.st.m, log_z = all.st.m + logf(all.st.s);
  const float entropy = log_z - all.st.w / all.st.s;
  const int64_t argmax = all.bi == INT64_MAX ? 0 : all.bi;
  auto write = [&](int64_t token) {
    out[b * 3 + 0] = double(token);
    out[b * 3 + 1] = double(row[token] / T - log_z);
    out[b * 3 + 2] = double(entropy);
  };
  if (greedy) {
    cluster.sync();  // no CTA leaves while another reads its share
    if (rank == 0 && tid == 0) write(argmax);
    return;
  }

  // 2. e = exp(x - m) in place (0 for -inf and NaN logits); whole groups, padding included.
  for (int j = 4 * tid; j < n; j += 4 * kThreads) {
    float4 v = s_cache4[j / 4];
    auto e_of = [&](float l) {
      const float x = l / T;
      return x > -INFINITY ? __expf(x - m) : 0.f;
    };
    v = make_float4(e_of(v.x), e_of(v.y), e_of(v.z), e_of(v.w));
    s_cache4[j / 4] = v;
  }
  __syncthreads();

  // 3. The threshold: kept entries are those whose e has bits >= keep.
  const int64_t k = top_k[b];
  const double p = top_p[b];
  uint32_t keep = 0;
  int pass = 0;  // histogram passes so far (the buffer alternates)
  if (k > 0 && k < V) {  // the k-th largest e, digit by digit from the top
    uint32_t prefix = 0, mask = 0;
    unsigned long long rank_left = (unsigned long long)k;  // of the candidates, the rank_left-th largest
    for (int digit = kDigits - 1; digit >= 0; --digit, ++pass) {
      const int shift = digit * kDigitBits;
      Hist& h = s_hist[pass & 1];
      slice_histogram(cache, n, 0, prefix, mask, shift, /*with_mass=*/false, h);
      if (tid == 0) {
        s_digit = 0;
        s_above = 0;
      }
      cluster.sync();  // every CTA's histogram of this pass written
      const Digits g = cluster_digits(cluster, h, false);
      unsigned long long total;
      const unsigned long long above0 = block_exclusive_scan(g.c0 + g.c1, total), above1 = above0 + g.c0;
      if (above0 < rank_left && rank_left <= above0 + g.c0) {
        s_digit = g.d0;
        s_above = above0;
      } else if (above1 < rank_left && rank_left <= above1 + g.c1) {
        s_digit = g.d1;
        s_above = above1;
      }
      __syncthreads();
      rank_left -= s_above;
      prefix |= uint32_t(s_digit) << shift;
      mask |= uint32_t(kBins - 1) << shift;
      __syncthreads();  // s_digit, s_above read by all before the next pass writes them
    }
    keep = prefix;
  }
  if (p < 1.0) {  // the smallest kept e whose kept mass strictly above is < p * the kept mass
    uint32_t prefix = 0, mask = 0;
    unsigned long long above = 0;
    double limit = 0;
    for (int digit = kDigits - 1; digit >= 0; --digit, ++pass) {
      const int shift = digit * kDigitBits;
      Hist& h = s_hist[pass & 1];
      slice_histogram(cache, n, keep, prefix, mask, shift, /*with_mass=*/true, h);
      if (tid == 0) s_digit = kBins;  // none
      cluster.sync();  // every CTA's histogram of this pass written
      const Digits g = cluster_digits(cluster, h, true);
      unsigned long long total;
      const unsigned long long m0 = above + block_exclusive_scan(g.m0 + g.m1, total), m1 = m0 + g.m0;
      if (digit == kDigits - 1) limit = p * double(total);  // the first pass sees every kept entry
      // The digits whose mass strictly above is < limit are the top ones: the lowest of them
      // that holds a candidate.
      if (g.c1 > 0 && double(m1) < limit)
        atomicMin(&s_digit, g.d1);
      else if (g.c0 > 0 && double(m0) < limit)
        atomicMin(&s_digit, g.d0);
      __syncthreads();
      const int d = s_digit;
      if (d == g.d0) s_above = m0;
      if (d == g.d1) s_above = m1;
      __syncthreads();
      if (d < kBins) {
        prefix |= uint32_t(d) << shift;
        above = s_above;
      }
      mask |= uint32_t(kBins - 1) << shift;
      __syncthreads();  // s_digit, s_above read by all before the next pass writes them
    }
    keep = keep > prefix ? keep : prefix;
  }

  // 4. Inverse CDF: the slice's kept mass per warp chunk, warp w holding [w Cw, (w+1) Cw).
  const int Cw = ((n + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int wb = warp * Cw < n ? warp * Cw : n, we = wb + Cw < n ? wb + Cw : n;
  const float part = warp_kept_mass(cache, wb, we, keep);
  if (lane == 0) s_warp_mass[warp] = part;
  __syncthreads();
  if (tid == 0) {
    float cta = 0.f;
    for (int w = 0; w < kWarps; ++w) cta += s_warp_mass[w];
    s_cta_mass[rank] = cta;
  }
  cluster.sync();  // every CTA's mass written (each CTA's own s_cta_mass[rank]); histograms read
  if (tid == 0) {  // the CTA holding u * total, the same choice in every CTA
    float mass[kCluster], total = 0.f;
    for (int c = 0; c < kCluster; ++c) {
      mass[c] = cluster.map_shared_rank(s_cta_mass, c)[c];
      total += mass[c];
    }
    const float u = philox_uniform(uint64_t(seed[b]), uint64_t(step[b]));
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
  const int cb = s_warp * Cw < n ? s_warp * Cw : n, ce = cb + Cw < n ? cb + Cw : n;
  const int j = block_find(cache, cb, ce, keep, s_target);
  if (tid == 0) write(j >= 0 ? lo + j : argmax);
}
}  // namespace

void sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                 const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& step, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t B = logits.size(0), V = logits.size(1);
  if (B == 0) return;
  TORCH_CHECK(B <= int64_t(INT32_MAX) / kCluster, "sample_rows: ", B, " rows");
  TORCH_CHECK(V <= kMaxVocab, "sample_rows: the kernel holds up to ", kMaxVocab, " logits a row, got ", V);
  const std::size_t smem = std::size_t(slice_length(V)) * sizeof(float);
  static SmemOptIn opt_in;  // for the largest slice, once per device
  opt_in.raise(sample_kernel, std::size_t(slice_length(kMaxVocab)) * sizeof(float), logits.get_device());
  sample_kernel<<<unsigned(B * kCluster), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      logits.data_ptr<float>(), V, temperature.data_ptr<double>(), top_k.data_ptr<int64_t>(),
      top_p.data_ptr<double>(), seed.data_ptr<int64_t>(), step.data_ptr<int64_t>(), out.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
