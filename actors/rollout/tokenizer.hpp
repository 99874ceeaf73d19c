#pragma once
// Tokenizers the rollout engine and the tasks use. CharTokenizer is a character-level
// vocabulary for the built-in tasks; HfTokenizer (hf_tokenizer.hpp) a model's tokenizer.json
// with GLM's chat format; pre-tokenized JSONL datasets need no tokenizer at all.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::rollout {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// Token ids of `text`; throws std::invalid_argument naming a character it cannot encode.
  virtual std::vector<int64_t> encode(std::string_view text) const = 0;
  /// The ids the policy sees for a task's prompt text (e.g. <bos> + encode(text), or the text
  /// as a chat's user turn with the generation prompt). Throws as encode does.
  virtual std::vector<int64_t> encode_prompt(std::string_view text) const = 0;
  /// Text of `ids`; special tokens decode to nothing, ids outside the vocabulary to '?'.
  virtual std::string decode(std::span<const int64_t> ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual std::vector<int64_t> eos_ids() const = 0;
  virtual int64_t bos_id() const = 0;  ///< -1: none
  virtual int64_t pad_id() const = 0;
};

/// ids: 0 <pad>, 1 <eos>, 2 <bos>, then one id per character of the alphabet.
class CharTokenizer : public Tokenizer {
 public:
  /// The default alphabet covers the built-in tasks: digits, "+-*/=()", space, ',', ':',
  /// and lowercase letters.
  explicit CharTokenizer(std::string alphabet = kDefaultAlphabet);
  static constexpr const char* kDefaultAlphabet = "0123456789+-*/=() ,:abcdefghijklmnopqrstuvwxyz";
  std::vector<int64_t> encode(std::string_view text) const override;
  /// <bos> + encode(text).
  std::vector<int64_t> encode_prompt(std::string_view text) const override;
  std::string decode(std::span<const int64_t> ids) const override;
  int64_t vocab_size() const override { return 3 + int64_t(alphabet_.size()); }
  std::vector<int64_t> eos_ids() const override { return {1}; }
  int64_t bos_id() const override { return 2; }
  int64_t pad_id() const override { return 0; }

 private:
  std::string alphabet_;
  int64_t index_[256];
};

}  // namespace kiln::rollout
