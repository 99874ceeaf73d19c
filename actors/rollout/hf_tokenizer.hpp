#pragma once
// A model's tokenizer.json (bpe_tokenizer.hpp) as the RL loop's Tokenizer: prompts formatted
// with GLM's chat template (chat_template.hpp) or encoded as plain text, completions decoded
// with special tokens left out, and GLM's end tokens as stop tokens. Torch-free.
#include <optional>
#include <vector>

#include "actors/rollout/bpe_tokenizer.hpp"
#include "actors/rollout/chat_template.hpp"
#include "actors/rollout/tokenizer.hpp"

namespace kiln::rollout {

class HfTokenizer : public Tokenizer {
 public:
  /// `chat`: the format of prompts; nullopt for none (a prompt is the text with the
  /// post-processor's special tokens, e.g. `[gMASK]<sop>` + text, as HF's encode does). Throws
  /// std::invalid_argument when the tokenizer has none of GLM's end tokens (`<|endoftext|>`,
  /// `<|user|>`, `<|observation|>`), or, with a chat format, lacks one of its markers as a
  /// single token (encode_chat's error, naming it).
  HfTokenizer(BpeTokenizer tokenizer, std::optional<ChatFormat> chat);

  /// The text's ids, no special tokens added.
  std::vector<int64_t> encode(std::string_view text) const override;
  /// With a chat format: `text` as the one user turn, then the generation prompt
  /// (`[gMASK]<sop><|user|>text<|assistant|><think>` for glm47). Without: encode(text, true).
  std::vector<int64_t> encode_prompt(std::string_view text) const override;
  /// Text of `ids` with special tokens left out; an id that is no token (a model vocabulary
  /// padded past the tokenizer's) decodes to '?'.
  std::string decode(std::span<const int64_t> ids) const override;
  int64_t vocab_size() const override { return tokenizer_.vocab_size(); }
  /// The ids of `<|endoftext|>`, `<|user|>` and `<|observation|>` the tokenizer has: the
  /// eos_token_id list of GLM-4's and GLM-4.7's generation_config.json.
  std::vector<int64_t> eos_ids() const override { return eos_ids_; }
  int64_t bos_id() const override { return -1; }  ///< none: GLM's prompts start with [gMASK]<sop>
  int64_t pad_id() const override { return eos_ids_.front(); }
  const BpeTokenizer& bpe() const { return tokenizer_; }

 private:
  BpeTokenizer tokenizer_;
  std::optional<ChatFormat> chat_;
  std::vector<int64_t> eos_ids_;
  std::vector<bool> known_;  ///< [vocab_size]: whether the id is a token
};

/// "glm47" | "glm4" -> the format, "none" -> nullopt; throws std::invalid_argument naming the
/// value and the choices.
std::optional<ChatFormat> chat_format_from_string(const std::string& name);

}  // namespace kiln::rollout
