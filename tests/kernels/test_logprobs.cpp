// The fused per-token log-prob / entropy kernels (kernels/logprobs.hpp): the LibTorch chunk
// reference against autograd in fp64 on CPU, and the CUDA kernel against the reference in bf16
// (forward, backward, entropy) on every GPU present.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "kernels/logprobs.hpp"
#include "tests/kernels/kernel_test_util.hpp"

using namespace kiln;
using kiln::test::rel_error;
using kiln::test::skip_without_cuda_kernels;

TEST_CASE("log-prob chunk reference: log_softmax, entropy and their gradients by autograd (CPU, fp64)") {
  torch::manual_seed(6);
  auto z = torch::randn({5, 37}, torch::kFloat64).requires_grad_();
  auto targets = torch::tensor({3, -1, 36, 0, 7});
  auto [lp, lse, ent, mz] = kernels::logprob_chunk_forward(z, targets, true);
  auto ls = torch::log_softmax(z, -1);
  auto want_lp = ls.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1) * (targets >= 0).to(torch::kFloat64);
  auto want_ent = -(ls.exp() * ls).sum(-1);
  CHECK(rel_error(lp, want_lp) <= 1e-6);
  CHECK(rel_error(ent, want_ent) <= 1e-6);
  auto g_lp = torch::randn({5}, torch::kFloat64) * (targets >= 0).to(torch::kFloat64), g_ent = torch::randn({5}, torch::kFloat64);
  auto want_dz = torch::autograd::grad({(want_lp * g_lp).sum() + (want_ent * g_ent).sum()}, {z})[0];
  auto dz = kernels::logprob_chunk_backward(z.detach(), targets, lse, g_lp, g_ent, mz, torch::kFloat64);
  CHECK(rel_error(dz, want_dz) <= 1e-6);
}

TEST_CASE("CUDA: fused log-prob kernel equals the reference in bf16 (forward, backward, entropy)") {
  if (skip_without_cuda_kernels()) return;
  torch::manual_seed(7);
  for (int64_t V : {154880, 1001}) {  // 16-byte loads, and the scalar path for V % 8 != 0
    CAPTURE(V);
    auto z = (3 * torch::randn({64, V}, torch::kCUDA)).to(torch::kBFloat16);
    auto targets = torch::randint(0, V, {64}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kInt64));
    targets[5] = -1;
    auto [lp, lse, ent, mz] = kernels::logprob_chunk_forward(z, targets, true);
    auto [rlp, rlse, rent, rmz] = kernels::logprob_chunk_forward_ref(z, targets, true);
    CHECK((lp - rlp).abs().max().item<double>() <= 1e-3);
    CHECK((lse - rlse).abs().max().item<double>() <= 1e-3);
    CHECK((ent - rent).abs().max().item<double>() <= 1e-3);
    CHECK(lp[5].item<double>() == 0.0);
    auto g_lp = torch::randn({64}, torch::kCUDA), g_ent = torch::randn({64}, torch::kCUDA);
    g_lp[5] = 0;
    auto dz = kernels::logprob_chunk_backward(z, targets, lse, g_lp, g_ent, mz, torch::kBFloat16);
    auto rdz = kernels::logprob_chunk_backward_ref(z, targets, rlse, g_lp, g_ent, rmz, torch::kBFloat16);
    const double e = rel_error(dz, rdz);
    MESSAGE("fused log-prob backward vs reference rel err " << e);
    CHECK(e <= 1e-2);
    // fp32 logits in, a bf16 copy kept, the backward from the copy with the copy's softmax.
    auto z32 = 3 * torch::randn({64, V}, torch::kCUDA);
    auto keep = torch::empty({64, V}, z.options());
    kernels::KeptStats ks, rks;
    auto f = kernels::logprob_chunk_forward(z32, targets, true, keep, &ks);
    auto keep_ref = torch::empty_like(keep);
    auto rf = kernels::logprob_chunk_forward_ref(z32, targets, true, keep_ref, &rks);
    CHECK(torch::equal(keep, keep_ref));
    CHECK((std::get<0>(f) - std::get<0>(rf)).abs().max().item<double>() <= 1e-4);  // fp32 log-probs
    CHECK((ks.lse - rks.lse).abs().max().item<double>() <= 1e-4);
    CHECK((ks.mean_z - rks.mean_z).abs().max().item<double>() <= 1e-3);
    auto dzk = kernels::logprob_chunk_backward(keep, targets, ks.lse, g_lp, g_ent, ks.mean_z, torch::kBFloat16);
    auto rdzk = kernels::logprob_chunk_backward_ref(keep, targets, rks.lse, g_lp, g_ent, rks.mean_z, torch::kBFloat16);
    CHECK(rel_error(dzk, rdzk) <= 1e-2);
    // In place over the kept logits (the model's backward): the same bits as into a new tensor.
    auto in_place = keep.clone();
    auto ret = kernels::logprob_chunk_backward(in_place, targets, ks.lse, g_lp, g_ent, ks.mean_z, torch::kBFloat16,
                                               in_place);
    CHECK(ret.data_ptr() == in_place.data_ptr());
    CHECK(torch::equal(in_place, dzk));
    auto dz32 = kernels::logprob_chunk_backward(z32, targets, std::get<1>(f), g_lp, g_ent, std::get<3>(f), torch::kBFloat16);
    auto rdz32 = kernels::logprob_chunk_backward_ref(z32, targets, std::get<1>(rf), g_lp, g_ent, std::get<3>(rf), torch::kBFloat16);
    CHECK(rel_error(dz32, rdz32) <= 1e-2);
  }
}

TEST_CASE("log-prob backward into a given tensor gives the reference's values and a wrong out tensor is refused by shape") {
  torch::manual_seed(8);
  auto z = 2 * torch::randn({5, 33}, torch::kFloat64);
  auto targets = torch::tensor({3, -1, 0, 32, 7}, torch::kInt64);
  auto [lp, lse, ent, mz] = kernels::logprob_chunk_forward_ref(z, targets, true);
  auto g_lp = torch::randn({5}, torch::kFloat64), g_ent = torch::randn({5}, torch::kFloat64);
  g_lp[1] = 0;
  auto want = kernels::logprob_chunk_backward_ref(z, targets, lse, g_lp, g_ent, mz, torch::kFloat64);
  auto out = torch::empty({5, 33}, torch::kFloat64);
  auto got = kernels::logprob_chunk_backward(z, targets, lse, g_lp, g_ent, mz, torch::kFloat64, out);
  CHECK(got.data_ptr() == out.data_ptr());
  CHECK(torch::equal(out, want));
  CHECK_THROWS_WITH_AS(kernels::logprob_chunk_backward(z, targets, lse, g_lp, g_ent, mz, torch::kFloat64,
                                                    torch::empty({5, 32}, torch::kFloat64)),
                    doctest::Contains("out must be a contiguous"), c10::Error);
}
