// Batched token sampling (kernels/sampling.hpp): one block of 512 threads per row.
//   pass 1: online max / sum of exp / sum of exp * x over x = logits / T, and the arg-max;
//   top-k (if on): radix select of the k-th largest e = exp(x - max), four 8-bit digit passes;
//   top-p (if on): the same descent over digit histograms of kept mass (fixed point, 2^-32 of the
//     largest e, so that sums are exact and the choice deterministic), to the smallest kept e;
//   inverse CDF: kept mass per warp chunk, then one warp scans the chunk holding u * total.
// Every reduction has a fixed order: the same inputs give the same token on every run. The
// passes over a row issue kUnroll loads per thread before taking them in index order.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/philox.hpp"
#include "kernels/sampling_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kUnroll = 8;  // loads in flight per thread in the passes over a row
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
  __device__ float e(int64_t i) const { return e_of(logits[i]); }
  __device__ float e_of(float logit) const {
    const float x = logit / T;
    return x > -INFINITY ? __expf(x - m) : 0.f;
  }
};

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

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* __restrict__ logits, int64_t V,
                                                          const double* __restrict__ temperature,
                                                          const int64_t* __restrict__ top_k,
                                                          const double* __restrict__ top_p,
                                                          const int64_t* __restrict__ seed,
                                                          const int64_t* __restrict__ step, double* __restrict__ out) {
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const double Td = temperature[b];
  const bool greedy = !(Td > 0);
  Row r{logits + b * V, V, greedy ? 1.f : float(Td), 0.f};

  __shared__ Soft s_soft[kWarps];
  __shared__ float s_bv[kWarps], s_chunk[kWarps];
  __shared__ int64_t s_bi[kWarps];
  __shared__ unsigned s_count[256];
  __shared__ unsigned long long s_mass[256], s_total[kWarps];
  __shared__ uint32_t s_prefix;
  __shared__ unsigned long long s_above;
  __shared__ float s_target;
  __shared__ int s_warp;
  __shared__ int64_t s_token;

  // Pass 1: softmax statistics of x = logits / T, and the arg-max of the logits.
  Soft st{-INFINITY, 0.f, 0.f};
  float bv = -INFINITY;
  int64_t bi = INT64_MAX;
  // kUnroll loads in flight per thread, then taken in index order (the order of a plain loop).
  for (int64_t i0 = tid; i0 < V; i0 += int64_t(kUnroll) * kThreads) {
    float l[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = i0 + int64_t(j) * kThreads;
      l[j] = i < V ? r.logits[i] : -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = i0 + int64_t(j) * kThreads;
      if (i >= V) break;
      soft_add(st, l[j] / r.T);
      if (l[j] > bv) {
        bv = l[j];
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
  r.m = st.m;
  const float log_z = st.m + logf(st.s);
  const float entropy = log_z - st.w / st.s;

  int64_t token = bi == INT64_MAX ? 0 : bi;
  if (!greedy) {
    const int64_t k = top_k[b];
    const double p = top_p[b];
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
    float part = 0.f;
    for (int64_t i0 = begin + lane; i0 < end; i0 += 32 * kUnroll) {
      float l[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = i0 + 32 * j;
        l[j] = i < end ? r.logits[i] : -INFINITY;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (i0 + 32 * j >= end) break;
        const float e = r.e_of(l[j]);
        part += e >= keep_e ? e : 0.f;
      }
    }
    part = warp_sum_f(part);
    if (lane == 0) s_chunk[warp] = part;
    __syncthreads();
    if (tid == 0) {
      float total = 0.f;
      for (int w = 0; w < kWarps; ++w) total += s_chunk[w];
      const float u = philox_uniform(uint64_t(seed[b]), uint64_t(step[b]));
      float left = u * (1.f - 1e-6f) * total, before = 0.f;
      int w = 0, last = 0;
      for (; w < kWarps; ++w) {
        if (s_chunk[w] > 0.f) last = w;
        if (before + s_chunk[w] > left) break;
        before += s_chunk[w];
      }
      if (w == kWarps) w = last;  // rounding: the last chunk with mass
      s_warp = w;
      s_target = left - before;
    }
    __syncthreads();
    if (warp == s_warp) {
      const int64_t cb = int64_t(s_warp) * C, ce = cb + C < V ? cb + C : V;
      const float left = s_target;
      float run = 0.f;
      int64_t found = -1, last_kept = -1;
      float l_next = cb + lane < ce ? r.logits[cb + lane] : -INFINITY;  // one window ahead
      for (int64_t base = cb; base < ce && found < 0; base += 32) {
        const int64_t i = base + lane;
        const float l = l_next;
        l_next = i + 32 < ce ? r.logits[i + 32] : -INFINITY;
        float e = i < ce ? r.e_of(l) : 0.f;
        if (e < keep_e) e = 0.f;
        float incl = e;  // inclusive scan over the warp
        for (int o = 1; o < 32; o <<= 1) {
          const float y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, e > 0.f && run + incl > left);
        const unsigned kept = __ballot_sync(0xffffffffu, e > 0.f);
        if (hit) found = base + __ffs(hit) - 1;
        if (kept) last_kept = base + 31 - __clz(kept);
        run += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) s_token = found >= 0 ? found : (last_kept >= 0 ? last_kept : token);
    }
    __syncthreads();
    token = s_token;
  }
  if (tid == 0) {
    out[b * 3 + 0] = double(token);
    out[b * 3 + 1] = double(r.logits[token] / r.T - log_z);
    out[b * 3 + 2] = double(entropy);
  }
}
}  // namespace

void sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                 const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& step, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t B = logits.size(0), V = logits.size(1);
  if (B == 0) return;
  TORCH_CHECK(B <= int64_t(INT32_MAX), "sample_rows: ", B, " rows");
  sample_kernel<<<unsigned(B), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      logits.data_ptr<float>(), V, temperature.data_ptr<double>(), top_k.data_ptr<int64_t>(),
      top_p.data_ptr<double>(), seed.data_ptr<int64_t>(), step.data_ptr<int64_t>(), out.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
