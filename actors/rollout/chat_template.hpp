#pragma once
// GLM's chat format in C++: what the model's Jinja chat template renders for plain
// system / user / assistant turns (no tools, no images), and the ids of that text. The
// renderings, and which published template each follows, are in docs/tokenizer.md.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "actors/rollout/bpe_tokenizer.hpp"

namespace kiln::rollout {

/// One turn. role: "system", "user" or "assistant".
struct ChatMessage {
  std::string role;
  std::string content;
};

enum class ChatFormat {
  /// GLM-4.7 / GLM-4.7-Flash (zai-org chat_template.jinja): `[gMASK]<sop>`, then per turn
  /// `<|system|>S`, `<|user|>U`, `<|assistant|>` + (`<think>R</think>` for reasoning R of a turn
  /// after the last user turn, else `</think>`) + the answer stripped; the generation prompt is
  /// `<|assistant|><think>` (`<|assistant|></think>` with thinking off).
  glm47,
  /// GLM-4 (THUDM/glm-4-9b-chat tokenizer_config.json): `[gMASK]<sop>`, then per turn with
  /// non-empty content `<|role|>\n` + content; the generation prompt is `<|assistant|>\n`.
  glm4,
};

struct ChatOptions {
  ChatFormat format = ChatFormat::glm47;
  bool add_generation_prompt = true;
  bool enable_thinking = true;  ///< glm47 only: false ends the prompt with `</think>`
  /// glm47 only: false keeps the reasoning of every assistant turn, not just of those after the
  /// last user turn (the template's `clear_thinking` variable set to false).
  bool clear_thinking = true;
};

/// The text the template renders. Throws std::invalid_argument naming the index and role of a
/// message whose role is not system, user or assistant.
std::string render_chat(std::span<const ChatMessage> messages, const ChatOptions& options = {});

/// The ids of render_chat's text through `tokenizer`: the role markers and `[gMASK]<sop>` come
/// out as single ids when the tokenizer has them as added tokens. Throws std::invalid_argument
/// naming a marker (e.g. "<|user|>") the tokenizer does not have as one token.
std::vector<int64_t> encode_chat(const BpeTokenizer& tokenizer, std::span<const ChatMessage> messages,
                                 const ChatOptions& options = {});

}  // namespace kiln::rollout
