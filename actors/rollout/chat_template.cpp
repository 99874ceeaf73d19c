#include "actors/rollout/chat_template.hpp"

#include <stdexcept>
#include <string_view>

namespace kiln::rollout {

namespace {

// Python's str.strip() / rstrip('\n') / lstrip('\n') as the template calls them. strip() here
// removes ASCII whitespace only (Python's also removes Unicode spaces such as U+3000).
constexpr std::string_view kSpace = " \t\n\r\f\v";
std::string_view strip(std::string_view s) {
  auto b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(kSpace) - b + 1);
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
