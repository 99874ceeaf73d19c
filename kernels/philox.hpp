#pragma once
// Philox4x32-10, the counter-based generator of Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3" (SC 2011; Random123's philox4x32 with 10 rounds): a pure function of a 64-bit key
// and a 128-bit counter, the same bits on the host and in a CUDA kernel. kiln keys it by a
// request's sampling seed and counts by the token's index in the completion, so that a request's
// draws depend on nothing else (not on its neighbours in a batch, the device or the step order).
#include <cstdint>

#if defined(__CUDACC__)
#define KILN_HOST_DEVICE __host__ __device__
#else
#define KILN_HOST_DEVICE
#endif

namespace kiln::kernels {

struct Philox4x32 {
  uint32_t v[4];
};

/// Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1). Random123's known answers:
/// key 0, counter 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8; key and counter all ffffffff ->
/// 408f276d 41c83b0e a20bc7c6 6d5451fd (tests/kernels/test_sampling.cpp checks both).
KILN_HOST_DEVICE inline Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                                 uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(M0) * c0, p1 = uint64_t(M1) * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0), hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

/// The uniform in [0, 1) (24 bits: a multiple of 2^-24) that a request with sampling seed `seed`
/// draws for the token at index `step` of its completion: the first word of Philox4x32-10 of
/// counter (step, 0) under key seed.
KILN_HOST_DEVICE inline float philox_uniform(uint64_t seed, uint64_t step) {
  const auto r = philox4x32_10(uint32_t(step), uint32_t(step >> 32), 0u, 0u, uint32_t(seed), uint32_t(seed >> 32));
  return float(r.v[0] >> 8) * (1.0f / 16777216.0f);
}

}  // namespace kiln::kernels
