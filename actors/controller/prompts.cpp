#include "actors/controller/prompts.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "actors/rollout/dataset.hpp"
#include "actors/rollout/hf_tokenizer.hpp"

namespace kiln::controller {

namespace {
std::unique_ptr<rollout::Task> build_task(const TaskConfig& t, std::vector<rollout::TextRecord> records) {
  if (t.name == "arithmetic")
    return std::make_unique<rollout::ArithmeticTask>(
        rollout::ArithmeticOptions{int(t.min_digits), int(t.max_digits), t.operators});
  if (t.name == "jsonl") return std::make_unique<rollout::JsonlTask>(std::move(records));
  return rollout::make_task(t.name);
}

// The character tokenizer's default alphabet, then every other character of the prompts in
// byte order: the ids depend on the dataset's characters only, not on its order. A byte
// outside printable ASCII (but tab and newline) is refused: that needs a real tokenizer.
std::string char_alphabet(const std::vector<rollout::TextRecord>& records, const std::string& path) {
  std::string alphabet = rollout::CharTokenizer::kDefaultAlphabet;
  bool seen[256] = {};
  for (const auto& r : records)
    for (char ch : r.prompt) {
      const auto c = static_cast<unsigned char>(ch);
      if ((c < 0x20 && c != '\t' && c != '\n') || c >= 0x7f) {
        char code[8];
        std::snprintf(code, sizeof code, "0x%02X", c);
        throw std::invalid_argument("task.path: dataset '" + path + "' line " + std::to_string(r.line) + ": byte " +
                                    code + " is not printable ASCII, which the character tokenizer cannot encode; set "
                                    "task.tokenizer to the model's tokenizer.json");
      }
      seen[c] = true;
    }
  for (int c = 0; c < 256; ++c)
    if (seen[c] && alphabet.find(char(c)) == std::string::npos) alphabet += char(c);
  return alphabet;
}

std::unique_ptr<rollout::Tokenizer> build_tokenizer(const TaskConfig& t, const std::vector<rollout::TextRecord>& records) {
  if (t.tokenizer.empty()) return std::make_unique<rollout::CharTokenizer>(char_alphabet(records, t.path));
  const auto where = "task.tokenizer '" + t.tokenizer + "': ";
  try {
    return std::make_unique<rollout::HfTokenizer>(rollout::BpeTokenizer::from_file(t.tokenizer),
                                                  rollout::chat_format_from_string(t.chat_template));
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + e.what());
  }
}

std::vector<rollout::TextRecord> load_records(const TaskConfig& t) {
  if (t.name != "jsonl") return {};
  try {
    return rollout::load_jsonl_text(t.path, t.prompt_field, t.answer_field);
  } catch (const std::exception& e) {
    throw std::invalid_argument("task.path: " + std::string(e.what()));
  }
}
}  // namespace

Prompts::Prompts(const Config& config) : c_(config), rng_(uint64_t(config.run.seed)) {
  auto records = load_records(c_.task);
  tokenizer_ = build_tokenizer(c_.task, records);
  // Every prompt encodes and fits the engine's cache with its completion (a bad one is named
  // now, before the run directory changes, not at its step).
  const int64_t cache_tokens = c_.rollout.engine.cache_blocks * c_.rollout.engine.block_size;
  for (const auto& r : records) {
    std::size_t tokens = 0;
    try {
      tokens = tokenizer_->encode_prompt(r.prompt).size();
    } catch (const std::exception& e) {
      throw std::invalid_argument("task.path: dataset '" + c_.task.path + "' line " + std::to_string(r.line) + ": " +
                                  tokenizer_source() + " cannot encode the prompt: " + e.what());
    }
    if (int64_t(tokens) + c_.algorithm.max_new_tokens > cache_tokens)
      throw std::invalid_argument("task.path: dataset '" + c_.task.path + "' line " + std::to_string(r.line) +
                                  ": the prompt is " + std::to_string(tokens) + " tokens; with algorithm.max_new_tokens " +
                                  std::to_string(c_.algorithm.max_new_tokens) + " it does not fit the engine's cache of " +
                                  std::to_string(cache_tokens) + " tokens (rollout.cache_blocks x rollout.block_size)");
  }
  const bool built_in = records.empty();
  task_ = build_task(c_.task, std::move(records));
  if (built_in) {  // the task's longest prompt (exact for the character tokenizer)
    const auto longest = task_->longest_prompt();
    const auto tokens = int64_t(tokenizer_->encode_prompt(longest).size());
    if (tokens + c_.algorithm.max_new_tokens > cache_tokens)
      throw std::invalid_argument("algorithm.max_new_tokens: task '" + task_->name() + "' draws prompts of up to " +
                                  std::to_string(tokens) + " tokens (e.g. \"" + longest + "\"); with " +
                                  std::to_string(c_.algorithm.max_new_tokens) + " new tokens they do not fit the " +
                                  "engine's cache of " + std::to_string(cache_tokens) +
                                  " tokens (rollout.cache_blocks x rollout.block_size): " +
                                  (cache_tokens - tokens >= 1 ? "at most " + std::to_string(cache_tokens - tokens) +
                                                                    " new tokens"
                                                              : "a larger cache is needed for even one new token"));
  }
}

std::string Prompts::tokenizer_source() const {
  return c_.task.tokenizer.empty() ? "the character tokenizer" : "task.tokenizer '" + c_.task.tokenizer + "'";
}

Prompts::Draw Prompts::draw(int64_t step) {
  const auto& a = c_.algorithm;
  Draw d;
  for (int64_t p = 0; p < a.prompts_per_step; ++p) {
    d.problems.push_back(task_->sample(rng_));
    const auto prompt = tokenizer_->encode_prompt(d.problems.back().prompt);
    for (int64_t j = 0; j < a.samples_per_prompt; ++j) {
      rollout::GenerationRequest r;
      r.id = uint64_t(p * a.samples_per_prompt + j);
      r.prompt = prompt;
      r.sampling.temperature = c_.trainer.logprobs.temperature;
      r.sampling.top_p = a.top_p;
      r.sampling.top_k = a.top_k;
      r.sampling.max_new_tokens = a.max_new_tokens;
      r.sampling.stop_token_ids = tokenizer_->eos_ids();
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
    out.push_back(float(task_->reward(problem, tokenizer_->decode(text_ids))));
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
