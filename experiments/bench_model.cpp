#include "experiments/bench_model.hpp"
#include "messaging/stopwatch.hpp"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "model/blocks/logprobs.hpp"
#include "model/glm4_moe_lite/model.hpp"

namespace kiln::experiments {

namespace {

template <class F>
double best_seconds(int repeats, F fn) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const messaging::Stopwatch t0;
    fn();
    best = std::min(best, t0.seconds());
  }
  return best;
}

}  // namespace

double glm4_forward_flops(const model::glm4_moe_lite::Glm4MoeLiteConfig& c, int64_t docs, int64_t n) {
  const auto& a = c.attention;
  const double T = double(docs * n), D = double(c.hidden_size);
  double per_token = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    double attn = a.q_lora_rank ? D * *a.q_lora_rank + double(*a.q_lora_rank) * a.num_heads * a.qk_head_dim()
                                : D * a.num_heads * a.qk_head_dim();
    attn += D * (a.kv_lora_rank + a.qk_rope_head_dim) + double(a.kv_lora_rank) * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) +
            double(a.num_heads) * a.v_head_dim * D;
    double mlp = c.moe_layers[l] ? 3.0 * D * c.moe.expert_intermediate_size * (c.moe.top_k + c.moe.n_shared_experts) +
                                       D * c.moe.num_experts
                                 : 3.0 * D * c.intermediate_size;
    per_token += attn + mlp;
  }
  per_token += D * c.vocab_size;  // lm_head
  // causal attention: scores and weighted values, half of n^2 pairs per head
  double attn_pairs = double(docs) * n * n / 2.0 * c.num_hidden_layers * a.num_heads * (a.qk_head_dim() + a.v_head_dim);
  return 2.0 * (per_token * T + attn_pairs);
}

int run_model_bench(const ModelBenchOptions& o) {
  torch::manual_seed(0);
  std::printf("kiln bench model (CPU, %d threads, best of %d)\n\n", torch::get_num_threads(), o.repeats);

  // 1. log-probs at V = 154880
  {
    torch::AutoGradMode grad_on(true);
    const int64_t T = o.logprob_tokens, D = 2048, V = 154880;
    auto hidden = torch::randn({T, D}).mul_(0.05).requires_grad_();
    auto weight = torch::randn({V, D}).mul_(0.02).requires_grad_();
    auto targets = torch::randint(0, V, {T}, torch::kInt64);
    double full = best_seconds(o.repeats, [&] {
      auto lp = torch::log_softmax(torch::mm(hidden, weight.t()).to(torch::kFloat32), -1).gather(1, targets.unsqueeze(1));
      lp.sum().backward();
    });
    double chunked = best_seconds(o.repeats, [&] { model::token_logprobs(hidden, weight, targets, o.logprob_chunk).sum().backward(); });
    auto mib = [](double bytes) { return bytes / (1 << 20); };
    std::printf("log-probs, T=%lld D=%lld V=%lld, forward+backward\n", (long long)T, (long long)D, (long long)V);
    std::printf("  %-34s %10s %22s\n", "path", "seconds", "largest fp32 [*, V] MiB");
    std::printf("  %-34s %10.3f %22.1f\n", "full log_softmax (transformers way)", full, mib(4.0 * T * V));
    std::printf("  %-34s %10.3f %22.1f\n", ("kiln chunked, chunk " + std::to_string(o.logprob_chunk)).c_str(), chunked,
                mib(4.0 * o.logprob_chunk * V));
    std::printf("  kiln/full time: %.2fx, memory: %.1fx less\n\n", chunked / full, double(T) / o.logprob_chunk);
  }

  // 2. forward + backward of a CPU-sized model vs the machine's GEMM rate
  {
    torch::AutoGradMode grad_on(true);
    auto c = model::glm4_moe_lite::flavors::debug();
    c.vocab_size = 8192;
    c.hidden_size = 512;
    c.intermediate_size = 1024;
    c.num_hidden_layers = 4;
    c.moe_layers = {false, true, true, true};
    c.attention = {8, 192, 128, 64, 32, 64, 10000.0, true};
    c.moe = {16, 4, 1, 1, 256, 1, true, 1.8};
    c.validate();
    model::glm4_moe_lite::Glm4MoeLiteModel m(c);
    const int64_t docs = 4, n = o.train_tokens / docs;
    std::vector<std::vector<int64_t>> d(docs);
    for (auto& doc : d)
      for (int64_t i = 0; i < n; ++i) doc.push_back((i * 7919 + 13) % c.vocab_size);
    auto batch = model::PackedBatch::from_documents(d);
    auto targets = model::next_token_targets(batch.input_ids, batch.cu_seqlens);
    double step = best_seconds(o.repeats, [&] {
      m.zero_grad();
      auto out = m.forward(batch);
      (-m.token_logprobs(out, targets, 512).sum()).backward();
    });
    double flops = 3.0 * glm4_forward_flops(c, docs, n);  // backward ~ 2x forward
    auto a = torch::randn({2048, 2048}), b = torch::randn({2048, 2048});
    double gemm = best_seconds(o.repeats, [&] { auto r = torch::mm(a, b); (void)r.data_ptr(); });
    double peak = 2.0 * 2048 * 2048 * 2048 / gemm;
    std::printf("glm4_moe_lite forward+backward, %lld packed tokens (%lld docs), hidden %lld, %lld layers, %lld experts top-%lld\n",
                (long long)(docs * n), (long long)docs, (long long)c.hidden_size, (long long)c.num_hidden_layers,
                (long long)c.moe.num_experts, (long long)c.moe.top_k);
    std::printf("  %-34s %12s %12s\n", "", "tokens/s", "GFLOP/s");
    std::printf("  %-34s %12.0f %12.1f\n", "kiln step", double(docs * n) / step, flops / step / 1e9);
    std::printf("  %-34s %12s %12.1f\n", "fp32 GEMM 2048^3 (machine limit)", "-", peak / 1e9);
    std::printf("  model FLOP utilisation: %.0f%% of the measured GEMM rate\n", 100.0 * flops / step / peak);

    // 3. An RL step's output head: the second half of each document is the completion. kiln's
    //    trainer runs the head on those rows only; verl's actor (its remove-padding path) computes
    //    every token's logits and then keeps the response's (the 'all rows' line).
    std::vector<int64_t> completion;
    for (int64_t b = 0; b < docs; ++b)
      for (int64_t i = n / 2; i < n - 1; ++i) completion.push_back(b * n + i);
    auto rows = torch::tensor(completion, torch::kInt64);
    double all_rows = best_seconds(o.repeats, [&] {
      m.zero_grad();
      (-m.token_logprobs(m.forward(batch), targets, 512).index_select(0, rows).sum()).backward();
    });
    double only = best_seconds(o.repeats, [&] {
      m.zero_grad();
      (-m.token_logprobs(m.forward(batch), targets, 512, 1.0, rows).sum()).backward();
    });
    const double head = 3.0 * 2.0 * double(c.hidden_size) * double(c.vocab_size);  // per row, forward+backward
    const double saved = head * double(docs * n - rows.size(0)) / flops;
    std::printf("\nRL step (the same pack, %lld of %lld tokens are completions), forward+backward\n",
                (long long)rows.size(0), (long long)(docs * n));
    std::printf("  %-34s %10s\n", "output head on", "seconds");
    std::printf("  %-34s %10.3f\n", "all rows, completions kept", all_rows);
    std::printf("  %-34s %10.3f\n", "completion rows only (kiln)", only);
    std::printf("  time saved: %.0f%% (the head's FLOPs on the prompt rows: %.0f%% of the step's)\n",
                100.0 * (1.0 - only / all_rows), 100.0 * saved);
  }
  return 0;
}

}  // namespace kiln::experiments
