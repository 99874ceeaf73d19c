#include "actors/rollout/chat_template.hpp"

#include <cstdint>
#include <stdexcept>
#include <string_view>

#include "actors/rollout/byte_level.hpp"

namespace kiln::rollout {

namespace {

// Python's str.strip() as the template calls it: removes the characters str.isspace() holds
// (Python 3.11: \t-\r, \x1c-\x1f, space, U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029,
// U+202F, U+205F, U+3000) from both ends.
bool python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}
// The code point of the valid UTF-8 sequence s[i, i + len).
uint32_t code_point(std::string_view s, std::size_t i, std::size_t len) {
  uint32_t cp = static_cast<unsigned char>(s[i]);
  if (len == 1) return cp;
  cp &= 0xFFu >> (len + 1);
  for (std::size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}
std::string_view strip(std::string_view s) {
  // Leading: walk forward. Trailing: the last non-space character's end. Invalid UTF-8 bytes
  // count as non-space (the text came from the caller; the tokenizer refuses it later).
  std::size_t begin = s.size(), end = 0;
  for (std::size_t i = 0; i < s.size();) {
    auto step = byte_level::utf8_step(s, i);
    bool space = step.valid && python_space(code_point(s, i, step.length));
    if (!space) {
      if (begin == s.size()) begin = i;
      end = i + step.length;
    }
    i += step.length;
  }
  return begin == s.size() ? std::string_view{} : s.substr(begin, end - begin);
}
std::string_view rstrip_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}
std::string_view lstrip_newlines(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}

// GLM-4.7's assistant turn: reasoning is either absent or the text between <think> and the
// first </think>; only turns after the last user turn keep it.
void render_glm47_assistant(std::string& out, std::string_view content, bool keep_reasoning) {
  std::string_view reasoning;
  if (auto end = content.find("</think>"); end != std::string_view::npos) {
    std::string_view before = rstrip_newlines(content.substr(0, end));
    auto open = before.rfind("<think>");
    reasoning = lstrip_newlines(open == std::string_view::npos ? before : before.substr(open + 7));
    content = lstrip_newlines(content.substr(content.rfind("</think>") + 8));
  }
  out += "<|assistant|>";
  if (keep_reasoning && !reasoning.empty()) {
    out += "<think>";
    out += strip(reasoning);
    out += "</think>";
  } else {
    out += "</think>";
  }
  out += strip(content);
}

}  // namespace

std::string render_chat(std::span<const ChatMessage> messages, const ChatOptions& options) {
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant")
      throw std::invalid_argument("render_chat: message " + std::to_string(i) + " has role \"" + r +
                                  "\"; kiln's GLM chat format knows system, user and assistant");
  }
  std::string out = "[gMASK]<sop>";
  if (options.format == ChatFormat::glm4) {
    for (const auto& m : messages)
      if (!m.content.empty()) out += "<|" + m.role + "|>\n" + m.content;
    if (options.add_generation_prompt) out += "<|assistant|>\n";
    return out;
  }
  std::ptrdiff_t last_user = -1;
  for (std::size_t i = 0; i < messages.size(); ++i)
    if (messages[i].role == "user") last_user = std::ptrdiff_t(i);
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (m.role == "assistant") render_glm47_assistant(out, m.content, !options.clear_thinking || std::ptrdiff_t(i) > last_user);
    else out += "<|" + m.role + "|>" + m.content;
  }
  if (options.add_generation_prompt) out += options.enable_thinking ? "<|assistant|><think>" : "<|assistant|></think>";
  return out;
}

std::vector<int64_t> encode_chat(const BpeTokenizer& tokenizer, std::span<const ChatMessage> messages, const ChatOptions& options) {
  for (std::string_view marker : {"[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"}) {
    bool added = false;
    for (const auto& a : tokenizer.added_tokens()) added = added || a.content == marker;
    if (!added)
      throw std::invalid_argument("encode_chat: the tokenizer has no added token \"" + std::string(marker) +
                                  "\": not a GLM tokenizer, the chat format would not give its ids");
  }
  return tokenizer.encode(render_chat(messages, options));
}

}  // namespace kiln::rollout
