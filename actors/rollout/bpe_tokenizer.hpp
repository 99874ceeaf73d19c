#pragma once
// A byte-level BPE tokenizer read from a Hugging Face `tokenizer.json` (the format GLM-4,
// GLM-4.5 and GLM-4.7 ship), giving the ids HF `tokenizers` gives. Torch-free.
//
// Encode, as tokenizers does it (checked against it by tests/rollout/test_bpe_tokenizer.cpp):
//   1. added tokens are cut out first as whole strings: those with "normalized": false, then, in
//      the text between them, those with "normalized": true (each pass leftmost-longest);
//   2. every other stretch is pre-tokenized: the Split regex (PCRE2, UTF + UCP) cuts it into
//      pieces (behavior Isolated: matches and the gaps between them), ByteLevel maps each
//      piece's bytes to characters with GPT-2's byte-to-unicode table;
//   3. each piece goes through BPE: start from one symbol per byte-character, repeatedly merge
//      the adjacent pair of lowest merge rank (leftmost first among equal ranks); results are
//      cached per piece.
// Decode: ids -> token strings (added tokens by their content; special ones optionally
// skipped), then the ByteLevel decoder maps characters back to bytes and invalid UTF-8 becomes
// U+FFFD per maximal invalid subpart (Rust's String::from_utf8_lossy, which tokenizers uses).
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::rollout {

/// One entry of tokenizer.json's "added_tokens".
struct AddedToken {
  int64_t id = 0;
  std::string content;
  bool special = false;     ///< skipped by decode(..., skip_special_tokens = true)
  bool normalized = false;  ///< matched in the second pass (no normalizer: same text)
};

class BpeTokenizer {
 public:
  /// Reads `path` (a tokenizer.json). Throws std::runtime_error naming the file when it cannot
  /// be read, and std::invalid_argument naming the JSON path and value of anything it does not
  /// support or that is inconsistent (e.g. `model.type: "WordPiece" is not supported`, a merge
  /// naming a token missing from model.vocab, a Split regex PCRE2 cannot compile).
  static BpeTokenizer from_file(const std::filesystem::path& path);
  /// As from_file, from the JSON text; `source` names it in error messages.
  static BpeTokenizer from_json(std::string_view json_text, std::string_view source = "tokenizer.json");

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  /// Token ids of `text` (UTF-8). Thread-safe. `add_special_tokens`: also add the ids a
  /// TemplateProcessing post-processor puts around a single sequence (e.g. `[gMASK] <sop> $A`;
  /// HF's encode does by default, apply_chat_template does not). Throws std::invalid_argument
  /// naming the byte offset when `text` is not valid UTF-8 (tokenizers only takes valid strings).
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = false) const;
  /// Text of `ids`. Throws std::out_of_range naming an id that is neither in model.vocab nor
  /// an added token (tokenizers would drop it silently).
  std::string decode(std::span<const int64_t> ids, bool skip_special_tokens = false) const;

  /// The id of a token string (vocab entry or added token); -1 when there is none.
  int64_t token_to_id(std::string_view token) const;
  /// The token string of an id (byte-level characters for vocab entries); throws
  /// std::out_of_range for an unknown id.
  const std::string& id_to_token(int64_t id) const;
  /// Largest id + 1 over model.vocab and added_tokens.
  int64_t vocab_size() const;
  const std::vector<AddedToken>& added_tokens() const;

  struct Impl;  // opaque: the loaded tables (bpe_tokenizer.cpp)

 private:
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::rollout
