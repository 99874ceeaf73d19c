#pragma once
// Internal to kiln_tokenizer: the tables a BpeTokenizer holds, shared by bpe_tokenizer_json.cpp
// (which fills them from tokenizer.json) and bpe_tokenizer.cpp (encode, decode).
#include <array>
#include <cstdint>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "actors/rollout/bpe_tokenizer.hpp"
#include "actors/rollout/pretokenizer_regex.hpp"

namespace kiln::rollout {

namespace detail {
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
/// string -> V with lookups by string_view (no temporary std::string).
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;
}  // namespace detail

struct BpeTokenizer::Impl {
  std::vector<PretokenizerRegex> splits;  // applied in order; each cuts every piece of the one before
  bool ignore_merges = false;
  detail::StringMap<int64_t> vocab;
  std::vector<std::string> tokens;          // id -> token string ("" where no token)
  std::vector<std::string> decoded_bytes;   // id -> bytes after the ByteLevel decoder
  std::vector<uint8_t> known;               // id -> 1 when the id has a token
  std::vector<uint8_t> special;             // id -> 1 for special added tokens
  std::array<int32_t, 256> byte_id{};       // byte -> id of its byte-level character
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) -> (rank, merged)
  std::vector<AddedToken> added;
  // Added tokens by first byte, longest first: [0] normalized = false, [1] normalized = true.
  std::array<std::array<std::vector<int32_t>, 256>, 2> added_by_byte;
  // TemplateProcessing's single-sequence template: ids before and after $A.
  std::vector<int64_t> template_prefix, template_suffix;
  mutable std::shared_mutex cache_mutex;
  mutable detail::StringMap<std::vector<int32_t>> cache;

  void bpe(std::string_view piece, std::vector<int64_t>& out, std::string& scratch) const;
  void encode_plain(std::string_view text, std::vector<int64_t>& out) const;
};

}  // namespace kiln::rollout
