// Fuzz harness: text for the byte-level BPE tokenizer (actors/rollout/bpe_tokenizer.hpp) with
// the fixture's GLM-style tokenizer.json (tests/fixtures/bpe_tokenizer), the whole input as the
// text. Properties: encode never crashes; it refuses bytes that are not UTF-8 with nothing but
// std::invalid_argument, and only those; every id it gives is a token; decode(encode(x)) == x;
// decode with special tokens skipped never crashes either. The seeds (corpus/tokenizer/seed-*)
// are strings of the fixture corpus, written by tests/fixtures/make_bpe_tokenizer_fixture.py.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string_view>

#include "actors/rollout/bpe_tokenizer.hpp"
#include "actors/rollout/byte_level.hpp"
#include "fuzz_util.hpp"

using kiln::rollout::BpeTokenizer;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const BpeTokenizer tok = BpeTokenizer::from_file(KILN_FIXTURES_DIR "/bpe_tokenizer/tokenizer.json");
  std::string_view text(reinterpret_cast<const char*>(data), size);
  bool valid = kiln::rollout::byte_level::first_invalid_utf8(text) == text.size();
  std::vector<int64_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const std::invalid_argument&) {
    KILN_FUZZ_CHECK(!valid, "encode refuses only text that is not valid UTF-8");
    return 0;
  }
  KILN_FUZZ_CHECK(valid, "encode refuses text that is not valid UTF-8");
  for (auto id : ids) KILN_FUZZ_CHECK(id >= 0 && id < tok.vocab_size(), "every id encode gives is a token");
  KILN_FUZZ_CHECK(tok.decode(ids) == text, "decode(encode(x)) == x");
  tok.decode(ids, /*skip_special_tokens=*/true);
  return 0;
}
