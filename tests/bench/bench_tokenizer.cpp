// kiln's byte-level BPE encode throughput, one thread (tests/bench/bench_tokenizer.py runs it
// beside HF tokenizers on the same strings and compares):
//   kiln_bench_tokenizer TOKENIZER_JSON CORPUS_JSONL_GZ [REPEATS]
// CORPUS_JSONL_GZ: lines {"text": ...} (tests/fixtures/bpe_tokenizer/corpus.jsonl.gz). Two
// modes: "strings" encodes every string on its own; "document" encodes all of them joined by
// "\n" in one call. Prints one JSON line per mode: bytes, tokens, best seconds of REPEATS
// (default 5; the first, cold-cache pass is timed separately as cold_seconds) and an FNV-1a
// hash of the ids, which the driver checks against HF's.
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "actors/rollout/bpe_tokenizer.hpp"

namespace {

std::vector<std::string> read_corpus(const char* path) {
  gzFile f = gzopen(path, "rb");
  if (!f) throw std::runtime_error(std::string("cannot open ") + path);
  std::string all;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) all.append(buf, std::size_t(n));
  gzclose(f);
  if (n < 0) throw std::runtime_error(std::string("cannot decompress ") + path);
  std::vector<std::string> out;
  std::istringstream lines(all);
  for (std::string line; std::getline(lines, line);) out.push_back(nlohmann::json::parse(line)["text"]);
  return out;
}

uint64_t fnv1a(uint64_t h, int64_t id) {
  for (int k = 0; k < 8; ++k) h = (h ^ ((uint64_t(id) >> (8 * k)) & 0xFF)) * 1099511628211ull;
  return h;
}

template <class F>
void measure(const char* mode, std::size_t bytes, int repeats, F&& run) {
  using clock = std::chrono::steady_clock;
  double best = 1e30, cold = 0;
  std::size_t tokens = 0;
  uint64_t hash = 0;
  for (int r = 0; r <= repeats; ++r) {
    auto t0 = clock::now();
    auto [n, h] = run();
    double s = std::chrono::duration<double>(clock::now() - t0).count();
    if (r == 0) cold = s;
    else best = std::min(best, s);
    tokens = n, hash = h;
  }
  nlohmann::json j = {{"mode", mode}, {"bytes", bytes}, {"tokens", tokens}, {"seconds", best}, {"cold_seconds", cold},
                      {"hash", std::to_string(hash)}};
  std::cout << j.dump() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: kiln_bench_tokenizer TOKENIZER_JSON CORPUS_JSONL_GZ [REPEATS]\n";
    return 2;
  }
  try {
    int repeats = argc > 3 ? std::stoi(argv[3]) : 5;
    auto strings = read_corpus(argv[2]);
    std::size_t bytes = 0;
    for (const auto& s : strings) bytes += s.size();
    std::string document;
    for (std::size_t i = 0; i < strings.size(); ++i) document += (i ? "\n" : "") + strings[i];
    // A fresh tokenizer per mode, so each mode's cold pass starts with an empty BPE cache.
    {
      auto tok = kiln::rollout::BpeTokenizer::from_file(argv[1]);
      measure("strings", bytes, repeats, [&] {
        std::size_t n = 0;
        uint64_t h = 1469598103934665603ull;
        for (const auto& s : strings)
          for (auto id : tok.encode(s)) h = fnv1a(h, id), ++n;
        return std::pair{n, h};
      });
    }
    auto tok = kiln::rollout::BpeTokenizer::from_file(argv[1]);
    measure("document", document.size(), repeats, [&] {
      uint64_t h = 1469598103934665603ull;
      auto ids = tok.encode(document);
      for (auto id : ids) h = fnv1a(h, id);
      return std::pair{ids.size(), h};
    });
  } catch (const std::exception& e) {
    std::cerr << "kiln_bench_tokenizer: " << e.what() << "\n";
    return 1;
  }
}
