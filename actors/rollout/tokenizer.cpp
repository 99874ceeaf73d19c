#include "actors/rollout/tokenizer.hpp"

#include <cstdio>
#include <stdexcept>

namespace kiln::rollout {

CharTokenizer::CharTokenizer(std::string alphabet) : alphabet_(std::move(alphabet)) {
  for (auto& i : index_) i = -1;
  for (std::size_t i = 0; i < alphabet_.size(); ++i) {
    auto c = static_cast<unsigned char>(alphabet_[i]);
    if (index_[c] != -1) throw std::invalid_argument(std::string("CharTokenizer: alphabet repeats '") + alphabet_[i] + "'");
    index_[c] = 3 + int64_t(i);
  }
}

std::vector<int64_t> CharTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    int64_t id = index_[static_cast<unsigned char>(text[i])];
    if (id < 0) {
      // A byte outside printable ASCII is named in hex, never echoed: half a UTF-8 character
      // printed alone is a broken glyph.
      const auto byte = static_cast<unsigned char>(text[i]);
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", unsigned(byte));
      throw std::invalid_argument(
          "CharTokenizer: " + (byte >= 0x20 && byte < 0x7F ? "character '" + std::string(1, text[i]) + "'" : "byte " + std::string(hex)) +
          " at offset " + std::to_string(i) + " is not in the character tokenizer's alphabet" +
          (byte >= 0x80 ? " (printable ASCII only: set task.tokenizer to a tokenizer.json for other text)" : ""));
    }
    ids.push_back(id);
  }
  return ids;
}

std::vector<int64_t> CharTokenizer::encode_prompt(std::string_view text) const {
  auto ids = encode(text);
  ids.insert(ids.begin(), bos_id());
  return ids;
}

std::string CharTokenizer::decode(std::span<const int64_t> ids) const {
  std::string out;
  for (auto id : ids) {
    if (id >= 0 && id < 3) continue;
    if (id < 0 || id >= vocab_size()) out += '?';
    else out += alphabet_[std::size_t(id - 3)];
  }
  return out;
}

}  // namespace kiln::rollout
