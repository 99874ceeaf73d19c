#include "actors/controller/prompts.hpp"

#include <sstream>
#include <stdexcept>

namespace kiln::controller {

namespace {
std::unique_ptr<rollout::Task> build_task(const TaskConfig& t) {
  if (t.name == "arithmetic")
    return std::make_unique<rollout::ArithmeticTask>(
        rollout::ArithmeticOptions{int(t.min_digits), int(t.max_digits), t.operators});
  return rollout::make_task(t.name);
}
}  // namespace

Prompts::Prompts(const Config& config) : c_(config), task_(build_task(config.task)), rng_(uint64_t(config.run.seed)) {}

Prompts::Draw Prompts::draw(int64_t step) {
  const auto& a = c_.algorithm;
  Draw d;
  for (int64_t p = 0; p < a.prompts_per_step; ++p) {
    d.problems.push_back(task_->sample(rng_));
    auto prompt = tokenizer_.encode(d.problems.back().prompt);
    prompt.insert(prompt.begin(), tokenizer_.bos_id());
    for (int64_t j = 0; j < a.samples_per_prompt; ++j) {
      rollout::GenerationRequest r;
      r.id = uint64_t(p * a.samples_per_prompt + j);
      r.prompt = prompt;
      r.sampling.temperature = c_.trainer.logprobs.temperature;
      r.sampling.top_p = a.top_p;
      r.sampling.top_k = a.top_k;
      r.sampling.max_new_tokens = a.max_new_tokens;
      r.sampling.stop_token_ids = tokenizer_.eos_ids();
      r.sampling.seed = uint64_t(c_.run.seed) * 1000003u + uint64_t(step) * 7919u + r.id;
      d.requests.push_back(std::move(r));
    }
  }
  d.rng_after = state();
  return d;
}

std::vector<float> Prompts::rewards(const std::vector<rollout::Problem>& problems,
                                    const std::vector<rollout::Completion>& completions) const {
  std::vector<float> out;
  for (const auto& comp : completions) {
    std::vector<int64_t> text_ids = comp.tokens;
    if (comp.finish_reason == rollout::FinishReason::stop) text_ids.pop_back();  // the stop token is no text
    const auto& problem = problems.at(comp.id / uint64_t(c_.algorithm.samples_per_prompt));
    out.push_back(float(task_->reward(problem, tokenizer_.decode(text_ids))));
  }
  return out;
}

std::string Prompts::state() const {
  std::ostringstream s;
  s << rng_;
  return s.str();
}

void Prompts::restore(const std::string& state) {
  std::istringstream s(state);
  std::mt19937_64 r;
  s >> r;
  if (!s) throw std::invalid_argument("prompt_rng is not an RNG state");
  rng_ = r;
}

}  // namespace kiln::controller
