// RoPE by cos/sin tables (kernels/rope.hpp, model::rope_table, model::apply_rope_cached): on
// CPU the reference over the table's rows equals model::apply_rope bit for bit, and the errors;
// on a GPU the kernel equals apply_rope bit for bit (fp32, bf16, fp16; interleaved or not;
// strided queries and the [T, 1, R] key form; positions up to 8200), inside a CUDA graph too,
// and a table cannot grow while a graph is captured.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <vector>

#include "kernels/cuda_graph.hpp"
#include "kernels/stream_event.hpp"
#include "kernels/rope.hpp"
#include "model/blocks/basic.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
constexpr double kTheta = 10000.0;

bool bit_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && torch::equal(a.contiguous(), b.contiguous());
}

// The q form (a strided view [T, H, R] of [T, H, N+R]) and the k form ([T, 1, R] of [T, C+R]).
struct Inputs {
  torch::Tensor q, k, positions;
};
Inputs make_inputs(int64_t T, int64_t H, int64_t R, int64_t max_pos, torch::Dtype dtype, torch::Device dev) {
  auto qs = torch::randn({T, H, 48 + R}, torch::TensorOptions().dtype(dtype).device(dev)) * 3;
  auto ckv = torch::randn({T, 40 + R}, torch::TensorOptions().dtype(dtype).device(dev)) * 3;
  auto pos = torch::randint(0, max_pos, {T}, torch::TensorOptions().dtype(torch::kInt64).device(dev));
  pos.index_put_({0}, max_pos - 1);
  return {qs.narrow(-1, 48, R), ckv.narrow(-1, 40, R).unsqueeze(1), pos};
}
}  // namespace

TEST_CASE("rope by the cached table equals apply_rope bit for bit on the CPU (fp32, bf16)") {
  torch::manual_seed(3);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16})
    for (bool interleaved : {true, false}) {
      auto in = make_inputs(37, 5, 16, 5000, dtype, torch::kCPU);
      const auto t = model::rope_table(5000, 16, kTheta, dtype, torch::kCPU);
      CHECK(t.cos.size(0) >= 5000);
      for (const auto& x : {in.q, in.k}) {
        auto want = model::apply_rope(x, in.positions, kTheta, interleaved);
        CHECK(bit_equal(kernels::rope_rotate(x, in.positions, t.cos, t.sin, interleaved), want));
        CHECK(bit_equal(kernels::rope_rotate_ref(x, in.positions, t.cos, t.sin, interleaved), want));
        CHECK(bit_equal(model::apply_rope_cached(x, in.positions, 5000, kTheta, interleaved), want));
      }
    }
  // A larger ask grows the table; the smaller one handed out before keeps its values.
  const auto small = model::rope_table(10, 8, kTheta, torch::kFloat32, torch::kCPU);
  auto before = small.cos.clone();
  const auto big = model::rope_table(100000, 8, kTheta, torch::kFloat32, torch::kCPU);
  CHECK(big.cos.size(0) >= 100000);
  CHECK(torch::equal(big.cos.narrow(0, 0, small.cos.size(0)), before));
  CHECK(torch::equal(small.cos, before));
}

TEST_CASE("rope_rotate names the shapes, dtypes and devices it refuses") {
  const auto t = model::rope_table(64, 8, kTheta, torch::kFloat32, torch::kCPU);
  auto x = torch::randn({3, 2, 8});
  auto pos = torch::arange(3, torch::kInt64);
  CHECK_THROWS_WITH_AS(kernels::rope_rotate(torch::randn({3, 2, 7}), pos, t.cos, t.sin, true),
                       doctest::Contains("R even"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::rope_rotate(x, pos.to(torch::kInt32), t.cos, t.sin, true),
                       doctest::Contains("positions must be int64"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::rope_rotate(x, pos, t.cos.narrow(1, 0, 2), t.sin.narrow(1, 0, 2), true),
                       doctest::Contains("cos and sin tables [P, R/2] with R = 8"), c10::Error);
  CHECK_THROWS_WITH_AS(kernels::rope_rotate(x, pos, t.cos.to(torch::kBFloat16), t.sin.to(torch::kBFloat16), true),
                       doctest::Contains("must have x's dtype"), c10::Error);
  CHECK_THROWS_WITH_AS(model::rope_table(0, 8, kTheta, torch::kFloat32, torch::kCPU),
                       doctest::Contains("0 positions and R = 8"), std::invalid_argument);
  // The reference refuses a position past the table (the kernel clamps it).
  CHECK_THROWS_AS(kernels::rope_rotate_ref(x, torch::full({3}, t.cos.size(0), torch::kInt64), t.cos, t.sin, true),
                  c10::Error);
}

TEST_CASE("CUDA: rope kernel equals apply_rope bit for bit (fp32, bf16, fp16, strided q, [T, 1, R] k)") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(4);
  const torch::Device dev(torch::kCUDA);
  torch::NoGradGuard no_grad;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kHalf})
    for (bool interleaved : {true, false})
      for (int64_t T : {1, 7, 256, 3000}) {
        auto in = make_inputs(T, 20, 64, 8200, dtype, dev);
        for (const auto& x : {in.q, in.k}) {
          auto want = model::apply_rope(x, in.positions, kTheta, interleaved);
          auto got = model::apply_rope_cached(x, in.positions, 8200, kTheta, interleaved);
          INFO("dtype " << dtype << " interleaved " << interleaved << " T " << T << " x " << x.sizes());
          CHECK(got.is_contiguous());
          CHECK(bit_equal(got, want));
        }
      }
}

TEST_CASE("CUDA: rope kernel in a CUDA graph follows new positions, and a table does not grow under capture") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(5);
  const torch::Device dev(torch::kCUDA);
  torch::NoGradGuard no_grad;
  auto in = make_inputs(64, 20, 64, 2048, torch::kBFloat16, dev);
  torch::Tensor out;
  auto pool = kernels::GraphPool::make();
  kernels::CapturedGraph graph(dev, pool, [&] {
    out = model::apply_rope_cached(in.q, in.positions, 2048, kTheta, true);
  });
  for (int round = 0; round < 3; ++round) {
    in.positions.copy_(torch::randint(0, 2048, {64}, torch::TensorOptions().dtype(torch::kInt64).device(dev)));
    in.q.copy_(torch::randn_like(in.q));
    graph.replay();
    CHECK(bit_equal(out, model::apply_rope(in.q, in.positions, kTheta, true)));
  }
  // A table asked for more positions than it holds, first inside a capture: refused by name.
  const int64_t huge = int64_t(1) << 22;
  CHECK_THROWS_WITH_AS(kernels::CapturedGraph(dev, pool,
                                              [&] {
                                                if (kernels::CapturedGraph::capturing(dev))
                                                  model::rope_table(huge, 62, kTheta, torch::kBFloat16, dev);
                                              }),
                       doctest::Contains("while its stream captures a CUDA graph"), std::logic_error);
}

TEST_CASE("StreamEvent refuses a device that is not CUDA, and on CUDA completes after the work queued before it") {
  CHECK_THROWS_AS(kernels::StreamEvent(torch::Device(torch::kCPU)), std::exception);
  if (skip_without_cuda_kernels()) return;
  const torch::Device dev(torch::kCUDA);
  auto a = torch::randn({4096, 4096}, torch::TensorOptions().device(dev));
  auto b = a.matmul(a);
  kernels::StreamEvent done(dev);
  done.synchronize();
  CHECK(done.done());
  CHECK(torch::allclose(b.cpu(), a.cpu().matmul(a.cpu()), 1e-3, 1e-2));
}
