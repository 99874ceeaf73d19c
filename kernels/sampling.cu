// Batched token sampling (kernels/sampling.hpp). Every row runs on a cluster of kCluster CTAs of
// 512 threads (Hopper thread-block clusters; the CTAs exchange their shares through distributed
// shared memory), each CTA one contiguous slice of the vocabulary, which it reads from global
// memory once and keeps in shared memory for the rest of the row:
// 1. pass 1 (global -> shared): the slice's max logit and its arg-max; the cluster's merged in
//    rank order by every CTA, so that m = max(logits) / T is known to all (division rounds
//    monotonically: it is the max of x = logits / T);
// 2. pass 2 (shared): e = exp(x - m) in place, and per warp chunk sum e and sum e * x; the
//    cluster's sums in rank order give log Z and the entropy; greedy rows end here;
// 3. rows with top-k or top-p: the threshold on e found by a radix select over e's bits (three
//    10-bit digits; e in [0, 1] has < 2^30 bit patterns, ordered as the values): each pass, every
//    CTA's histogram of its candidates (counts, and for top-p fixed-point masses, 2^-32 of the
//    largest e, so that sums are exact integers and the choice does not depend on the order of
//    the shared-memory atomics), the cluster's histograms summed per digit by every CTA, the
//    digit chosen from the suffix sums by the whole CTA. Top-k: the k-th largest e. Top-p (after
//    top-k): the smallest kept e whose kept mass strictly above is < p * the kept mass, its
//    passes skipping the entries that a bound from the kept total and count puts out of the
//    nucleus for sure;
// 4. inverse CDF over the kept entries in vocabulary order: the slice's kept mass per warp chunk
//    (pass 2's sums when nothing is filtered), the CTA holding u * total found in rank order, its
//    chunk, and the entry inside it (block_find).
// Every floating-point reduction has a fixed order and the integer ones are exact: the same
// inputs give the same token on every run. Shared memory per CTA: the slice (kernels/
// sampling_cuda.hpp's kMaxVocab bounds it) and two histograms (double-buffered, so that one
// cluster barrier per pass separates a pass's reads of the other CTAs' histograms from their
// reuse). Indices inside a row are 32-bit (V <= kMaxVocab).
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

// Entries per CTA: the row split in kCluster slices, each a multiple of 4 entries (whole 16-byte
// groups, so that every slice of an aligned row starts aligned).
constexpr int64_t slice_length(int64_t V) { return ((V + kCluster - 1) / kCluster + 3) / 4 * 4; }
static_assert(slice_length(kMaxVocab) * 4 + 2 * kBins * 12 + 4096 <= 227 * 1024, "shared memory of kMaxVocab");

// The larger (value, index); equal values: the lower index.
__device__ inline void argmax_merge(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

__device__ inline float warp_sum_f(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// floor(e * 2^32) for e in [0, 1], from e's bits (exact, as the fp64 product truncated, without
// the fp64 conversions): the 24-bit significand shifted by the exponent. Past 1 (NaN from a
// +inf logit): 2^32.
__device__ inline unsigned long long fixed_mass(float e) {
  const uint32_t bits = __float_as_uint(e);
  const int E = int(bits >> 23);  // the biased exponent (e >= 0: no sign bit)
  if (E == 0) return 0;           // zero or subnormal: below 2^-126
  if (E > 127) return 1ull << 32;
  const unsigned long long sig = (bits & 0x7fffffu) | 0x800000u;
  const int shift = E - 118;  // e = sig 2^(E - 150), so e 2^32 = sig 2^(E - 118)
  return shift >= 0 ? sig << shift : shift > -24 ? sig >> -shift : 0ull;
}

// Entries i..i+3 of the row (-inf past hi): one 16-byte load when `vec` (the row's start
// 16-byte aligned and i a multiple of 4) and the group is whole, else element by element.
__device__ inline float4 load4(const float* __restrict__ row, int i, int hi, bool vec) {
  if (vec && i + 4 <= hi) return *reinterpret_cast<const float4*>(row + i);
  return make_float4(i < hi ? row[i] : -INFINITY, i + 1 < hi ? row[i + 1] : -INFINITY,
                     i + 2 < hi ? row[i + 2] : -INFINITY, i + 3 < hi ? row[i + 3] : -INFINITY);
}
__device__ inline float at4(const float4& v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

struct Best {  // the largest logit and its row index (INT_MAX: none)
  float v;
  int i;
};
struct Sums {  // sum e and sum e * x
  float s, w;
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

// Pass 1 over the slice's n entries (row_lo: the row from the slice's start): copies them to
// `cache` (whole groups of 4, -inf past n) and finds the largest logit and its index (lo + j; the
// lowest of equal ones), each thread's entries in index order, then the warp's tree, then the
// warps in order. The result in every thread of the CTA.
__device__ Best load_slice(const float* __restrict__ row_lo, int lo, int n, bool vec, float* __restrict__ cache) {
  __shared__ Best s_part[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float bv = -INFINITY;
  int bi = INT_MAX;
  // Thread tid takes the groups of 4 entries at 4 (tid + k kThreads), kGroups of them in flight.
  for (int j0 = 4 * tid; j0 < n; j0 += 4 * kGroups * kThreads) {
    float4 v[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) v[g] = load4(row_lo, j0 + 4 * g * kThreads, n, vec);
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int j = j0 + 4 * g * kThreads;
      if (j >= n) break;
      *reinterpret_cast<float4*>(cache + j) = v[g];
#pragma unroll
      for (int q = 0; q < 4; ++q)  // -inf past n: never larger
        if (at4(v[g], q) > bv) {
          bv = at4(v[g], q);
          bi = lo + j + q;
        }
    }
  }
  for (int o = 16; o > 0; o >>= 1) argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  if (lane == 0) s_part[warp] = Best{bv, bi};
  __syncthreads();
  Best out = s_part[0];
  for (int w = 1; w < kWarps; ++w) argmax_merge(out.v, out.i, s_part[w].v, s_part[w].i);
  return out;
}

// Pass 2 over the warp's chunk [begin, end) of the slice in shared memory (begin a multiple of 4;
// -inf past the slice): e = exp(x - m), x = logits / T (UnitT: T = 1, no division), written in
// place when `store`; sum e and sum e * x in index order per lane, then the warp's tree. The
// result in every lane.
template <bool UnitT>
__device__ Sums warp_exp_sums(float* __restrict__ cache, int begin, int end, float T, float m, bool store) {
  const int lane = threadIdx.x & 31;
  float s = 0.f, w = 0.f;
  for (int j0 = begin + 4 * lane; j0 < end; j0 += 4 * 32) {
    float4 v = *reinterpret_cast<const float4*>(cache + j0);
    float e[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float x = UnitT ? at4(v, q) : at4(v, q) / T;
      const bool finite_x = x > -INFINITY;  // -inf (masked, padding) or NaN: no mass
      e[q] = finite_x ? __expf(x - m) : 0.f;
      s += e[q];
      w += finite_x ? e[q] * x : 0.f;
    }
    if (store) *reinterpret_cast<float4*>(cache + j0) = make_float4(e[0], e[1], e[2], e[3]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    w += __shfl_xor_sync(0xffffffffu, w, o);
  }
  return Sums{s, w};
}

// The CTA's histogram of digit (key >> shift) & (kBins - 1) over the slice's n entries e (in
// shared memory) with key >= floor and (key & mask) == prefix, key = e's bits; with `with_mass`
// their masses, and only entries of fixed-point mass >= min_mass. The integer atomics make the
// result independent of their order.
__device__ void slice_histogram(const float* __restrict__ e, int n, uint32_t floor, uint32_t prefix, uint32_t mask,
                                int shift, bool with_mass, unsigned long long min_mass, Hist& h) {
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
      const unsigned long long f = with_mass ? fixed_mass(v) : 0ull;
      if (with_mass && f < min_mass) continue;
      atomicAdd(&h.count[d], 1u);
      if (with_mass) add_mass(h, d, f);
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
#pragma unroll
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
  __shared__ Best s_best;
  __shared__ Sums s_sums, s_warp_sums[kWarps];
  __shared__ Hist s_hist[2];
  __shared__ float s_warp_mass[kWarps], s_cta_mass[kCluster];
  __shared__ float s_target, s_log_z, s_entropy;
  __shared__ int s_chosen, s_warp, s_digit, s_argmax;
  __shared__ unsigned long long s_above, s_kept[2];

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t b = blockIdx.x / kCluster;
  const double Td = temperature[b];
  const bool greedy = !(Td > 0);
  const float T = greedy ? 1.f : float(Td);
  const float* row = logits + b * V;
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  const int L = int(slice_length(V));
  const int lo = rank * L < int(V) ? rank * L : int(V), n = (lo + L < int(V) ? lo + L : int(V)) - lo;
  const int64_t k = top_k[b];
  const double p = top_p[b];
  const bool filtered = !greedy && ((k > 0 && k < V) || p < 1.0);

  // 1. The largest logit, merged in rank order by every CTA: the same in all of them.
  const Best mine = load_slice(row + lo, lo, n, vec, cache);
  if (tid == 0) s_best = mine;
  cluster.sync();  // every CTA's best written
  if (tid == 0) {
    Best all = *cluster.map_shared_rank(&s_best, 0);
    for (int c = 1; c < kCluster; ++c) {
      const Best o = *cluster.map_shared_rank(&s_best, c);
      argmax_merge(all.v, all.i, o.v, o.i);
    }
    s_argmax = all.i == INT_MAX ? 0 : all.i;
    s_target = all.v > -INFINITY ? all.v / T : -INFINITY;  // m
  }
  __syncthreads();
  const float m = s_target;
  const int argmax = s_argmax;

  // 2. e and the sums, warp w holding [w Cw, (w+1) Cw) of the slice.
  const int Cw = ((n + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int wb = warp * Cw < n ? warp * Cw : n, we = wb + Cw < n ? wb + Cw : n;
  const Sums ws = T == 1.f ? warp_exp_sums<true>(cache, wb, we, T, m, !greedy)
                           : warp_exp_sums<false>(cache, wb, we, T, m, !greedy);
  if (lane == 0) {
    s_warp_sums[warp] = ws;
    s_warp_mass[warp] = ws.s;  // the kept mass when nothing is filtered
  }
  __syncthreads();
  if (tid == 0) {
    Sums cta{0.f, 0.f};
    for (int w = 0; w < kWarps; ++w) {
      cta.s += s_warp_sums[w].s;
      cta.w += s_warp_sums[w].w;
    }
    s_sums = cta;
  }
  cluster.sync();  // every CTA's sums written
  if (tid == 0) {
    Sums all{0.f, 0.f};
    float mass[kCluster];
    for (int c = 0; c < kCluster; ++c) {
      const Sums o = *cluster.map_shared_rank(&s_sums, c);
      mass[c] = o.s;
      all.s += o.s;
      all.w += o.w;
    }
    s_log_z = m + logf(all.s);
    s_entropy = s_log_z - all.w / all.s;
    if (!greedy && !filtered) {  // the CTA holding u * total, the same choice in every CTA
      const float u = philox_uniform(uint64_t(seed[b]), uint64_t(step[b]));
      float rest;
      s_chosen = pick_chunk(mass, kCluster, u * (1.f - 1e-6f) * all.s, rest);
      s_target = rest;
    }
  }
  __syncthreads();
  const float log_z = s_log_z, entropy = s_entropy;
  auto write = [&](int64_t token) {
    out[b * 3 + 0] = double(token);
    out[b * 3 + 1] = double(row[token] / T - log_z);
    out[b * 3 + 2] = double(entropy);
  };
  if (greedy) {
    cluster.sync();  // no CTA leaves while another reads its shares
    if (rank == 0 && tid == 0) write(argmax);
    return;
  }

  // 3. The threshold: kept entries are those whose e has bits >= keep.
  uint32_t keep = 0;
  int pass = 0;  // histogram passes so far (the buffer alternates)
  if (k > 0 && k < V) {  // the k-th largest e, digit by digit from the top
    uint32_t prefix = 0, mask = 0;
    unsigned long long rank_left = (unsigned long long)k;  // of the candidates, the rank_left-th largest
    for (int digit = kDigits - 1; digit >= 0; --digit, ++pass) {
      const int shift = digit * kDigitBits;
      Hist& h = s_hist[pass & 1];
      slice_histogram(cache, n, 0, prefix, mask, shift, /*with_mass=*/false, 0, h);
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
    // The kept mass F and count N of the cluster (exact integers). An entry of mass f has at
    // least F - N f strictly above it (the others are at most f each): when that is >= the limit
    // it is out of the nucleus for sure, and so is every smaller one. The passes skip them, which
    // changes no mass above the nucleus' edge, so not the edge (a flat row skips most entries, a
    // peaked one its whole tail).
    unsigned long long f_sum = 0, count = 0;
    for (int j = tid; j < n; j += kThreads) {
      const float v = cache[j];
      if (__float_as_uint(v) >= keep) {
        f_sum += fixed_mass(v);
        ++count;
      }
    }
    unsigned long long cta_f, cta_n;
    block_exclusive_scan(f_sum, cta_f);
    block_exclusive_scan(count, cta_n);
    if (tid == 0) {
      s_kept[0] = cta_f;
      s_kept[1] = cta_n;
    }
    cluster.sync();  // every CTA's kept mass and count written
    unsigned long long F = 0, N = 0;
#pragma unroll
    for (int c = 0; c < kCluster; ++c) {
      const unsigned long long* o = cluster.map_shared_rank(s_kept, c);
      F += o[0];
      N += o[1];
    }
    const double limit = p * double(F);  // F < 2^53: exact in fp64
    const double q = N > 0 ? (double(F) - limit) / double(N) : 0.0;
    const unsigned long long min_mass = q > 1.0 ? (unsigned long long)(q * (1.0 - 1e-9)) : 0ull;  // below q
    uint32_t prefix = 0, mask = 0;
    unsigned long long above = 0;
    for (int digit = kDigits - 1; digit >= 0; --digit, ++pass) {
      const int shift = digit * kDigitBits;
      Hist& h = s_hist[pass & 1];
      slice_histogram(cache, n, keep, prefix, mask, shift, /*with_mass=*/true, min_mass, h);
      if (tid == 0) s_digit = kBins;  // none
      cluster.sync();  // every CTA's histogram of this pass written
      const Digits g = cluster_digits(cluster, h, true);
      unsigned long long total;
      const unsigned long long m0 = above + block_exclusive_scan(g.m0 + g.m1, total), m1 = m0 + g.m0;
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

  // 4. Inverse CDF. Filtered rows: the slice's kept mass per warp chunk, then the CTA holding
  // u * total, the same choice in every CTA (plain rows chose it from pass 2's sums).
  if (filtered) {
    const float part = warp_kept_mass(cache, wb, we, keep);
    if (lane == 0) s_warp_mass[warp] = part;
    __syncthreads();
    if (tid == 0) {
      float cta = 0.f;
      for (int w = 0; w < kWarps; ++w) cta += s_warp_mass[w];
      s_cta_mass[rank] = cta;
    }
    cluster.sync();  // every CTA's mass written (each CTA's own s_cta_mass[rank]); histograms read
    if (tid == 0) {
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
  }
  cluster.sync();  // no CTA leaves while another reads its shares
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
