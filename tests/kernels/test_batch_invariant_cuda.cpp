// The batch-invariant ops on CUDA (kernels/batch_invariant.cu): each close to the ordinary op
// it replaces, and invariant bit for bit: a row's output computed alone, at another position,
// or among batches of other sizes (M = 1, 7, 32, 1000, 8192) is the same; a decode query over
// L keys equals the same token as the last query of a training pack (other documents around
// it). Skipped without a GPU.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/batch_invariant.hpp"
#include "kernels/rms_norm.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_error;

namespace {

const std::vector<int64_t> kBatchSizes = {1, 7, 32, 1000, 8192};

torch::TensorOptions cuda(torch::ScalarType t) { return torch::TensorOptions().dtype(t).device(torch::kCUDA); }

// Runs op on random subsets (random order) of rows of x_full, one per batch size, and checks
// each result row equals the same row of op(x_full), bit for bit.
template <class Op>
void check_rows_invariant(const torch::Tensor& x_full, Op op) {
  const auto y_full = op(x_full);
  for (int64_t M : kBatchSizes) {
    if (M > x_full.size(0)) continue;
    CAPTURE(M);
    auto idx = torch::randperm(x_full.size(0), torch::TensorOptions().dtype(torch::kLong).device(x_full.device()))
                   .slice(0, 0, M);
    auto y = op(x_full.index_select(0, idx));
    CHECK(torch::equal(y, y_full.index_select(0, idx)));
  }
}

// cu [B+1] int64 from lengths.
torch::Tensor offsets(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (auto n : lengths) cu.push_back(cu.back() + n);
  return torch::tensor(cu, torch::kLong);
}

}  // namespace

TEST_CASE("Batch-invariant CUDA ops match the ordinary ops (bf16 and fp32)") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(0);
  for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    CAPTURE(dtype);
    const bool bf16 = dtype == torch::kBFloat16;
    // linear: mma path (K % 8 == 0), CUDA-core path (K % 8 != 0), small and large M, fp32 out.
    for (const auto& mnk : std::vector<std::array<int64_t, 3>>{{300, 1536, 2048}, {7, 1000, 100}, {2000, 257, 512}}) {
      const int64_t M = mnk[0], N = mnk[1], K = mnk[2];
      CAPTURE(M);
      CAPTURE(K);
      auto x = torch::randn({M, K}, cuda(dtype)), w = torch::randn({N, K}, cuda(dtype)) / std::sqrt(double(K));
      auto ref = torch::matmul(x.to(torch::kFloat64), w.to(torch::kFloat64).t());  // exact products of the inputs
      CHECK(rel_error(kernels::bi_linear(x, w, torch::kFloat32).to(torch::kFloat64), ref) <= 1e-5);
      CHECK(rel_error(kernels::bi_linear(x, w).to(torch::kFloat64), ref) <= (bf16 ? 8e-3 : 1e-5));
      CHECK((kernels::bi_linear(x, w).scalar_type() == dtype));
    }
    // grouped linear: 8 groups, one of them empty, counts on the GPU and on the CPU.
    {
      const int64_t E = 8, N = 384, K = 256;
      std::vector<int64_t> counts_v = {5, 0, 300, 17, 1, 64, 129, 2};
      int64_t M = 0;
      for (auto c : counts_v) M += c;
      auto counts = torch::tensor(counts_v, torch::kLong);
      auto x = torch::randn({M, K}, cuda(dtype)), w = torch::randn({E, N, K}, cuda(dtype)) / 16.0;
      std::vector<torch::Tensor> parts;
      int64_t r = 0;
      for (int64_t e = 0; e < E; ++e) {
        parts.push_back(torch::matmul(x.slice(0, r, r + counts_v[e]).to(torch::kFloat64), w[e].to(torch::kFloat64).t()));
        r += counts_v[e];
      }
      auto ref = torch::cat(parts);
      auto y_gpu_counts = kernels::bi_grouped_linear(x, counts.to(torch::kCUDA), w);
      CHECK(rel_error(y_gpu_counts.to(torch::kFloat64), ref) <= (bf16 ? 8e-3 : 1e-5));
      CHECK(torch::equal(y_gpu_counts, kernels::bi_grouped_linear(x, counts, w)));
      CHECK_THROWS_AS(kernels::bi_grouped_linear(x, counts + 1, w), c10::Error);  // CPU counts are checked
    }
    // attention: training packs, decode, chunked prefill; GLM-4.7-Flash's head widths (bf16:
    // tensor cores), and unequal widths (CUDA cores).
    for (auto [Dqk, Dv] : std::vector<std::pair<int64_t, int64_t>>{{256, 256}, {192, 128}}) {
      const int64_t H = 4;
      const double scale = 1.0 / 16.0;
      std::vector<int64_t> k_len = {1, 70, 300, 129}, q_len_train = k_len, q_len_mixed = {1, 5, 1, 64};
      for (const auto* q_len : {&q_len_train, &q_len_mixed}) {
        auto cu_k = offsets(k_len), cu_q = offsets(*q_len);
        const int64_t Tq = cu_q[-1].item<int64_t>(), Tk = cu_k[-1].item<int64_t>();
        auto q = torch::randn({Tq, H, Dqk}, cuda(dtype)), k = torch::randn({Tk, H, Dqk}, cuda(dtype)),
             v = torch::randn({Tk, H, Dv}, cuda(dtype));
        auto ref = kernels::varlen_attention_cached_ref(q.to(torch::kFloat32), k.to(torch::kFloat32),
                                                        v.to(torch::kFloat32), cu_q, cu_k, scale);
        auto out = kernels::bi_attention(q, k, v, cu_q.to(torch::kCUDA), cu_k.to(torch::kCUDA), scale);
        CHECK((out.scalar_type() == dtype));
        CHECK(rel_error(out.to(torch::kFloat32), ref) <= (bf16 ? 1e-2 : 1e-5));  // bf16: P rounded, as FlashAttention
        CHECK(torch::equal(out, kernels::bi_attention(q, k, v, cu_q, cu_k, scale)));  // offsets on the CPU
      }
    }
    // RMSNorm: the same formula as the fused kernel's reference.
    {
      auto x = torch::randn({333, 2048}, cuda(dtype)), w = (1 + 0.3 * torch::randn({2048}, cuda(dtype)));
      auto ref = std::get<0>(kernels::rms_norm_forward_ref(x, w, 1e-5));
      CHECK(rel_error(kernels::bi_rms_norm(x, w, 1e-5).to(torch::kFloat32), ref.to(torch::kFloat32)) <=
            (bf16 ? 1e-2 : 1e-6));
    }
    // logsumexp over a vocabulary-sized row, an odd width, and a row of -inf.
    for (int64_t N : {151552, 1001}) {
      auto x = 4 * torch::randn({65, N}, cuda(dtype));
      x[3] = -std::numeric_limits<float>::infinity();
      auto lse = kernels::bi_logsumexp(x);
      auto ref = torch::logsumexp(x.to(torch::kFloat64), 1);
      CHECK((lse.scalar_type() == torch::kFloat32));
      CHECK(std::isinf(lse[3].item<float>()));
      CHECK(rel_error(lse.index({torch::indexing::Slice(4)}).to(torch::kFloat64),
                      ref.index({torch::indexing::Slice(4)})) <= 1e-6);
    }
  }
}

TEST_CASE("Batch-invariant CUDA linear and grouped linear: a row's bits do not depend on the batch") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(1);
  for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    CAPTURE(dtype);
    // GLM-4.7-Flash's q_a projection widths, and the lm_head form (fp32 logits, a vocabulary slice).
    auto x = torch::randn({8192, 2048}, cuda(dtype));
    auto w = torch::randn({768, 2048}, cuda(dtype)) / 45.0;
    check_rows_invariant(x, [&](const torch::Tensor& xs) { return kernels::bi_linear(xs, w); });
    auto head = torch::randn({4099, 2048}, cuda(dtype)) / 45.0;
    check_rows_invariant(x, [&](const torch::Tensor& xs) { return kernels::bi_linear(xs, head, torch::kFloat32); });
    // K % 8 != 0: the CUDA-core path.
    auto x_odd = torch::randn({8192, 100}, cuda(dtype)), w_odd = torch::randn({96, 100}, cuda(dtype));
    check_rows_invariant(x_odd, [&](const torch::Tensor& xs) { return kernels::bi_linear(xs, w_odd); });

    // Grouped: rows of each subset regrouped (sorted by expert), counts recomputed.
    const int64_t E = 64, N = 1536, K = 2048;
    auto xg = torch::randn({8192, K}, cuda(dtype));
    auto wg = torch::randn({E, N, K}, cuda(dtype)) / 45.0;
    auto expert = torch::randint(0, E, {8192}, cuda(torch::kLong));
    auto grouped = [&](const torch::Tensor& idx) {
      auto order = std::get<1>(torch::sort(expert.index_select(0, idx), /*stable=*/true, 0, false));
      auto rows = idx.index_select(0, order);
      auto counts = torch::bincount(expert.index_select(0, rows), {}, E);
      auto y = kernels::bi_grouped_linear(xg.index_select(0, rows), counts, wg);
      return torch::empty_like(y).index_copy_(0, order, y);  // back to idx's order
    };
    auto all = torch::arange(8192, cuda(torch::kLong));
    auto y_full = grouped(all);
    for (int64_t M : kBatchSizes) {
      CAPTURE(M);
      auto idx = torch::randperm(8192, cuda(torch::kLong)).slice(0, 0, M);
      CHECK(torch::equal(grouped(idx), y_full.index_select(0, idx)));
    }
    // The grouped rows equal the plain linear of their expert's weights, bitwise (same chain).
    for (int64_t i = 0; i < 5; ++i) {
      const int64_t e = expert[i].item<int64_t>();
      CHECK(torch::equal(kernels::bi_linear(xg.slice(0, i, i + 1), wg[e]), y_full.slice(0, i, i + 1)));
    }
  }
}

TEST_CASE("Batch-invariant CUDA attention: a decode query equals the same token in a training pack, bitwise") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(2);
  for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    CAPTURE(dtype);
    for (int64_t D : {256, 128}) {  // bf16: the tensor-core kernel's two widths
      CAPTURE(D);
      const int64_t H = 4, Dqk = D, Dv = D;
      const double scale = 1.0 / 16.0;
      // A training pack of documents of different lengths (several 64-key blocks, partial ones).
      const std::vector<int64_t> lengths = {700, 1, 64, 65, 1500, 333, 128, 17};
      auto cu = offsets(lengths);
      const int64_t T = cu[-1].item<int64_t>(), B = int64_t(lengths.size());
      auto q = torch::randn({T, H, Dqk}, cuda(dtype)), k = torch::randn({T, H, Dqk}, cuda(dtype)),
           v = torch::randn({T, H, Dv}, cuda(dtype));
      auto cu_d = cu.to(torch::kCUDA);
      auto train = kernels::bi_attention(q, k, v, cu_d, cu_d, scale);
      auto last = (cu.slice(0, 1) - 1).to(torch::kCUDA);  // each document's last token
      // Decode: every document's last token as the one query over its L keys, all in one batch.
      auto dec = kernels::bi_attention(q.index_select(0, last), k, v, torch::arange(B + 1, cuda(torch::kLong)), cu_d,
                                       scale);
      CHECK(torch::equal(dec, train.index_select(0, last)));
      // Decode of one sequence alone, and chunked prefill (the last 40 positions as queries).
      for (int64_t b : {0, 4, 5}) {
        CAPTURE(b);
        const int64_t s = cu[b].item<int64_t>(), L = lengths[size_t(b)];
        auto kb = k.slice(0, s, s + L), vb = v.slice(0, s, s + L);
        auto cu_k = torch::tensor({int64_t(0), L}, torch::kLong);
        auto one = kernels::bi_attention(q.slice(0, s + L - 1, s + L), kb, vb,
                                         torch::tensor({int64_t(0), int64_t(1)}, torch::kLong), cu_k, scale);
        CHECK(torch::equal(one, train.slice(0, s + L - 1, s + L)));
        const int64_t n = std::min<int64_t>(40, L);
        auto chunk = kernels::bi_attention(q.slice(0, s + L - n, s + L), kb, vb, torch::tensor({int64_t(0), n}, torch::kLong),
                                           cu_k, scale);
        CHECK(torch::equal(chunk, train.slice(0, s + L - n, s + L)));
      }
      // The same documents packed in another order (other positions, other neighbours).
      const std::vector<int64_t> perm = {5, 2, 7, 0, 6, 1, 4, 3};
      std::vector<torch::Tensor> idx_parts;
      std::vector<int64_t> len2;
      for (auto b : perm) {
        idx_parts.push_back(torch::arange(cu[b].item<int64_t>(), cu[b + 1].item<int64_t>(), torch::kLong));
        len2.push_back(lengths[size_t(b)]);
      }
      auto idx = torch::cat(idx_parts).to(torch::kCUDA);
      auto cu2 = offsets(len2).to(torch::kCUDA);
      auto train2 = kernels::bi_attention(q.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx), cu2,
                                          cu2, scale);
      CHECK(torch::equal(train2, train.index_select(0, idx)));
    }
  }
}

TEST_CASE("Batch-invariant CUDA RMSNorm and logsumexp: a row's bits do not depend on the batch") {
  if (test::skip_without_cuda_kernels()) return;
  torch::manual_seed(3);
  for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    CAPTURE(dtype);
    auto x = torch::randn({8192, 2048}, cuda(dtype)), w = 1 + 0.3 * torch::randn({2048}, cuda(dtype));
    check_rows_invariant(x, [&](const torch::Tensor& xs) { return kernels::bi_rms_norm(xs, w, 1e-5); });
    auto logits = 3 * torch::randn({8192, 4099}, cuda(dtype));
    check_rows_invariant(logits, [&](const torch::Tensor& xs) { return kernels::bi_logsumexp(xs); });
  }
}
