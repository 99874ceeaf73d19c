#include "model/glm5_next/hyper_connection.hpp"

#include <stdexcept>
#include <string>

namespace kiln::model::glm5_next {

torch::Tensor sinkhorn(const torch::Tensor& logits, int64_t iters, double eps) {
  if (iters < 1) throw std::invalid_argument("sinkhorn: iters must be >= 1, got " + std::to_string(iters));
  auto m = torch::softmax(logits, -1) + eps;  // [..., S, S] positive
  m = m / (m.sum(-2, true) + eps);
  for (int64_t i = 1; i < iters; ++i) {
    m = m / (m.sum(-1, true) + eps);  // rows
    m = m / (m.sum(-2, true) + eps);  // columns
  }
  return m;
}

HyperConnectionImpl::HyperConnectionImpl(int64_t hidden, const HyperConnectionConfig& c, double rms_norm_eps)
    : c_(c), rms_eps_(rms_norm_eps) {
  const int64_t S = c.streams;
  // Init as transformers' _init_weights: fn ~ N(0, 0.02), base 0, scale 1.
  fn = register_parameter("fn", torch::randn({(2 + S) * S, S * hidden}) * 0.02);
  base = register_parameter("base", torch::zeros({(2 + S) * S}));
  scale = register_parameter("scale", torch::ones({3}));
}

HcWeights HyperConnectionImpl::forward(const torch::Tensor& streams) {
  const int64_t T = streams.size(0), S = c_.streams;
  TORCH_CHECK(streams.dim() == 3 && streams.size(1) == S, "HyperConnection: streams must be [T, ", S, ", D], got ",
              streams.sizes());
  const auto md = streams.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto flat = streams.flatten(1).to(md);                                          // [T, S*D]
  flat = flat * torch::rsqrt(flat.pow(2).mean(-1, true) + rms_eps_);             // unweighted RMSNorm
  auto mix = torch::nn::functional::linear(flat, fn.to(md));                      // [T, (2+S)*S]
  auto parts = mix.split_with_sizes({S, S, S * S}, -1);
  auto b = base.to(md).split_with_sizes({S, S, S * S});
  auto sc = scale.to(md);
  auto pre = torch::sigmoid(parts[0] * sc[0] + b[0]) + c_.eps;                    // [T, S]
  auto post = 2 * torch::sigmoid(parts[1] * sc[1] + b[1]);                        // [T, S]
  auto comb = sinkhorn(parts[2].view({T, S, S}) * sc[2] + b[2].view({S, S}), c_.sinkhorn_iters, c_.eps);  // [T, S, S]
  auto collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.scalar_type());  // [T, D]
  return {post, comb, collapsed};
}

torch::Tensor HyperConnectionImpl::expand(const HcWeights& w, const torch::Tensor& block_out, const torch::Tensor& streams) {
  const auto dt = streams.scalar_type();
  // [T, S, 1] * [T, 1, D] + [T, S, S]^T @ [T, S, D] -> [T, S, D]
  return w.post.to(dt).unsqueeze(-1) * block_out.unsqueeze(-2) + torch::matmul(w.comb.to(dt).transpose(-1, -2), streams);
}

torch::Tensor hc_streams_from_embeddings(const torch::Tensor& x, int64_t streams) {
  return x.unsqueeze(1).expand({x.size(0), streams, x.size(1)}).contiguous();  // [T, S, D]
}

torch::Tensor hc_head(const torch::Tensor& streams) { return streams.mean(1); }

}  // namespace kiln::model::glm5_next
