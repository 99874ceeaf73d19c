#pragma once
// SGLang's native HTTP API as `kiln serve` speaks it (http_server.hpp) and the HTTP rollout
// backend sends it (actors/controller/http_engines.hpp): the /generate request read into
// generation requests, checked field by field, and a completion written as SGLang writes it.
// Field names are SGLang's (python/sglang/srt/managers/io_struct.py GenerateReqInput,
// python/sglang/srt/sampling/sampling_params.py SamplingParams); docs/serving.md lists them.
//
// A completion's JSON (one object per prompt; a list of them for a batch):
//   {"text": decoded output (with a tokenizer, else ""), "output_ids": [n],
//    "meta_info": {"id", "prompt_tokens": P, "completion_tokens": n, "cached_tokens": 0,
//      "finish_reason": {"type": "stop", "matched": id} | {"type": "length", "length": n},
//      "weight_version": "V" (the version that produced the last token, as a string),
//      "e2e_latency": seconds,
//      with return_logprob: "output_token_logprobs": [[logprob, id, null], ...] (n),
//        and kiln's own "output_token_entropies" [n] and "output_token_weight_versions" [n];
//      with return_routed_experts: "routed_experts": base64 of int32 [P + n - 1, L, K]
//        (little-endian, row-major; SGLang's layout);
//      with return_topk_indices (kiln's own field): "topk_indices": base64 of int32
//        [P + n - 1, Ls, W], each sparse-attention layer's selected key positions (-1: none)}}
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/rollout/backend.hpp"
#include "actors/rollout/tokenizer.hpp"

namespace kiln::rollout {

/// A request the server refuses: the HTTP status (4xx) and a message naming the field. A NUL
/// in the message (a client's key or value) is written as \u0000, or what() would end there.
struct ApiError : std::invalid_argument {
  ApiError(int status, const std::string& message) : std::invalid_argument(without_nul(message)), status(status) {}
  int status;

 private:
  static std::string without_nul(const std::string& text) {
    std::string out;
    for (char ch : text) out += ch == '\0' ? std::string("\\u0000") : std::string(1, ch);
    return out;
  }
};

/// What a request is checked against.
struct ApiLimits {
  int64_t vocab_size = 0;
  int64_t context_tokens = 0;  ///< prompt + max_new_tokens must fit (the engine's whole cache)
  const Tokenizer* tokenizer = nullptr;  ///< for "text" prompts and "stop" strings; none: ids only
  int64_t sparse_layers = 0;  ///< the model's sparse-attention layers; 0: return_topk_indices is refused
};

/// A /generate request: one generation request per prompt.
struct NativeGenerate {
  std::vector<GenerationRequest> requests;
  std::vector<std::string> rids;  ///< the client's "rid" per prompt ("" when none)
  bool batch = false;             ///< the prompts came as a list (the answer is a list)
  bool return_logprob = false;
  bool return_routed_experts = false;
  bool return_topk_indices = false;  ///< kiln's own: sparse-attention selections (glm5_next)
  bool return_text_in_logprobs = false;
};

/// Parses a /generate body. Throws ApiError(400) naming the field for invalid JSON, an unknown
/// field, a wrong type, a value out of range (non-finite or negative temperature, top_p
/// outside (0, 1], top_k not -1 or >= 1, max_new_tokens < 1, n != 1), a token id outside
/// [0, vocab_size), an empty prompt, a prompt that with max_new_tokens exceeds
/// context_tokens, "text" without a tokenizer, return_topk_indices without sparse_layers, or a
/// feature kiln does not serve (stream,
/// logprob_start_len other than -1, top_logprobs_num > 0). A missing sampling_seed gets a
/// random one.
NativeGenerate parse_generate(std::string_view body, const ApiLimits& limits);

/// SGLang's sampling_params object at `where` (e.g. "sampling_params[2]") into `out`
/// (defaults: SGLang's max_new_tokens 128, temperature 1, top_p 1, top_k all). As SGLang, a
/// sample also stops at limits.tokenizer's end tokens (eos_ids) unless "ignore_eos" is true.
/// Throws as parse_generate.
void parse_sampling_params(const nlohmann::json& j, const std::string& where, const ApiLimits& limits,
                           SamplingParams& out);

/// One completion as SGLang's /generate answers it (layout above). `rid`: meta_info.id.
nlohmann::json generate_output(const Completion& c, const std::string& rid, const NativeGenerate& g,
                               const Tokenizer* tokenizer, double e2e_latency_s);

/// The JSON object `body` as the caller's `what` (e.g. "/pause_generation"), every key in
/// `allowed`; {} for an empty body. Throws ApiError(400) for invalid JSON, not an object, or
/// an unknown key (named).
nlohmann::json parse_object(std::string_view body, const std::string& what, const std::vector<std::string>& allowed);

/// `j` as JSON text; invalid UTF-8 in a string (a client's bytes, a partial token) becomes
/// U+FFFD instead of throwing.
std::string json_text(const nlohmann::json& j);

/// The JSON body of an error answer: {"error": {"message", "code": status}} (SGLang's shape).
std::string error_body(int status, const std::string& message);

/// Reading JSON request bodies: each throws ApiError(400) naming `where` and the fault.
namespace api {
[[noreturn]] void bad(const std::string& where, const std::string& why);
/// `body` as JSON; `what` names the endpoint.
nlohmann::json parse_json(std::string_view body, const std::string& what);
/// Refuses a key of object `j` not in `allowed` (listed in the message).
void only_keys(const nlohmann::json& j, const std::string& where, const std::vector<std::string>& allowed);
/// `j` for an error message: a number, boolean or null as JSON, a string quoted and cut at 200
/// bytes, an array of up to 8 scalars as JSON; any other array or object by its kind and size.
/// Never the whole of a nested value: its text could be megabytes, and dumping 70000 levels of
/// nesting overran the server's stack.
std::string shown(const nlohmann::json& j);
int64_t integer(const nlohmann::json& j, const std::string& where);
double number(const nlohmann::json& j, const std::string& where);  ///< finite only
bool boolean(const nlohmann::json& j, const std::string& where);
/// A list of token ids, each in [0, vocab).
std::vector<int64_t> token_ids(const nlohmann::json& j, const std::string& where, int64_t vocab);
/// The sampling keys SGLang's and OpenAI's requests share, read into `p` where present: the
/// token bound under `max_tokens_key` (>= 1), temperature (finite, >= 0), top_p (0, 1], top_k
/// (-1: off, or >= 1), n (1 only), the seed under `seed_key` (in [0, 2^64); a random one when
/// absent), stop (strings, encoded with limits.tokenizer into stop sequences).
void sampling_fields(const nlohmann::json& j, const std::string& where, const ApiLimits& limits,
                     const char* max_tokens_key, const char* seed_key, SamplingParams& p);
}  // namespace api

/// Standard base64 (RFC 4648, with padding) of `bytes`, and back; decode throws
/// std::invalid_argument for text that is not base64.
std::string base64_encode(std::string_view bytes);
std::string base64_decode(std::string_view text);

}  // namespace kiln::rollout
