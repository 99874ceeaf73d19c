#include "actors/rollout/dataset.hpp"

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "actors/rollout/math_verifier.hpp"

namespace kiln::rollout {

std::vector<PromptRecord> load_jsonl_prompts(const std::string& path, int64_t vocab_size) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("dataset '" + path + "': cannot open");
  std::vector<PromptRecord> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto where = "dataset '" + path + "' line " + std::to_string(n) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw std::invalid_argument(where + "invalid JSON: " + e.what());
    }
    if (!j.is_object()) throw std::invalid_argument(where + "expected a JSON object");
    if (!j.contains("prompt_ids") || !j["prompt_ids"].is_array() || j["prompt_ids"].empty())
      throw std::invalid_argument(where + "field 'prompt_ids' must be a non-empty list of token ids");
    PromptRecord r;
    for (const auto& id : j["prompt_ids"]) {
      if (!id.is_number_integer()) throw std::invalid_argument(where + "'prompt_ids' holds a non-integer: " + id.dump());
      int64_t v = id.get<int64_t>();
      if (v < 0 || v >= vocab_size)
        throw std::invalid_argument(where + "token id " + std::to_string(v) + " outside the vocabulary [0, " +
                                    std::to_string(vocab_size) + ")");
      r.prompt_ids.push_back(v);
    }
    if (j.contains("answer")) {
      if (!j["answer"].is_string()) throw std::invalid_argument(where + "field 'answer' must be a string");
      r.answer = j["answer"].get<std::string>();
    }
    j.erase("prompt_ids");
    j.erase("answer");
    r.extra = std::move(j);
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<TextRecord> load_jsonl_text(const std::string& path, const std::string& prompt_field,
                                        const std::string& answer_field) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::invalid_argument("dataset '" + path + "': is a directory (give a .jsonl file)");
  std::ifstream in(path);
  if (!in)
    throw std::invalid_argument("dataset '" + path + "': cannot open (looked for " +
                                std::filesystem::absolute(path, ec).string() + ")");
  std::vector<TextRecord> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto where = "dataset '" + path + "' line " + std::to_string(n) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw std::invalid_argument(where + "invalid JSON: " + e.what());
    }
    if (!j.is_object()) throw std::invalid_argument(where + "expected a JSON object, got " + std::string(j.type_name()));
    for (const auto* field : {&prompt_field, &answer_field}) {
      if (!j.contains(*field)) throw std::invalid_argument(where + "field '" + *field + "' is missing");
      if (!j[*field].is_string())
        throw std::invalid_argument(where + "field '" + *field + "' must be a string, got " +
                                    std::string(j[*field].type_name()));
    }
    TextRecord r{j[prompt_field].get<std::string>(), j[answer_field].get<std::string>(), n};
    if (r.prompt.find_first_not_of(" \t\r\n") == std::string::npos)
      throw std::invalid_argument(where + "field '" + prompt_field + "' is empty");
    if (reference_answer(r.answer).empty())
      throw std::invalid_argument(where + "field '" + answer_field + "' holds no final answer (empty, or nothing after its last '####')");
    out.push_back(std::move(r));
  }
  if (out.empty()) throw std::invalid_argument("dataset '" + path + "': holds no records (an empty file)");
  return out;
}

}  // namespace kiln::rollout
