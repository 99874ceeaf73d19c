#pragma once
// Host entry point of kernels/router_logits.cu (CUDA builds only); arguments checked by the
// caller (kernels/router_logits.cpp).
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels::cuda {
/// The block shapes (CTA rows x columns, thread rows x columns): 0 = 64 x 64 / 4 x 4 (the
/// trainer's micro-batches), 1 = 32 x 32 / 2 x 2, 2 = 16 x 16 / 1 x 1 (decode steps: more CTAs
/// for few rows). Every shape sums each output over k in the same order: the same bits.
/// router_logits_tile_for picks by M: 0 from kRouterLogitsLargeFrom rows, 1 from
/// kRouterLogitsMediumFrom, else 2. From kiln_bench_router_logits on the H100 at N 64, K 2048
/// (docs/benchmarks.md): tile 2 fastest to M 1024 (33 us to M 256), tile 1 at 4096 (79 us
/// against 86), tile 0 from 4608 (85 us at any M; tile 1 111 us at 4608-6144, 148 at 8192).
constexpr int64_t kRouterLogitsLargeFrom = 4097, kRouterLogitsMediumFrom = 2048;
int router_logits_tile_for(int64_t M, int64_t N);
/// x [M, K] bf16 (unit column stride, 16-byte aligned rows), w [N, K] bf16 contiguous, K % 8 == 0
/// -> y [M, N] fp32 contiguous (every element written), on the current stream; tile -1: by M.
void router_logits(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, int tile = -1);
}  // namespace kiln::kernels::cuda
