// Fuzz harness: the envelope / tensor-frame decoder (messaging/codec.cpp) and every message
// type's payload decoder (messaging/schema.hpp and each family's actors/*/messages.hpp), as a
// kiln node meets them on its socket.
// Input: frames, each a u32 little-endian length and that many bytes (a length past the end
// takes what is left). Properties: decode never crashes; what it accepts passes validate(),
// re-encodes and decodes to the same envelope; a payload that decodes as its type re-encodes
// and decodes again.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "actors/reference/messages.hpp"
#include "actors/rollout/messages.hpp"
#include "actors/trainer/messages.hpp"
#include "actors/weight_sync/messages.hpp"
#include "fuzz_util.hpp"
#include "messaging/envelope.hpp"
#include "messaging/schema.hpp"

using namespace kiln::messaging;

namespace {

// Each frame in a heap block that ends exactly where the frame ends, so that ASan sees a read
// past it; odd frames start one byte into their block, so that tensor frames arrive
// misaligned for their dtype, as they can over tcp/ipc.
struct Frames {
  std::vector<std::unique_ptr<std::byte[]>> blocks;
  std::vector<Frame> frames;
  void add(const std::byte* p, std::size_t n) {
    const std::size_t shift = frames.size() % 2;
    blocks.push_back(std::make_unique<std::byte[]>(n + shift));
    if (n) std::memcpy(blocks.back().get() + shift, p, n);
    frames.push_back({blocks.back().get() + shift, n, nullptr});
  }
};

template <class T>
void check_payload(const Envelope& env) {
  if (env.type != T::kType) return;
  auto value = payload_as<T>(env);
  if (!value) return;
  auto again = payload_as<T>(make_envelope(*value, env.kind, env.sender, env.receiver));
  KILN_FUZZ_CHECK(again.has_value(), "a payload that decoded as its type must re-encode and decode again");
}

template <class... T>
void check_payloads(const Envelope& env, std::tuple<T...>*) {
  (check_payload<T>(env), ...);
}

// An absent payload decodes as "" and is encoded as the empty map "\x80": the same payload.
std::string payload_of(const Envelope& env) { return env.payload.empty() ? std::string("\x80") : env.payload; }

void check_round_trip(const Envelope& env) {
  const std::string head = encode_header(env);
  Frames again;
  again.add(reinterpret_cast<const std::byte*>(head.data()), head.size());
  for (const auto& t : env.tensors) again.add(t.data, t.nbytes);
  auto back = decode(again.frames);
  KILN_FUZZ_CHECK(back.has_value(), "a decoded envelope must re-encode to frames that decode");
  KILN_FUZZ_CHECK(back->type == env.type && back->type_version == env.type_version && back->kind == env.kind &&
                      back->sender == env.sender && back->receiver == env.receiver &&
                      back->correlation_id == env.correlation_id && payload_of(*back) == payload_of(env) &&
                      back->tensors.size() == env.tensors.size(),
                  "a re-encoded envelope must decode to the same fields");
  for (std::size_t i = 0; i < env.tensors.size(); ++i) {
    const auto &a = env.tensors[i], &b = back->tensors[i];
    KILN_FUZZ_CHECK(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.nbytes == b.nbytes &&
                        (a.nbytes == 0 || std::memcmp(a.data, b.data, a.nbytes) == 0),
                    "a re-encoded tensor must decode to the same tensor");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Frames in;
  std::size_t off = 0;
  while (size - off >= 4 && in.frames.size() < 64) {
    uint32_t n = uint32_t(data[off]) | uint32_t(data[off + 1]) << 8 | uint32_t(data[off + 2]) << 16 |
                 uint32_t(data[off + 3]) << 24;
    off += 4;
    n = uint32_t(std::min<std::size_t>(n, size - off));
    in.add(reinterpret_cast<const std::byte*>(data + off), n);
    off += n;
  }
  auto env = decode(in.frames);
  if (!env) return 0;
  KILN_FUZZ_CHECK(validate(*env).has_value(), "a decoded envelope must pass validate()");
  for (const auto& t : env->tensors) {  // every byte of every tensor is readable
    volatile std::byte sink{};
    for (std::size_t i = 0; i < t.nbytes; ++i) sink = t.data[i];
    (void)sink;
  }
  check_payloads(*env, static_cast<MessageTypes*>(nullptr));  // the core and every actor family's
  check_payloads(*env, static_cast<std::tuple<WeightSyncBucket, WeightSyncCommit, WeightSyncAck, RolloutInit, RolloutReady,
                                              RolloutGenerate, RolloutResult, RefInit, RefReady, RefLogprobs,
                                              RefLogprobsResult, TrainerInit, TrainerReady, TrainerLoad, TrainerTrain,
                                              TrainerStepResult, TrainerPushWeights, TrainerPushed, TrainerSave>*>(nullptr));
  check_round_trip(*env);
  return 0;
}
