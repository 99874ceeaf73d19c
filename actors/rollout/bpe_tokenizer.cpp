#include "actors/rollout/bpe_tokenizer.hpp"

#include <mutex>
#include <queue>
#include <stdexcept>

#include "actors/rollout/bpe_tokenizer_impl.hpp"
#include "actors/rollout/byte_level.hpp"

namespace kiln::rollout {

namespace {
// tokenizers' BPE cache holds up to 10,000 words; pieces this long or longer are not cached.
constexpr std::size_t kCacheCapacity = 10000;
constexpr std::size_t kCacheMaxPieceBytes = 256;
}  // namespace

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

void BpeTokenizer::Impl::bpe(std::string_view piece, std::vector<int64_t>& out, std::string& scratch) const {
  if (piece.size() < kCacheMaxPieceBytes) {
    std::shared_lock lock(cache_mutex);
    if (auto it = cache.find(piece); it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> result;
  if (ignore_merges) {  // a piece that is a whole vocab entry is that entry
    scratch.clear();
    for (char c : piece) scratch += byte_level::char_of_byte(uint8_t(c));
    if (auto it = vocab.find(scratch); it != vocab.end()) result.push_back(int32_t(it->second));
  }
  if (result.empty()) {
    // Symbols are byte spans [i, next[i]) linked by prev/next; a merge joins i with next[i].
    const std::size_t n = piece.size();
    std::vector<int32_t> id(n), prev(n), next(n);
    for (std::size_t i = 0; i < n; ++i) {
      id[i] = byte_id[static_cast<unsigned char>(piece[i])];
      prev[i] = int32_t(i) - 1;
      next[i] = int32_t(i + 1);
    }
    struct Cand { int32_t rank, pos, left, right, merged; };
    auto later = [](const Cand& a, const Cand& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
    std::priority_queue<Cand, std::vector<Cand>, decltype(later)> heap(later);
    auto push = [&](int32_t i) {
      if (i < 0 || std::size_t(next[std::size_t(i)]) >= n) return;
      int32_t j = next[std::size_t(i)];
      auto it = merges.find((uint64_t(uint32_t(id[std::size_t(i)])) << 32) | uint32_t(id[std::size_t(j)]));
      if (it != merges.end()) heap.push({it->second.first, i, id[std::size_t(i)], id[std::size_t(j)], it->second.second});
    };
    for (std::size_t i = 0; i + 1 < n; ++i) push(int32_t(i));
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      auto i = std::size_t(c.pos);
      // Stale when either side has merged since: a symbol's id only changes by growing.
      if (id[i] != c.left || std::size_t(next[i]) >= n || id[std::size_t(next[i])] != c.right) continue;
      auto j = std::size_t(next[i]);
      id[i] = c.merged;
      id[j] = -1;
      next[i] = next[j];
      if (std::size_t(next[i]) < n) prev[std::size_t(next[i])] = int32_t(i);
      push(prev[i]);
      push(int32_t(i));
    }
    for (std::size_t i = 0; i < n; i = std::size_t(next[i])) result.push_back(id[i]);
  }
  out.insert(out.end(), result.begin(), result.end());
  if (piece.size() < kCacheMaxPieceBytes) {
    std::unique_lock lock(cache_mutex);
    if (cache.size() < kCacheCapacity) cache.emplace(std::string(piece), std::move(result));
  }
}

void BpeTokenizer::Impl::encode_plain(std::string_view text, std::vector<int64_t>& out) const {
  if (text.empty()) return;
  // Split k cuts each piece of split k - 1; the last split's pieces go to BPE.
  std::vector<std::string_view> pieces{text}, next;
  for (const auto& split : splits) {
    next.clear();
    for (auto piece : pieces) split.split(piece, next);
    pieces.swap(next);
  }
  std::string scratch;
  for (auto piece : pieces) bpe(piece, out, scratch);
}

std::vector<int64_t> BpeTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (auto bad = byte_level::first_invalid_utf8(text); bad != text.size())
    throw std::invalid_argument("BpeTokenizer::encode: the text is not valid UTF-8 at byte " + std::to_string(bad) + " of " +
                                std::to_string(text.size()));
  const Impl& t = *impl_;
  std::vector<int64_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special_tokens) out = t.template_prefix;
  // Pass `pass` cuts out the added tokens of that pass (leftmost, then longest), handing the text
  // between them to pass + 1; after pass 1 comes the pre-tokenizer and BPE.
  auto cut = [&](auto& self, int pass, std::string_view s) -> void {
    if (pass == 2) return t.encode_plain(s, out);
    std::size_t last = 0;
    for (std::size_t i = 0; i < s.size();) {
      const auto& cands = t.added_by_byte[std::size_t(pass)][static_cast<unsigned char>(s[i])];
      const AddedToken* hit = nullptr;
      for (int32_t k : cands)
        if (s.substr(i).starts_with(t.added[std::size_t(k)].content)) { hit = &t.added[std::size_t(k)]; break; }
      if (!hit) { ++i; continue; }
      if (i > last) self(self, pass + 1, s.substr(last, i - last));
      out.push_back(hit->id);
      i += hit->content.size();
      last = i;
    }
    if (last < s.size()) self(self, pass + 1, s.substr(last));
  };
  cut(cut, 0, text);
  if (add_special_tokens) out.insert(out.end(), t.template_suffix.begin(), t.template_suffix.end());
  return out;
}

std::string BpeTokenizer::decode(std::span<const int64_t> ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::string bytes;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    int64_t id = ids[k];
    if (id < 0 || std::size_t(id) >= t.tokens.size() || !t.known[std::size_t(id)])
      throw std::out_of_range("BpeTokenizer::decode: id " + std::to_string(id) + " at position " + std::to_string(k) +
                              " is not a token of this tokenizer (vocab size " + std::to_string(t.tokens.size()) + ")");
    if (skip_special_tokens && t.special[std::size_t(id)]) continue;
    bytes += t.decoded_bytes[std::size_t(id)];
  }
  return byte_level::utf8_lossy(bytes);
}

int64_t BpeTokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

const std::string& BpeTokenizer::id_to_token(int64_t id) const {
  if (id < 0 || std::size_t(id) >= impl_->tokens.size() || !impl_->known[std::size_t(id)])
    throw std::out_of_range("BpeTokenizer::id_to_token: id " + std::to_string(id) + " is not a token of this tokenizer");
  return impl_->tokens[std::size_t(id)];
}

int64_t BpeTokenizer::vocab_size() const { return int64_t(impl_->tokens.size()); }
const std::vector<AddedToken>& BpeTokenizer::added_tokens() const { return impl_->added; }

}  // namespace kiln::rollout
