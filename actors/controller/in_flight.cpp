#include "actors/controller/in_flight.hpp"

#include <msgpack.hpp>

#include <cmath>
#include <set>
#include <stdexcept>
#include <typeinfo>

namespace kiln::controller {

namespace {
constexpr const char* kFormat = "kiln.in_flight_rollouts";
constexpr int64_t kVersion = 1;

struct ProblemRecord {
  std::string prompt, answer;
  std::vector<int64_t> numbers;
  int64_t target = 0;
  MSGPACK_DEFINE_MAP(prompt, answer, numbers, target);
};
struct CompletionRecord {
  uint64_t id = 0;
  std::vector<int64_t> prompt, tokens;
  std::vector<float> logprobs, entropies;
  std::vector<int64_t> policy_versions;
  std::string finish_reason;
  double time_to_first_token_s = 0;
  std::vector<int64_t> routed_experts_shape;  ///< [P + n - 1, L, K], or empty
  std::vector<int32_t> routed_experts;
  std::vector<int64_t> topk_indices_shape;  ///< [P + n - 1, Ls, W], or empty (absent in older files)
  std::vector<int32_t> topk_indices;
  MSGPACK_DEFINE_MAP(id, prompt, tokens, logprobs, entropies, policy_versions, finish_reason, time_to_first_token_s,
                     routed_experts_shape, routed_experts, topk_indices_shape, topk_indices);
};

// A [rows, layers, width] id tensor as a shape and int32 values (nothing when undefined).
void put_ids(const torch::Tensor& t, std::vector<int64_t>& shape, std::vector<int32_t>& values) {
  if (!t.defined()) return;
  const auto e = t.to(torch::kInt32).contiguous();
  shape = e.sizes().vec();
  values.assign(e.data_ptr<int32_t>(), e.data_ptr<int32_t>() + e.numel());
}

// The reverse, int64; undefined for an empty shape with no values. Throws `bad(what ...)`
// naming the shape when it is not 3 dimensions >= 0, when the values do not fill it, or for
// values without a shape (they would be dropped unseen).
template <class Bad>
torch::Tensor get_ids(const std::vector<int64_t>& shape, const std::vector<int32_t>& values, const std::string& what,
                      Bad bad) {
  if (shape.empty()) {
    if (!values.empty()) throw bad(what + ": " + std::to_string(values.size()) + " ids without a shape");
    return {};
  }
  const auto named = c10::str(c10::IntArrayRef(shape));
  bool negative = false;
  int64_t numel = 1;
  for (auto d : shape) {
    negative = negative || d < 0;
    numel = negative || (d > 0 && numel > int64_t(values.size()) / d) ? -1 : numel * d;  // (no overflow)
  }
  if (shape.size() != 3 || negative)
    throw bad(what + ": the shape " + named + " is not 3 sizes >= 0");
  if (numel != int64_t(values.size()))
    throw bad(what + ": " + std::to_string(values.size()) + " ids do not fill the shape " + named);
  return torch::tensor(values).to(torch::kInt64).reshape(shape);
}
struct BatchRecord {
  int64_t step = 0;
  std::vector<ProblemRecord> problems;
  std::vector<CompletionRecord> completions;
  double rollout_time = 0;
  std::string rng_after;
  MSGPACK_DEFINE_MAP(step, problems, completions, rollout_time, rng_after);
};
struct File {
  std::string format;
  int64_t version = 0;
  std::vector<BatchRecord> batches;
  MSGPACK_DEFINE_MAP(format, version, batches);
};
}  // namespace

std::string encode_in_flight(const std::vector<Batch>& batches) {
  if (batches.empty()) return {};
  File f{kFormat, kVersion, {}};
  for (const auto& b : batches) {
    BatchRecord r{b.step, {}, {}, b.rollout_time, b.rng_after};
    for (const auto& p : b.problems) r.problems.push_back({p.prompt, p.answer, p.numbers, p.target});
    for (const auto& c : b.completions) {
      CompletionRecord x{c.id, c.prompt, c.tokens, c.logprobs, c.entropies, c.policy_versions,
                         rollout::to_string(c.finish_reason), c.time_to_first_token_s, {}, {}, {}, {}};
      put_ids(c.routed_experts, x.routed_experts_shape, x.routed_experts);
      put_ids(c.topk_indices, x.topk_indices_shape, x.topk_indices);
      r.completions.push_back(std::move(x));
    }
    f.batches.push_back(std::move(r));
  }
  msgpack::sbuffer out;
  msgpack::pack(out, f);
  return {out.data(), out.size()};
}

std::vector<Batch> decode_in_flight(const std::string& bytes, int64_t after_step, const std::string& source) {
  auto bad = [&](const std::string& what) { return std::invalid_argument(source + ": " + what); };
  File f;
  try {
    auto h = msgpack::unpack(bytes.data(), bytes.size());
    h.get().convert(f);
  } catch (const std::bad_cast&) {
    throw bad("not a readable in-flight rollouts file (a field holds a value of another type)");
  } catch (const std::exception& e) {
    throw bad(std::string("not a readable in-flight rollouts file (") + e.what() + ")");
  }
  if (f.format != kFormat || f.version != kVersion)
    throw bad("format '" + f.format + "' version " + std::to_string(f.version) + ", expected '" + kFormat +
              "' version " + std::to_string(kVersion));
  if (f.batches.empty()) throw bad("holds no batch (kiln writes this file only with rollouts in flight)");
  std::vector<Batch> out;
  for (auto& r : f.batches) {
    const int64_t want = after_step + 1 + int64_t(out.size());
    if (r.step != want)
      throw bad("holds a batch for step " + std::to_string(r.step) + " where step " + std::to_string(want) +
                " comes next (the checkpoint is of step " + std::to_string(after_step) + ")");
    if (!std::isfinite(r.rollout_time) || r.rollout_time < 0)
      throw bad("step " + std::to_string(r.step) + ": rollout_time " + std::to_string(r.rollout_time) +
                " is not a duration (finite, >= 0)");
    std::set<uint64_t> ids;
    Batch b{r.step, {}, {}, r.rollout_time, std::move(r.rng_after)};
    for (auto& p : r.problems) b.problems.push_back({std::move(p.prompt), std::move(p.answer), std::move(p.numbers), p.target});
    for (auto& x : r.completions) {
      const std::string where = "step " + std::to_string(r.step) + " completion " + std::to_string(x.id);
      const auto n = x.tokens.size();
      if (!ids.insert(x.id).second) throw bad(where + ": a second completion with this id");
      if (n == 0) throw bad(where + ": no tokens (a completion holds at least the one it ended with)");
      if (!std::isfinite(x.time_to_first_token_s) || x.time_to_first_token_s < 0)
        throw bad(where + ": time_to_first_token_s " + std::to_string(x.time_to_first_token_s) +
                  " is not a duration (finite, >= 0)");
      if (x.logprobs.size() != n || x.entropies.size() != n || x.policy_versions.size() != n)
        throw bad(where + ": " + std::to_string(n) + " tokens but " + std::to_string(x.logprobs.size()) +
                  " log-probs, " + std::to_string(x.entropies.size()) + " entropies and " +
                  std::to_string(x.policy_versions.size()) + " policy versions");
      if (x.finish_reason != "stop" && x.finish_reason != "length")
        throw bad(where + ": finish_reason '" + x.finish_reason + "' (\"stop\" or \"length\")");
      // What the loss would read: a NaN behaviour log-prob turns the step's KL and ratios into NaN.
      for (std::size_t i = 0; i < n; ++i) {
        if (!std::isfinite(x.logprobs[i]) || x.logprobs[i] > 0)
          throw bad(where + ": log-prob " + std::to_string(x.logprobs[i]) + " of token " + std::to_string(i) +
                    " is not a log-probability (finite, <= 0)");
        if (!std::isfinite(x.entropies[i]) || x.entropies[i] < 0)
          throw bad(where + ": entropy " + std::to_string(x.entropies[i]) + " of token " + std::to_string(i) +
                    " is not finite and >= 0");
      }
      rollout::Completion c;
      c.id = x.id;
      c.prompt = std::move(x.prompt);
      c.tokens = std::move(x.tokens);
      c.logprobs = std::move(x.logprobs);
      c.entropies = std::move(x.entropies);
      c.policy_versions = std::move(x.policy_versions);
      c.finish_reason = x.finish_reason == "stop" ? rollout::FinishReason::stop : rollout::FinishReason::length;
      c.time_to_first_token_s = x.time_to_first_token_s;
      const auto rows = int64_t(c.prompt.size() + c.tokens.size()) - 1;  // every token but the last
      // min_id: expert ids are >= 0; sparse-attention selections may hold -1 (no key).
      auto ids = [&](const std::vector<int64_t>& shape, const std::vector<int32_t>& values, const std::string& what,
                     const std::string& id, int64_t min_id) {
        auto t = get_ids(shape, values, where + ": " + what, bad);
        if (t.defined() && t.size(0) != rows)
          throw bad(where + ": " + what + " has " + std::to_string(t.size(0)) + " rows for " + std::to_string(rows) +
                    " tokens (prompt + completion - 1)");
        if (t.defined() && t.numel() > 0)
          if (const auto least = t.min().item<int64_t>(); least < min_id)
            throw bad(where + ": " + what + " holds the " + id + " " + std::to_string(least));
        return t;
      };
      c.routed_experts = ids(x.routed_experts_shape, x.routed_experts, "routed experts [P + n - 1, L, K]", "expert id", 0);
      c.topk_indices = ids(x.topk_indices_shape, x.topk_indices, "topk indices [P + n - 1, Ls, W]", "id", -1);
      b.completions.push_back(std::move(c));
    }
    if (b.problems.empty() || b.completions.size() % b.problems.size() != 0)
      throw bad("step " + std::to_string(r.step) + ": " + std::to_string(b.completions.size()) + " completions for " +
                std::to_string(b.problems.size()) + " problems (a whole group of samples per problem)");
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace kiln::controller
