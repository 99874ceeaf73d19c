// adamw_step_low_precision (kernels/adamw.hpp): on CPU a hand-worked first step (decay, moments,
// bias corrections, the clip scale, the rounding into bf16), the reference against
// torch::optim::AdamW over several steps, and what it refuses; on a GPU the one-pass kernel
// (kernels/adamw_cuda.hpp's entry point, reached through the dispatch) against the reference (LibTorch's fused AdamW over widened gradients, then a copy) at sizes
// around its vector width and chunk, misaligned views, bf16 and fp16, with and without decay and
// clip scaling, over several steps.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>

#include "kernels/adamw.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::skip_without_cuda_kernels;

namespace {
// One parameter's tensors.
struct Param {
  torch::Tensor master, exp_avg, exp_avg_sq, grad, param;
};

// n parameters of the given sizes (elements), masters ~ N(0, 1), moments zero, gradients ~
// N(0, 0.01) in `low`; on `device`.
std::vector<Param> make_params(const std::vector<int64_t>& sizes, torch::ScalarType low, torch::Device device, int seed) {
  torch::manual_seed(seed);
  std::vector<Param> out;
  for (auto n : sizes) {
    Param p;
    p.master = torch::randn({n}).to(device);
    p.exp_avg = torch::zeros({n}, torch::TensorOptions(device));
    p.exp_avg_sq = torch::zeros({n}, torch::TensorOptions(device));
    p.grad = (torch::randn({n}) * 0.01).to(device, low);
    p.param = torch::empty({n}, torch::TensorOptions(device).dtype(low));
    out.push_back(p);
  }
  return out;
}

std::vector<Param> clone(const std::vector<Param>& ps) {
  std::vector<Param> out;
  for (const auto& p : ps) out.push_back({p.master.clone(), p.exp_avg.clone(), p.exp_avg_sq.clone(), p.grad, p.param.clone()});
  return out;
}

using Step = void (*)(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                      const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const at::Tensor&,
                      const std::vector<at::Tensor>&, const kernels::AdamWHyper&);

void run(Step f, std::vector<Param>& ps, const at::Tensor& scale, const at::Tensor& step, const kernels::AdamWHyper& h) {
  std::vector<at::Tensor> m, a, b, g, p, s;
  for (auto& x : ps) {
    m.push_back(x.master);
    a.push_back(x.exp_avg);
    b.push_back(x.exp_avg_sq);
    g.push_back(x.grad);
    p.push_back(x.param);
    s.push_back(step);
  }
  f(m, a, b, g, p, scale, s, h);
}

// Elements of got that differ from want, and the largest difference in units of want's fp32
// spacing (2^-23 relative, the smallest normal's below it).
struct Ulps {
  int64_t differ = 0;
  double max = 0;
};
Ulps ulps(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kFloat64), w = want.to(torch::kFloat64);
  auto spacing = w.abs().clamp_min(1.1754943508222875e-38) * std::ldexp(1.0, -23);
  return {(got != want).sum().item<int64_t>(), ((g - w).abs() / spacing).max().item<double>()};
}
}  // namespace

TEST_CASE("adamw_step_low_precision: a hand-worked first step with decay and clip scaling, rounded into bf16") {
  // lr 0.1, weight decay 0.01, scale 0.5, step 1: g = grad / 2; master *= 1 - 0.001; exp_avg =
  // 0.1 g, exp_avg_sq = 0.001 g^2; bias corrections 0.1 and sqrt(0.001), so the step is
  // lr * g / (|g| + eps): 0.1 * sign(g), and 0 where g is 0.
  auto master = torch::tensor({1.0f, -2.0f, 0.5f, 3.0f});
  auto grad = torch::tensor({0.5f, -0.25f, 0.0f, 2.0f}).to(torch::kBFloat16);
  auto exp_avg = torch::zeros({4}), exp_avg_sq = torch::zeros({4});
  auto param = torch::empty({4}, torch::kBFloat16);
  const kernels::AdamWHyper h{0.1, 0.9, 0.999, 0.01, 1e-8};
  kernels::adamw_step_low_precision({master}, {exp_avg}, {exp_avg_sq}, {grad}, {param}, torch::tensor(0.5f),
                                    {torch::tensor(1.0f)}, h);
  const auto want_master = torch::tensor({0.899f, -1.898f, 0.4995f, 2.897f});
  CHECK(torch::allclose(master, want_master, 0, 1e-6));
  CHECK(torch::allclose(exp_avg, torch::tensor({0.025f, -0.0125f, 0.0f, 0.1f}), 1e-6, 0));
  CHECK(torch::allclose(exp_avg_sq, torch::tensor({6.25e-5f, 1.5625e-5f, 0.0f, 1e-3f}), 1e-6, 0));
  CHECK(torch::equal(param, master.to(torch::kBFloat16)));
  CHECK_FALSE(kernels::adamw_step_low_precision_uses_kernel({master}, {exp_avg}, {exp_avg_sq}, {grad}, {param},
                                                            torch::tensor(0.5f), {torch::tensor(1.0f)}));
}

TEST_CASE("adamw_step_low_precision's reference steps as torch::optim::AdamW on the widened, scaled gradients") {
  for (const double scale : {1.0, 0.37}) {
    CAPTURE(scale);
    auto ps = make_params({1, 7, 300, 4096}, torch::kBFloat16, torch::kCPU, 3);
    std::vector<torch::Tensor> want;
    for (const auto& p : ps) want.push_back(p.master.clone().requires_grad_(true));
    const kernels::AdamWHyper h{1e-2, 0.9, 0.95, 0.1, 1e-8};
    torch::optim::AdamW adamw(want, torch::optim::AdamWOptions(h.lr).betas({h.beta1, h.beta2}).weight_decay(h.weight_decay).eps(h.eps));
    for (int step = 1; step <= 3; ++step) {
      CAPTURE(step);
      for (auto& p : ps) p.grad = (torch::randn(p.grad.sizes()) * 0.01).to(torch::kBFloat16);
      for (std::size_t i = 0; i < ps.size(); ++i) want[i].mutable_grad() = ps[i].grad.to(torch::kFloat32) * float(scale);
      adamw.step();
      run(kernels::adamw_step_low_precision, ps, torch::tensor(float(scale)), torch::tensor(float(step)), h);
      for (std::size_t i = 0; i < ps.size(); ++i) {
        CAPTURE(i);
        const double err = ((ps[i].master - want[i].detach()).norm() / want[i].detach().norm()).item<double>();
        CHECK(err <= 1e-6);
        CHECK(torch::equal(ps[i].param, ps[i].master.to(torch::kBFloat16)));
      }
    }
  }
}

TEST_CASE("adamw_step_low_precision refuses mismatched lists, shapes and dtypes, naming them") {
  auto ps = make_params({8}, torch::kBFloat16, torch::kCPU, 1);
  auto& p = ps[0];
  const auto one = torch::tensor(1.0f);
  const kernels::AdamWHyper h;
  auto message = [&](auto&& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  auto contains = [](const std::string& s, const char* part) { return s.find(part) != std::string::npos; };
  CHECK(contains(message([&] { kernels::adamw_step_low_precision({p.master}, {}, {p.exp_avg_sq}, {p.grad}, {p.param}, one, {one}, h); }),
                 "1 masters but 0 exp_avgs"));
  CHECK(contains(message([&] {
                   kernels::adamw_step_low_precision({p.master}, {p.exp_avg}, {p.exp_avg_sq}, {torch::zeros({9}, torch::kBFloat16)},
                                                     {p.param}, one, {one}, h);
                 }),
                 "parameter 0 has a master of shape [8] and a tensor of shape [9]"));
  CHECK(contains(message([&] {
                   kernels::adamw_step_low_precision({p.master.to(torch::kBFloat16)}, {p.exp_avg}, {p.exp_avg_sq}, {p.grad},
                                                     {p.param}, one, {one}, h);
                 }),
                 "master and moments must be fp32"));
  CHECK(contains(message([&] {
                   kernels::adamw_step_low_precision({p.master}, {p.exp_avg}, {p.exp_avg_sq}, {p.grad.to(torch::kFloat32)},
                                                     {p.param}, one, {one}, h);
                 }),
                 "gradients must be bf16 or fp16"));
  CHECK(contains(message([&] {
                   kernels::adamw_step_low_precision({p.master}, {p.exp_avg}, {p.exp_avg_sq}, {p.grad},
                                                     {p.param.to(torch::kHalf)}, one, {one}, h);
                 }),
                 "gradient and parameter must be BFloat16"));
  CHECK(contains(message([&] {
                   kernels::adamw_step_low_precision({p.master}, {p.exp_avg}, {p.exp_avg_sq}, {p.grad}, {p.param},
                                                     torch::ones({2}), {one}, h);
                 }),
                 "grad_scale must be one fp32 element"));
  CHECK(torch::equal(p.master, make_params({8}, torch::kBFloat16, torch::kCPU, 1)[0].master));  // nothing stepped
}

TEST_CASE("CUDA: adamw_step_low_precision's kernel equals LibTorch's fused AdamW over widened gradients") {
  if (skip_without_cuda_kernels()) return;
  const torch::Device cuda(torch::kCUDA);
  // Around the 4-element vectors and the 64K-element chunks, and a [2048, 1536] matrix.
  const std::vector<int64_t> sizes{1, 3, 4, 5, 1000, 65535, 65536, 65537, 200003, 2048 * 1536};
  for (const auto low : {torch::kBFloat16, torch::kHalf})
    for (const double wd : {0.0, 0.1})
      for (const double scale : {1.0, 0.37}) {
        CAPTURE(low);
        CAPTURE(wd);
        CAPTURE(scale);
        auto got = make_params(sizes, low, cuda, 5);
        // A parameter whose operands start one element past a vector boundary: the scalar path.
        auto big = make_params({70001}, low, cuda, 6)[0];
        got.push_back({big.master.narrow(0, 1, 70000), big.exp_avg.narrow(0, 1, 70000),
                       big.exp_avg_sq.narrow(0, 1, 70000), big.grad.narrow(0, 1, 70000), big.param.narrow(0, 1, 70000)});
        auto want = clone(got);
        const kernels::AdamWHyper h{3e-4, 0.9, 0.95, wd, 1e-8};
        const auto s = torch::tensor(float(scale)).to(cuda);
        Ulps worst_master, worst_moment;
        for (int step = 1; step <= 3; ++step) {
          const auto st = torch::tensor(float(step)).to(cuda);
          for (std::size_t i = 0; i < got.size(); ++i) {
            got[i].grad = (torch::randn(got[i].grad.sizes()) * 0.01).to(cuda, low);
            want[i].grad = got[i].grad;
          }
          std::vector<at::Tensor> m, a, b, g, p, steps;
          for (auto& x : got) {
            m.push_back(x.master), a.push_back(x.exp_avg), b.push_back(x.exp_avg_sq), g.push_back(x.grad),
                p.push_back(x.param), steps.push_back(st);
          }
          CHECK(kernels::adamw_step_low_precision_uses_kernel(m, a, b, g, p, s, steps));
          run(kernels::adamw_step_low_precision, got, s, st, h);
          run(kernels::adamw_step_low_precision_ref, want, s, st, h);
          for (std::size_t i = 0; i < got.size(); ++i) {
            const auto um = ulps(got[i].master, want[i].master);
            const auto ua = ulps(got[i].exp_avg, want[i].exp_avg), ub = ulps(got[i].exp_avg_sq, want[i].exp_avg_sq);
            worst_master.differ += um.differ, worst_master.max = std::max(worst_master.max, um.max);
            worst_moment.differ += ua.differ + ub.differ, worst_moment.max = std::max({worst_moment.max, ua.max, ub.max});
            CHECK(torch::equal(got[i].param, got[i].master.to(low)));  // the parameter is its master rounded
          }
        }
        MESSAGE("kernel vs LibTorch's fused AdamW over 3 steps: masters " << worst_master.differ
                << " elements differ (largest " << worst_master.max << " ulp), moments " << worst_moment.differ
                << " (largest " << worst_moment.max << " ulp)");
        // The same formula in the same order: at most the last bit where the compiler contracts
        // a multiply-add differently.
        CHECK(worst_master.max <= 2.0);
        CHECK(worst_moment.max <= 2.0);
      }
}
