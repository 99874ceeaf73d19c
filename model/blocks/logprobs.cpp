#include "model/blocks/logprobs.hpp"

#include "kernels/batch_invariant.hpp"
#include "kernels/lm_head.hpp"
#include "kernels/logprobs.hpp"
#include "model/blocks/batch_invariant.hpp"

namespace kiln::model {

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Chunk [s, s+n): logits [n, V] (lm_logits: fp32 from a 16-bit GEMM on CUDA).
torch::Tensor chunk_logits(const torch::Tensor& h, const torch::Tensor& w, int64_t s, int64_t n) {
  return lm_logits(h.narrow(0, s, n), w);
}

// Log-probs of targets and, when `with_entropy`, the entropy of each row; the backward
// recomputes each chunk's logits. dH/dz_v = -p_v (z_v - E_p[z]).
struct ChunkedLogProbs : public torch::autograd::Function<ChunkedLogProbs> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& targets, int64_t chunk, bool with_entropy, int64_t kept_rows) {
    const int64_t T = hidden.size(0);
    // The logits of the first kept_rows tokens (whole chunks, or all T) in the model's (16-bit)
    // dtype, or on the fused head their probabilities, for the backward to reuse; the other
    // chunks' are recomputed there.
    auto kept = kept_rows > 0 ? torch::empty({kept_rows, weight.size(0)}, hidden.options()) : torch::Tensor();
    auto fopt = hidden.options().dtype(torch::kFloat32);
    auto out = torch::empty({T}, fopt), lse = torch::empty({T}, fopt);
    auto ent = torch::empty({with_entropy ? T : 0}, fopt), mean_z = torch::empty({with_entropy ? T : 0}, fopt);
    // On Hopper (log-probs without entropy): one GEMM writes each chunk's bf16 probabilities
    // against a per-row reference (into the kept rows, or a scratch chunk) and both row sums
    // (kernels/lm_head.hpp); the reference is the target's logit, a dot product in fp32 (one
    // kernel), + kProbsReferenceMargin, and the target's log-prob that logit minus the lse.
    const bool fused = !with_entropy && kernels::lm_head_fused_available(hidden, weight);
    auto scratch = fused && kept_rows < T ? torch::empty({std::min(chunk, T), weight.size(0)}, hidden.options())
                                          : torch::Tensor();
    auto reference = torch::empty({fused ? T : 0}, fopt), kept_lse = torch::empty({fused ? T : 0}, fopt);
    for (int64_t s = 0; s < T; s += chunk) {
      const int64_t n = std::min(chunk, T - s);
      kernels::KeptStats ks;
      const bool keep = s < kept_rows;
      if (fused) {
        const auto h = hidden.narrow(0, s, n), t = targets.narrow(0, s, n);
        const auto z = kernels::lm_head_target_logits(h, weight, t);  // 0 without a target
        auto c = reference.narrow(0, s, n);
        torch::add_out(c, z, kernels::kProbsReferenceMargin);
        auto [l, kept_l] = kernels::lm_head_probs_lse(h, weight, c, keep ? kept.narrow(0, s, n) : scratch.narrow(0, 0, n));
        const auto valid = t.ge(0).logical_and_(t.lt(weight.size(0)));
        out.narrow(0, s, n).copy_(torch::where(valid, z - l, torch::zeros_like(l)));
        lse.narrow(0, s, n).copy_(l);
        kept_lse.narrow(0, s, n).copy_(kept_l);
        continue;
      }
      auto [lp, l, e, mz] = kernels::logprob_chunk_forward(chunk_logits(hidden, weight, s, n), targets.narrow(0, s, n),
                                                           with_entropy, keep ? kept.narrow(0, s, n) : torch::Tensor(),
                                                           &ks);
      if (keep) {  // the backward differentiates the softmax of the kept values
        l = ks.lse;
        if (with_entropy) mz = ks.mean_z;
      }
      out.narrow(0, s, n).copy_(lp);
      lse.narrow(0, s, n).copy_(l);
      if (with_entropy) {
        ent.narrow(0, s, n).copy_(e);
        mean_z.narrow(0, s, n).copy_(mz);
      }
    }
    ctx->save_for_backward({hidden, weight, targets, lse, mean_z, kept, reference, kept_lse});
    ctx->saved_data["probs"] = fused;  // kept holds probabilities (lm_head_probs_lse), not logits
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["with_entropy"] = with_entropy;
    return {out, ent};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3], &mean_z = saved[4],
               &kept = saved[5], &reference = saved[6], &kept_lse = saved[7];
    const bool probs = ctx->saved_data["probs"].toBool();
    const int64_t chunk = ctx->saved_data["chunk"].toInt(), T = hidden.size(0);
    const bool entropy_grad = ctx->saved_data["with_entropy"].toBool() && grads[1].defined();
    auto g_lp = grads[0].defined() ? grads[0].to(torch::kFloat32) * (targets >= 0).to(torch::kFloat32)
                                   : torch::zeros({T}, hidden.options().dtype(torch::kFloat32));
    auto g_ent = entropy_grad ? grads[1].to(torch::kFloat32) : torch::Tensor();
    const bool tensor_cores = hidden.is_cuda() && hidden.scalar_type() != torch::kFloat32;
    const int64_t K = kept.defined() ? kept.size(0) : 0;  // rows whose logits (or probabilities) were kept
    auto grad_h = torch::empty_like(hidden);
    torch::Tensor grad_w;  // fp32 [V, D], rounded to the weight's dtype once at the end
    if (K > 0 && probs) {
      // Both GEMMs straight from the kept probabilities, scaled by row (kernels/lm_head.hpp; a
      // row whose values reached the GEMM's clamp recomputed there on its own).
      auto [gh, gw] = kernels::lm_head_probs_backward(kept, hidden.narrow(0, 0, K), weight, targets.narrow(0, 0, K),
                                                      reference.narrow(0, 0, K), lse.narrow(0, 0, K),
                                                      kept_lse.narrow(0, 0, K), g_lp.narrow(0, 0, K),
                                                      K == T ? weight.scalar_type() : torch::kFloat32);
      torch::autograd::impl::bump_version(kept);  // (a second backward through this node fails)
      if (K == T) return {gh, gw, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
      grad_h.narrow(0, 0, K).copy_(gh);
      grad_w = gw;
    } else if (K > 0 && tensor_cores) {
      // dz replaces the kept logits in place (they are read for nothing else; a second backward
      // through this node fails autograd's saved-version check), then two GEMMs over all K rows:
      // the hidden gradient [K, V] x [V, D] and the weight gradient [V, K] x [K, D], fp32
      // accumulation in the GEMM — no fp32 [V, D] buffer read and written once per chunk.
      kernels::logprob_chunk_backward(kept, targets.narrow(0, 0, K), lse.narrow(0, 0, K), g_lp.narrow(0, 0, K),
                                      entropy_grad ? g_ent.narrow(0, 0, K) : torch::Tensor(),
                                      entropy_grad ? mean_z.narrow(0, 0, K) : torch::Tensor(), hidden.scalar_type(),
                                      kept);
      torch::autograd::impl::bump_version(kept);
      if (K == T)  // all kept: the weight's gradient rounded once by the GEMM itself
        return {kept.mm(weight), kept.t().mm(hidden), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
      auto rows = grad_h.narrow(0, 0, K);
      torch::mm_out(rows, kept, weight);
      grad_w = at::mm(kept.t(), hidden.narrow(0, 0, K), torch::kFloat32);
    } else {
      grad_w = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32));
    }
    if (probs) {
      // The chunks not kept, on the fused head: each one's probabilities made again by the same
      // GEMM (against the forward's references) into one bf16 scratch chunk, then both GEMMs
      // from them as for the kept rows, the weight's gradient added into grad_w in place — no
      // fp32 [n, V] logits, no dz, no second [V, D].
      auto scratch = torch::empty({std::min(chunk, T - K), weight.size(0)}, hidden.options());
      for (int64_t s = K; s < T; s += chunk) {
        const int64_t n = std::min(chunk, T - s);
        const auto h = hidden.narrow(0, s, n), c = reference.narrow(0, s, n), p = scratch.narrow(0, 0, n);
        auto [l, kept_l] = kernels::lm_head_probs_lse(h, weight, c, p);
        auto gh = kernels::lm_head_probs_backward(p, h, weight, targets.narrow(0, s, n), c, l, kept_l,
                                                  g_lp.narrow(0, s, n), torch::kFloat32, grad_w)
                      .first;
        grad_h.narrow(0, s, n).copy_(gh);
      }
      return {grad_h, grad_w.to(weight.scalar_type()), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
    for (int64_t s = tensor_cores ? K : 0; s < T; s += chunk) {
      const int64_t n = std::min(chunk, T - s);
      auto z = s < K ? kept.narrow(0, s, n) : chunk_logits(hidden, weight, s, n);  // kept or recomputed
      auto dz = kernels::logprob_chunk_backward(z, targets.narrow(0, s, n),
                                                lse.narrow(0, s, n), g_lp.narrow(0, s, n),
                                                entropy_grad ? g_ent.narrow(0, s, n) : torch::Tensor(),
                                                entropy_grad ? mean_z.narrow(0, s, n) : torch::Tensor(),
                                                hidden.scalar_type());  // [n, V] in the model's dtype
      auto h = hidden.narrow(0, s, n);
      auto rows = grad_h.narrow(0, s, n);
      torch::mm_out(rows, dz, weight);  // [n, D]
      if (tensor_cores)  // bf16 GEMM, fp32 accumulation into the [V, D] gradient
        grad_w = at::addmm(grad_w, dz.t(), h, torch::kFloat32);
      else
        grad_w.addmm_(dz.to(torch::kFloat32).t(), h.to(torch::kFloat32));
    }
    return {grad_h, grad_w.to(weight.scalar_type()), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// How many leading rows' logits the forward keeps for the backward: none unless a backward will
// run and they are 16-bit; then all T when [T, V] fits in keep_bytes, else as many whole chunks
// as fit (the rest are recomputed).
int64_t kept_rows(const torch::Tensor& hidden, const torch::Tensor& weight, int64_t chunk, int64_t keep_bytes) {
  if (!torch::GradMode::is_enabled() || !(hidden.requires_grad() || weight.requires_grad()) ||
      hidden.scalar_type() == torch::kFloat32 || hidden.scalar_type() == torch::kFloat64)
    return 0;
  const int64_t T = hidden.size(0), row_bytes = std::max<int64_t>(1, weight.size(0) * int64_t(hidden.element_size()));
  const int64_t rows = std::max<int64_t>(0, keep_bytes) / row_bytes;
  return rows >= T ? T : rows / chunk * chunk;
}
}  // namespace

torch::Tensor lm_logits(const torch::Tensor& hidden_ND, const torch::Tensor& weight_VD) {
  const auto t = hidden_ND.scalar_type();
  if (hidden_ND.is_cuda() && (t == torch::kBFloat16 || t == torch::kHalf))
    return at::mm(hidden_ND, weight_VD.t(), torch::kFloat32);  // 16-bit tensor cores, fp32 output
  return torch::nn::functional::linear(hidden_ND, weight_VD).to(torch::kFloat32);
}

std::pair<torch::Tensor, torch::Tensor> token_logprobs_and_entropy(const torch::Tensor& hidden_TD,
                                                                   const torch::Tensor& weight_VD,
                                                                   const torch::Tensor& targets_T, int64_t chunk,
                                                                   int64_t keep_bytes) {
  TORCH_CHECK(hidden_TD.dim() == 2 && weight_VD.dim() == 2 && hidden_TD.size(1) == weight_VD.size(1),
              "token_logprobs_and_entropy: hidden [T, D] and weight [V, D] expected");
  TORCH_CHECK(targets_T.dim() == 1 && targets_T.size(0) == hidden_TD.size(0), "token_logprobs_and_entropy: targets [T]");
  TORCH_CHECK(chunk > 0, "token_logprobs_and_entropy: chunk must be > 0");
  auto r = ChunkedLogProbs::apply(hidden_TD, weight_VD, targets_T.to(hidden_TD.device(), torch::kInt64), chunk, true,
                                 kept_rows(hidden_TD, weight_VD, chunk, keep_bytes));
  return {r[0], r[1]};
}

torch::Tensor token_logprobs(const torch::Tensor& hidden_TD, const torch::Tensor& weight_VD,
                             const torch::Tensor& targets_T, int64_t chunk, int64_t keep_bytes) {
  TORCH_CHECK(hidden_TD.dim() == 2 && weight_VD.dim() == 2 && hidden_TD.size(1) == weight_VD.size(1),
              "token_logprobs: hidden [T, D] and weight [V, D] expected, got ", hidden_TD.sizes(), " and ",
              weight_VD.sizes());
  TORCH_CHECK(targets_T.dim() == 1 && targets_T.size(0) == hidden_TD.size(0), "token_logprobs: targets must be [T]");
  TORCH_CHECK(chunk > 0, "token_logprobs: chunk must be > 0");
  return ChunkedLogProbs::apply(hidden_TD, weight_VD, targets_T.to(hidden_TD.device(), torch::kInt64), chunk, false,
                                 kept_rows(hidden_TD, weight_VD, chunk, keep_bytes))[0];
}

torch::Tensor invariant_lm_logits(const torch::Tensor& hidden_ND, const torch::Tensor& weight_VD) {
  torch::NoGradGuard no_grad;
  return kernels::bi_linear(hidden_ND, weight_VD, torch::kFloat32);  // [N, V]
}

TemperedLogits invariant_tempered_logits(const torch::Tensor& logits_MV, const torch::Tensor& temperature_M) {
  TORCH_CHECK(logits_MV.dim() == 2 && logits_MV.scalar_type() == torch::kFloat32, "invariant_tempered_logits: logits ",
              "must be [M, V] fp32, got ", logits_MV.sizes(), " ", logits_MV.scalar_type());
  TORCH_CHECK(temperature_M.dim() == 1 && temperature_M.size(0) == logits_MV.size(0) &&
                  temperature_M.scalar_type() == torch::kFloat32,
              "invariant_tempered_logits: temperature must be [M] = [", logits_MV.size(0), "] fp32, got ",
              temperature_M.sizes(), " ", temperature_M.scalar_type());
  torch::NoGradGuard no_grad;
  // A tensor divisor, not a scalar one: ATen may turn division by a scalar into a product with
  // its reciprocal on some devices, which rounds differently.
  auto z = logits_MV / temperature_M.to(logits_MV.device()).unsqueeze(1);  // [M, V]
  return {z, kernels::bi_logsumexp(z)};
}

torch::Tensor token_logprobs_invariant(const torch::Tensor& hidden_TD, const torch::Tensor& weight_VD,
                                       const torch::Tensor& targets_T, double temperature, int64_t chunk) {
  TORCH_CHECK(hidden_TD.dim() == 2 && weight_VD.dim() == 2 && hidden_TD.size(1) == weight_VD.size(1),
              "token_logprobs_invariant: hidden [T, D] and weight [V, D] expected, got ", hidden_TD.sizes(), " and ",
              weight_VD.sizes());
  TORCH_CHECK(targets_T.dim() == 1 && targets_T.size(0) == hidden_TD.size(0),
              "token_logprobs_invariant: targets must be [T]");
  TORCH_CHECK(chunk > 0 && temperature > 0, "token_logprobs_invariant: chunk and temperature must be > 0, got ", chunk,
              " and ", temperature);
  auto targets = targets_T.to(hidden_TD.device(), torch::kInt64);
  return invariant_forward(
      [temperature, chunk](const std::vector<torch::Tensor>& in) {
        const auto &h = in[0], &w = in[1], &tg = in[2];
        const int64_t T = h.size(0);
        auto out = torch::empty({T}, h.options().dtype(torch::kFloat32));
        for (int64_t s = 0; s < T; s += chunk) {
          const int64_t n = std::min(chunk, T - s);
          auto t = tg.narrow(0, s, n);
          auto [z, lse] = invariant_tempered_logits(
              invariant_lm_logits(h.narrow(0, s, n), w),
              torch::full({n}, float(temperature), h.options().dtype(torch::kFloat32)));
          auto lp = z.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1) - lse;  // [n]
          out.narrow(0, s, n).copy_(torch::where(t >= 0, lp, torch::zeros_like(lp)));
        }
        return out;
      },
      [temperature, chunk](const std::vector<torch::Tensor>& in) {
        const auto hidden = temperature != 1.0 ? in[0] / temperature : in[0];
        return token_logprobs(hidden, in[1], in[2], chunk);
      },
      {hidden_TD, weight_VD, targets});
}

torch::Tensor next_token_targets(const torch::Tensor& input_ids, const torch::Tensor& cu_seqlens) {
  const int64_t T = input_ids.size(0);
  auto targets = torch::full({T}, -1, input_ids.options().dtype(torch::kInt64));
  auto cu = cu_seqlens.to(torch::kCPU);
  const auto* c = cu.data_ptr<int64_t>();
  for (int64_t b = 0; b + 1 < cu.size(0); ++b) {
    const int64_t s = c[b], n = c[b + 1] - c[b];
    if (n > 1) targets.narrow(0, s, n - 1).copy_(input_ids.narrow(0, s + 1, n - 1));
  }
  return targets;
}

}  // namespace kiln::model
