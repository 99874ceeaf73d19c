// The weight-sync checksum and copy-with-checksum kernels (kernels/checksum.hpp): the documented
// formula on CPU, and the CUDA kernels against the reference, aligned or not.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/checksum.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_error;
using kiln::test::skip_without_cuda_kernels;

TEST_CASE("checksum: the documented formula, position sensitive, copy computes the source's (CPU)") {
  auto t = torch::tensor({1, 2}, torch::kInt32);
  // m_0 = 2654435761, m_1 = (2 * 2654435761 mod 2^32) | 1 = 1013904227; 2 * m_1 < 2^32
  CHECK(kernels::checksum(t).item<int64_t>() == 2654435761LL + 2 * 1013904227LL);
  CHECK(kernels::checksum(torch::tensor({2, 1}, torch::kInt32)).item<int64_t>() !=
        kernels::checksum(t).item<int64_t>());
  // Half words: int16 {1, 2, 3} reads as words 0x00020001 and 0x00000003 (zero padded).
  const uint64_t w0 = 0x00020001ull * 2654435761ull % (1ull << 32), w1 = 3ull * 1013904227ull % (1ull << 32);
  CHECK(uint64_t(kernels::checksum(torch::tensor({1, 2, 3}, torch::kInt16)).item<int64_t>()) == w0 + w1);
  auto src = torch::randn({33}, torch::kBFloat16), dst = torch::zeros_like(src);
  auto c = kernels::copy_with_checksum(dst, src);
  CHECK(torch::equal(dst, src));
  CHECK(c.item<int64_t>() == kernels::checksum_ref(src).item<int64_t>());
  CHECK_THROWS_WITH(kernels::checksum(torch::zeros({3}, torch::kUInt8)), doctest::Contains("even byte count"));
}

TEST_CASE("CUDA: checksum and copy kernels equal the reference, aligned or not") {
  if (skip_without_cuda_kernels()) return;
  auto base = torch::randn({(1 << 22) + 13}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
  for (int64_t off : {0, 1, 8}) {  // 16-byte aligned, and not
    CAPTURE(off);
    auto src = base.narrow(0, off, base.size(0) - off - 3);
    auto want = kernels::checksum_ref(src.contiguous()).item<int64_t>();
    CHECK(kernels::checksum(src).item<int64_t>() == want);
    auto dst = torch::zeros_like(src);
    CHECK(kernels::copy_with_checksum(dst, src).item<int64_t>() == want);
    CHECK(torch::equal(dst, src));
  }
  auto f = torch::randn({1001}, torch::kCUDA);  // fp32 bytes, as uint16 words
  CHECK(kernels::checksum(f).item<int64_t>() == kernels::checksum_ref(f.cpu()).item<int64_t>());
}
