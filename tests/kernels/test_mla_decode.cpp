// Absorbed MLA decode attention over the paged latent cache (kernels/mla_decode.hpp): the
// LibTorch reference (fp32 math) against a per-sequence loop in fp64 on CPU, the errors, and on
// a GPU the CUDA kernel against the reference (fp32 math on the gathered latents) for ragged lengths,
// several batch sizes, both compiled widths, entries past each length poisoned with NaN, and
// under CUDA graph capture.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "kernels/cuda_graph.hpp"
#include "kernels/mla_decode.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {

// A paged cache and page tables for sequences of `lengths` tokens: pages handed out in a
// shuffled order, W = the most pages a sequence needs plus one (the extra entries, past every
// sequence's pages, point at pages of other sequences).
struct Paged {
  torch::Tensor cache, table, lengths;  // [G, Z, C+R], [B, W], [B]
};

Paged make_paged(const std::vector<int64_t>& lengths, int64_t Z, int64_t C, int64_t R, torch::Dtype dtype,
                 torch::Device dev) {
  const int64_t B = int64_t(lengths.size());
  int64_t need = 0, W = 1;
  for (auto L : lengths) {
    need += (L + Z - 1) / Z;
    W = std::max(W, (L + Z - 1) / Z + 1);
  }
  const int64_t G = need + 3;
  auto perm = torch::randperm(G, torch::kInt64);
  auto table = torch::empty({B, W}, torch::kInt64);
  auto pa = perm.accessor<int64_t, 1>();
  auto ta = table.accessor<int64_t, 2>();
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (lengths[std::size_t(b)] + Z - 1) / Z;
    for (int64_t k = 0; k < W; ++k) ta[b][k] = k < used ? pa[next + k] : pa[(next + k * 7) % G];
    next += used;
  }
  Paged p;
  p.cache = torch::randn({G, Z, C + R}, torch::kFloat32).to(dtype).to(dev);
  p.table = table.to(dev);
  p.lengths = torch::tensor(lengths, torch::kInt64).to(dev);
  return p;
}

// The same cache with every entry no sequence may read (past its length) set to NaN.
torch::Tensor poisoned(const Paged& p) {
  const int64_t Z = p.cache.size(1);
  auto table = p.table.cpu(), lengths = p.lengths.cpu();
  auto readable = torch::zeros({p.cache.size(0) * Z}, torch::kBool);
  auto t = table.accessor<int64_t, 2>();
  auto l = lengths.accessor<int64_t, 1>();
  auto r = readable.accessor<bool, 1>();
  for (int64_t b = 0; b < table.size(0); ++b)
    for (int64_t pos = 0; pos < l[b]; ++pos) r[t[b][pos / Z] * Z + pos % Z] = true;
  auto c = p.cache.clone().view({-1, p.cache.size(2)});
  c.index_put_({~readable.to(c.device())}, std::numeric_limits<float>::quiet_NaN());
  return c.view(p.cache.sizes());
}

}  // namespace

TEST_CASE("mla_decode_attention reference equals a per-sequence softmax over the pages (CPU, fp64 inputs)") {
  torch::manual_seed(1);
  const int64_t H = 3, C = 16, R = 8, Z = 4;
  const std::vector<int64_t> lens{1, 4, 5, 13};
  auto p = make_paged(lens, Z, C, R, torch::kFloat64, torch::kCPU);
  const int64_t B = int64_t(lens.size());
  auto ql = torch::randn({B, H, C}, torch::kFloat64), qr = torch::randn({B, H, R}, torch::kFloat64);
  const double scale = 0.3;
  auto got = kernels::mla_decode_attention(ql, qr, p.cache, p.table, p.lengths, scale);  // CPU: the reference
  REQUIRE((got.sizes() == torch::IntArrayRef{B, H, C}));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<torch::Tensor> rows;
    for (int64_t pos = 0; pos < lens[std::size_t(b)]; ++pos)
      rows.push_back(p.cache[p.table[b][pos / Z].item<int64_t>()][pos % Z]);
    auto kv = torch::stack(rows);                                                        // [L, C+R]
    auto s = torch::cat({ql[b], qr[b]}, -1).matmul(kv.t()) * scale;                      // [H, L]
    auto want = torch::softmax(s, -1).matmul(kv.narrow(1, 0, C));                        // [H, C]
    CHECK((got[b] - want).abs().max().item<double>() <= 1e-5);  // the reference computes in fp32
  }
}

TEST_CASE("mla_decode_attention names the shapes and dtypes it refuses") {
  auto ql = torch::randn({2, 3, 16}), qr = torch::randn({2, 3, 8}), cache = torch::randn({4, 4, 24});
  auto table = torch::zeros({2, 2}, torch::kInt64), lengths = torch::ones({2}, torch::kInt64);
  CHECK_THROWS_WITH_AS(kernels::mla_decode_attention(ql, qr, torch::randn({4, 4, 20}), table, lengths, 1.0),
                       doctest::Contains("cache entries of width 20"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_decode_attention(ql, qr, cache, table.to(torch::kInt32), lengths, 1.0),
                       doctest::Contains("must be int64"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_decode_attention(ql, qr, cache, torch::zeros({3, 2}, torch::kInt64), lengths, 1.0),
                       doctest::Contains("must have B = 2 rows"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::mla_decode_attention(ql.to(torch::kFloat64), qr, cache, table, lengths, 1.0),
                       doctest::Contains("must have the cache's dtype"), c10::Error);
  CHECK_FALSE(kernels::mla_decode_kernel_supports(ql, qr, cache));  // CPU tensors
}

// Tolerance: the kernel's scores are fp32 sums of exact bf16 products (as the reference's, in
// another order: ~1e-6 relative); the probabilities are rounded to bf16 before the value
// product (relative error <= 2^-9 each, so the output moves by at most 2^-9 of the largest
// latent magnitude, ~4.5 here, and far less on average) and the output is rounded to bf16
// (2^-9 relative). 2e-2 absolute is ~2x that worst case; a wrong key, page, mask or softmax
// moves outputs by O(0.1-1).
TEST_CASE("CUDA: MLA decode kernel equals the reference on ragged lengths, batch sizes and both widths") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(2);
  const torch::Device dev(torch::kCUDA);
  struct Case {
    int64_t H, C, R, Z;
    std::vector<int64_t> lens;
  };
  const std::vector<Case> cases{
      {20, 512, 64, 16, {1}},                                  // one key
      {20, 512, 64, 16, {16, 17, 1, 64, 65}},                  // page and tile boundaries
      {20, 512, 64, 16, {3000}},                               // long, one sequence (many chunks)
      {20, 512, 64, 16, {8200, 1, 777, 4096, 130, 5000, 63, 2049}},
      {20, 512, 64, 64, std::vector<int64_t>(96, 0)},          // batch 96, lengths filled below
      {16, 512, 64, 16, {300, 1, 1025}},                       // H < 20 (two n-tiles of heads)
      {32, 512, 64, 16, {100, 1, 2000}},                       // H = 32 (four n-tiles of heads)
      {4, 32, 8, 4, {1, 4, 5, 40, 3, 129}},                    // the debug flavor's widths
  };
  for (auto c : cases) {
    if (c.lens[0] == 0)
      for (std::size_t i = 0; i < c.lens.size(); ++i) c.lens[i] = 1 + int64_t((i * 2654435761u) % 1500);
    CAPTURE(c.H);
    CAPTURE(c.C);
    CAPTURE(c.lens.size());
    auto p = make_paged(c.lens, c.Z, c.C, c.R, torch::kBFloat16, dev);
    const int64_t B = int64_t(c.lens.size());
    // Queries of norm ~ sqrt(C+R) * 1.5: scores of spread ~1.5 after the scale (a peaked softmax).
    auto ql = (1.5 * torch::randn({B, c.H, c.C}, dev)).to(torch::kBFloat16);
    auto qr = (1.5 * torch::randn({B, c.H, c.R}, dev)).to(torch::kBFloat16);
    const double scale = 1.0 / std::sqrt(double(c.C + c.R));
    REQUIRE(kernels::mla_decode_kernel_supports(ql, qr, p.cache));
    auto want = kernels::mla_decode_attention_ref(ql, qr, p.cache, p.table, p.lengths, scale).to(torch::kFloat32);
    auto got = kernels::mla_decode_attention(ql, qr, poisoned(p), p.table, p.lengths, scale);
    REQUIRE((got.sizes() == want.sizes()));
    CHECK((got.scalar_type() == torch::kBFloat16));
    CHECK_FALSE(got.isnan().any().item<bool>());
    const double err = (got.to(torch::kFloat32) - want).abs().max().item<double>();
    MESSAGE("kernel vs reference |diff| max " << err << " (output |max| " << want.abs().max().item<double>() << ")");
    CHECK(err <= 2e-2);
  }
}

TEST_CASE("CUDA: MLA decode kernel captured in a CUDA graph follows new lengths, pages and queries on replay") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(3);
  const torch::Device dev(torch::kCUDA);
  const int64_t H = 20, C = 512, R = 64, Z = 16;
  auto p = make_paged({40, 700, 1, 2000}, Z, C, R, torch::kBFloat16, dev);
  auto ql = torch::randn({4, H, C}, dev).to(torch::kBFloat16), qr = torch::randn({4, H, R}, dev).to(torch::kBFloat16);
  const double scale = 1.0 / std::sqrt(double(C + R));
  auto table = p.table.clone(), lengths = p.lengths.clone();
  torch::Tensor out;
  kernels::CapturedGraph graph(dev, kernels::GraphPool::make(),
                               [&] { out = kernels::mla_decode_attention(ql, qr, p.cache, table, lengths, scale); });
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {  // new inputs written in place: other lengths (within the same pages), other queries
      // rows 1 and 2 swap pages: 1 token of the 700-token sequence's, 1 of the 1-token one's
      table.copy_(table.index_select(0, torch::tensor(std::vector<int64_t>{0, 2, 1, 3}, torch::kInt64).to(dev)));
      lengths.copy_(torch::tensor(std::vector<int64_t>{17, 1, 1, 1999}, torch::kInt64).to(dev));
      ql.copy_(torch::randn({4, H, C}, dev).to(torch::kBFloat16));
    }
    graph.replay();
    auto want = kernels::mla_decode_attention_ref(ql, qr, p.cache, table, lengths, scale).to(torch::kFloat32);
    const double err = (out.to(torch::kFloat32) - want).abs().max().item<double>();
    CAPTURE(round);
    CHECK(err <= 2e-2);
  }
}
