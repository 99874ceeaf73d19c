// The decoder against random and mutated frames: it must return (value or error) for every
// input, never crash or read outside the frames (run under ASan+UBSan in CI).
#include <doctest/doctest.h>

#include "helpers.hpp"
#include "messaging/envelope.hpp"
#include "messaging/schema.hpp"

using namespace kiln::messaging;

namespace {
struct Input {
  std::vector<std::string> frames;  // each frame's bytes, owned here
};

std::vector<Frame> view(const Input& in) {
  std::vector<Frame> f;
  for (const auto& s : in.frames) f.push_back({reinterpret_cast<const std::byte*>(s.data()), s.size(), nullptr});
  return f;
}

std::vector<Input> seeds(std::mt19937_64& rng) {
  std::vector<Input> out;
  for (int n = 0; n < 4; ++n) {
    auto env = make_envelope(GraphJoin{"n", "tcp://127.0.0.1:1", {"a/0", "b/1"}}, Kind::request, "x/0", "graph");
    env.correlation_id = rng();
    for (int i = 0; i < n; ++i)
      env.tensors.push_back(kiln::test::random_tensor("t" + std::to_string(i), kAllDTypes[rng() % 11],
                                                      {int64_t(rng() % 4), int64_t(rng() % 3 + 1)}, rng));
    Input in;
    in.frames.push_back(encode_header(env));
    for (const auto& t : env.tensors) in.frames.emplace_back(reinterpret_cast<const char*>(t.data), t.nbytes);
    out.push_back(std::move(in));
  }
  return out;
}

std::string random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = char(rng());
  return s;
}

Input mutate(const std::vector<Input>& seeds, std::mt19937_64& rng) {
  Input in = seeds[rng() % seeds.size()];
  std::string& h = in.frames[0];
  switch (rng() % 7) {
    case 0:  // pure noise
      in.frames.assign(1 + rng() % 4, "");
      for (auto& f : in.frames) f = random_bytes(rng, rng() % 300);
      break;
    case 1:  // flip bytes of the header
      for (int k = 0, n = 1 + rng() % 8; k < n; ++k) h[rng() % h.size()] = char(rng());
      break;
    case 2:  // truncate the header
      h.resize(rng() % h.size());
      break;
    case 3:  // insert bytes into the header
      h.insert(rng() % (h.size() + 1), random_bytes(rng, 1 + rng() % 16));
      break;
    case 4:  // wrong tensor frames: resize, drop or duplicate
      if (in.frames.size() > 1 && rng() % 2) in.frames[1 + rng() % (in.frames.size() - 1)].resize(rng() % 64);
      else if (rng() % 2) in.frames.pop_back();
      else in.frames.push_back(in.frames.back());
      break;
    case 5:  // set a byte to an interesting msgpack marker (containers, big sizes, ext)
    {
      static const char markers[] = {'\xdc', '\xdd', '\xde', '\xdf', '\xc4', '\xc6', '\xd9', '\xdb',
                                     '\xc7', '\xc9', '\xcf', '\xd3', '\xff', '\x00', '\x7f', '\x9f'};
      for (int k = 0, n = 1 + rng() % 3; k < n; ++k) h[rng() % h.size()] = markers[rng() % sizeof markers];
      break;
    }
    case 6:  // splice two headers
    {
      const std::string& other = seeds[rng() % seeds.size()].frames[0];
      h = h.substr(0, rng() % h.size()) + other.substr(rng() % other.size());
      break;
    }
  }
  return in;
}
}  // namespace

TEST_CASE("decoder survives 20000 random and mutated frame sets without a crash") {
  std::mt19937_64 rng(20261129);
  auto base = seeds(rng);
  int decoded = 0, rejected = 0;
  for (int i = 0; i < 20000; ++i) {
    Input in = mutate(base, rng);
    auto frames = view(in);
    auto r = decode(frames);
    if (r) {
      ++decoded;
      // Whatever decodes must satisfy the envelope's invariants.
      REQUIRE(r->tensors.size() + 1 == frames.size());
      for (std::size_t t = 0; t < r->tensors.size(); ++t) CHECK(r->tensors[t].nbytes == frames[t + 1].size);
      CHECK(validate(*r).has_value());
      (void)unpack_payload(*r);
    } else {
      ++rejected;
      CHECK_FALSE(r.error().message.empty());
    }
  }
  MESSAGE("decoded " << decoded << ", rejected " << rejected);
  CHECK(decoded + rejected == 20000);
  CHECK(rejected > 10000);  // the mutations really break things
  CHECK(decoded > 0);       // and some survive (mutations inside strings or ids)
}
