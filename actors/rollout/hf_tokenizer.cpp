#include "actors/rollout/hf_tokenizer.hpp"

#include <stdexcept>

namespace kiln::rollout {

HfTokenizer::HfTokenizer(BpeTokenizer tokenizer, std::optional<ChatFormat> chat)
    : tokenizer_(std::move(tokenizer)), chat_(chat) {
  for (const char* end : {"<|endoftext|>", "<|user|>", "<|observation|>"})
    if (const int64_t id = tokenizer_.token_to_id(end); id >= 0) eos_ids_.push_back(id);
  if (eos_ids_.empty())
    throw std::invalid_argument(
        "the tokenizer has none of GLM's end tokens <|endoftext|>, <|user|>, <|observation|> (generation stops at them)");
  known_.assign(std::size_t(tokenizer_.vocab_size()), false);
  for (int64_t id = 0; id < tokenizer_.vocab_size(); ++id) {
    try {
      tokenizer_.id_to_token(id);
      known_[std::size_t(id)] = true;
    } catch (const std::out_of_range&) {  // a gap in the ids: decoded as '?'
    }
  }
  if (chat_) encode_prompt("x");  // a marker the tokenizer lacks is named now, not at the first step
}

std::vector<int64_t> HfTokenizer::encode(std::string_view text) const { return tokenizer_.encode(text); }

std::vector<int64_t> HfTokenizer::encode_prompt(std::string_view text) const {
  if (!chat_) return tokenizer_.encode(text, /*add_special_tokens=*/true);
  const ChatMessage user{"user", std::string(text)};
  return encode_chat(tokenizer_, std::span(&user, 1), {.format = *chat_, .add_generation_prompt = true});
}

std::string HfTokenizer::decode(std::span<const int64_t> ids) const {
  std::string out;
  std::size_t run = 0;  // start of the current run of known ids
  for (std::size_t i = 0; i <= ids.size(); ++i) {
    const bool known = i < ids.size() && ids[i] >= 0 && ids[i] < int64_t(known_.size()) && known_[std::size_t(ids[i])];
    if (known) continue;
    if (i > run) out += tokenizer_.decode(ids.subspan(run, i - run), /*skip_special_tokens=*/true);
    if (i < ids.size()) out += '?';
    run = i + 1;
  }
  return out;
}

std::optional<ChatFormat> chat_format_from_string(const std::string& name) {
  if (name == "glm47") return ChatFormat::glm47;
  if (name == "glm4") return ChatFormat::glm4;
  if (name == "none") return std::nullopt;
  throw std::invalid_argument("chat template '" + name + "' is not one of \"glm47\", \"glm4\", \"none\"");
}

}  // namespace kiln::rollout
