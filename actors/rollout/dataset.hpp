#pragma once
// Prompt datasets as JSONL. Pre-tokenized: one JSON object per line with "prompt_ids" (token
// ids) and, optionally, "answer" (text the verifier checks against) and any other fields
// (kept). Text: one JSON object per line with a prompt field and an answer field (GSM8K's
// "question" and "answer"), tokenized by the run (actors/controller/prompts.hpp).
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kiln::rollout {

struct PromptRecord {
  std::vector<int64_t> prompt_ids;
  std::string answer;
  nlohmann::json extra;  ///< every other field of the line
};

/// Reads `path`. Blank lines are skipped. Throws std::invalid_argument naming the file and
/// line for invalid JSON, a missing or empty "prompt_ids", a non-integer id, or an id outside
/// [0, vocab_size).
std::vector<PromptRecord> load_jsonl_prompts(const std::string& path, int64_t vocab_size);

/// One line of a text dataset.
struct TextRecord {
  std::string prompt;     ///< the prompt field, as it is
  std::string answer;     ///< the answer field, as it is (reference_answer() takes the final answer)
  int64_t line = 0;       ///< 1-based line of the file
};

/// Reads `path`: one JSON object per line, `prompt_field` and `answer_field` strings. Blank
/// lines are skipped. Throws std::invalid_argument naming the file and line ("dataset 'f.jsonl'
/// line 3: ...") for a file that cannot be opened or holds no records, invalid JSON, a line that
/// is not an object, a missing or non-string field, an empty prompt, or an answer whose
/// reference answer (math_verifier.hpp's reference_answer) is empty.
std::vector<TextRecord> load_jsonl_text(const std::string& path, const std::string& prompt_field,
                                        const std::string& answer_field);

}  // namespace kiln::rollout
