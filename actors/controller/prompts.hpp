#pragma once
// The run's task: prompts drawn from it for each step (as generation requests, n per prompt,
// each with its own sampling seed) and the verifier's rewards for the completions. The
// prompt RNG's state is part of a checkpoint, so that a resumed run draws the same prompts.
// The task's tokenizer (task.tokenizer: a tokenizer.json with task.chat_template, else the
// character tokenizer) turns prompt text into ids and completions back into text.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "actors/controller/config.hpp"
#include "actors/rollout/backend.hpp"
#include "actors/rollout/tasks.hpp"
#include "actors/rollout/tokenizer.hpp"

namespace kiln::controller {

class Prompts {
 public:
  /// Builds the task and its tokenizer. Throws std::invalid_argument for an unknown task, and,
  /// naming the key (task.path, task.tokenizer) and the file (and line), for a dataset or a
  /// tokenizer.json that cannot be read or used, or a dataset prompt the tokenizer cannot
  /// encode.
  Prompts(const Config& config);
  struct Draw {
    std::vector<rollout::Problem> problems;             ///< [prompts_per_step]
    std::vector<rollout::GenerationRequest> requests;  ///< id = prompt * n + sample, n per prompt
    std::string rng_after;                              ///< the prompt RNG's state after this draw
  };
  /// The prompts of `step`: seeds depend on (run.seed, step, id) only.
  Draw draw(int64_t step);
  /// The verifier's reward of each completion (completions[i].id names its prompt).
  std::vector<float> rewards(const std::vector<rollout::Problem>& problems,
                             const std::vector<rollout::Completion>& completions) const;
  /// The prompt RNG's state (std::mt19937_64 text form), and back; restore throws
  /// std::invalid_argument for text that is not such a state.
  std::string state() const;
  void restore(const std::string& state);
  int64_t vocab_size() const { return tokenizer_->vocab_size(); }
  /// "task.tokenizer 'PATH'" or "the character tokenizer" (for messages).
  std::string tokenizer_source() const;

 private:
  const Config& c_;
  std::unique_ptr<rollout::Task> task_;
  std::unique_ptr<rollout::Tokenizer> tokenizer_;
  std::mt19937_64 rng_;
};

}  // namespace kiln::controller
