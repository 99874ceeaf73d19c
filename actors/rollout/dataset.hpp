#pragma once
// Prompt datasets as JSONL: one JSON object per line with "prompt_ids" (token ids) and,
// optionally, "answer" (text the verifier checks against) and any other fields (kept).
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

}  // namespace kiln::rollout
