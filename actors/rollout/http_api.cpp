#include "actors/rollout/http_api.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "model/blocks/temperature.hpp"

namespace kiln::rollout {

using nlohmann::json;

namespace api {

[[noreturn]] void bad(const std::string& where, const std::string& why) { throw ApiError(400, where + ": " + why); }

json parse_json(std::string_view body, const std::string& what) {
  // A key twice in one object is refused (nlohmann keeps the last; another reader may keep the
  // first, so the two would disagree on what was asked). One key set per open object.
  std::vector<std::set<std::string>> keys;
  std::string twice;
  auto seen = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    else if (event == json::parse_event_t::object_end) keys.pop_back();
    else if (event == json::parse_event_t::key && !keys.back().insert(parsed.get<std::string>()).second && twice.empty())
      twice = parsed.get<std::string>();
    return true;
  };
  json j;
  try {
    j = json::parse(body.begin(), body.end(), seen);
  } catch (const json::exception& e) {
    throw ApiError(400, what + ": the body is not valid JSON (" + e.what() + ")");
  }
  if (!twice.empty()) throw ApiError(400, what + ": the key '" + twice + "' appears twice in one object (send each field once)");
  return j;
}

void only_keys(const json& j, const std::string& where, const std::vector<std::string>& allowed) {
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end()) {
      std::string known;
      for (const auto& k : allowed) known += (known.empty() ? "" : ", ") + k;
      bad(where + "." + it.key(), "unknown field (known: " + known + ")");
    }
}

std::string shown(const json& j) {
  auto scalar = [](const json& v) { return !v.is_array() && !v.is_object(); };
  if (j.is_string()) {
    const auto& t = j.get_ref<const std::string&>();
    return t.size() <= 200 ? json_text(j) : json_text(json(t.substr(0, 200))) + " (cut, " + std::to_string(t.size()) + " bytes)";
  }
  if (scalar(j)) return json_text(j);
  if (j.is_array() && j.size() <= 8 && std::all_of(j.begin(), j.end(), scalar)) {
    std::string out = "[";
    for (std::size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + shown(j[i]);
    return out + "]";
  }
  const auto n = std::to_string(j.size());
  return j.is_array() ? "an array of " + n + (j.size() == 1 ? " element" : " elements")
                      : "an object of " + n + (j.size() == 1 ? " key" : " keys");
}

int64_t integer(const json& j, const std::string& where) {
  if (j.is_number_unsigned() && j.get<uint64_t>() > uint64_t(INT64_MAX)) bad(where, "must be an integer below 2^63");
  if (!j.is_number_integer()) bad(where, "must be an integer, got " + shown(j));
  return j.get<int64_t>();
}

double number(const json& j, const std::string& where) {
  if (!j.is_number()) bad(where, "must be a number, got " + shown(j));
  const double v = j.get<double>();
  if (!std::isfinite(v)) bad(where, "must be a finite number, got " + shown(j));
  return v;
}

bool boolean(const json& j, const std::string& where) {
  if (!j.is_boolean()) bad(where, "must be true or false, got " + shown(j));
  return j.get<bool>();
}

std::vector<int64_t> token_ids(const json& j, const std::string& where, int64_t vocab) {
  if (!j.is_array()) bad(where, "must be a list of token ids");
  std::vector<int64_t> out;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const auto at = where + "[" + std::to_string(i) + "]";
    const int64_t t = integer(j[i], at);
    if (t < 0 || t >= vocab)
      bad(at, "token id " + std::to_string(t) + " outside the vocabulary [0, " + std::to_string(vocab) + ")");
    out.push_back(t);
  }
  return out;
}

}  // namespace api

using namespace api;

namespace {

const std::vector<std::string> kGenerateFields = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "return_routed_experts", "return_topk_indices",
    "return_text_in_logprobs", "logprob_start_len", "top_logprobs_num", "stream"};
const std::vector<std::string> kSamplingFields = {
    "max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "sampling_seed", "n",
    "ignore_eos", "skip_special_tokens", "no_stop_trim"};

// A flag that may be one bool for every prompt or a list of them: the value for all (kiln
// answers every prompt of a request alike; a list must hold one value).
bool flag(const json& j, const std::string& where) {
  if (!j.is_array()) return j.is_null() ? false : boolean(j, where);
  bool v = false;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const bool x = boolean(j[i], where + "[" + std::to_string(i) + "]");
    if (i > 0 && x != v) bad(where, "must be the same for every prompt of a request in kiln serve");
    v = x;
  }
  return v;
}
}  // namespace

namespace api {

void sampling_fields(const json& j, const std::string& where, const ApiLimits& limits, const char* max_tokens_key,
                     const char* seed_key, SamplingParams& p) {
  auto field = [&](const std::string& k) { return where + "." + k; };
  auto has = [&](const char* k) { return j.contains(k) && !j[k].is_null(); };
  if (has(max_tokens_key)) {
    p.max_new_tokens = integer(j[max_tokens_key], field(max_tokens_key));
    if (p.max_new_tokens < 1) bad(field(max_tokens_key), "must be >= 1, got " + std::to_string(p.max_new_tokens));
  }
  if (has("temperature")) {
    p.temperature = number(j["temperature"], field("temperature"));
    if (!(p.temperature == 0 || p.temperature >= model::kMinTemperature))
      bad(field("temperature"), "must be 0 (greedy) or >= 1e-5 (smaller ones overflow logits / temperature), got " +
                                    shown(j["temperature"]));
  }
  if (has("top_p")) {
    p.top_p = number(j["top_p"], field("top_p"));
    if (!(p.top_p > 0 && p.top_p <= 1)) bad(field("top_p"), "must be in (0, 1], got " + shown(j["top_p"]));
  }
  if (has("top_k")) {
    const int64_t k = integer(j["top_k"], field("top_k"));
    if (k != -1 && k < 1) bad(field("top_k"), "must be -1 (the whole vocabulary) or >= 1, got " + std::to_string(k));
    p.top_k = k == -1 || k >= limits.vocab_size ? 0 : k;  // kiln's 0: off
  }
  if (has("n") && integer(j["n"], field("n")) != 1)
    bad(field("n"), "must be 1 (send the prompt n times, each with a seed of its own)");
  if (has(seed_key)) {
    const auto& s = j[seed_key];
    if (!s.is_number_integer() || (!s.is_number_unsigned() && s.get<int64_t>() < 0))
      bad(field(seed_key), "must be an integer in [0, 2^64), got " + shown(s));
    p.seed = s.get<uint64_t>();
  } else {
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    p.seed = rng();
  }
  if (has("stop")) {
    const auto& s = j["stop"];
    std::vector<std::string> texts;
    if (s.is_string()) texts.push_back(s.get<std::string>());
    else if (s.is_array())
      for (std::size_t i = 0; i < s.size(); ++i) {
        if (!s[i].is_string()) bad(field("stop") + "[" + std::to_string(i) + "]", "must be a string");
        texts.push_back(s[i].get<std::string>());
      }
    else bad(field("stop"), "must be a string or a list of strings");
    if (!texts.empty() && !limits.tokenizer)
      bad(field("stop"), "needs a tokenizer: start kiln serve with --set task.tokenizer=PATH/tokenizer.json, or use stop_token_ids");
    for (const auto& t : texts) {
      if (t.empty()) bad(field("stop"), "must not hold an empty string");
      try {
        p.stop_sequences.push_back(limits.tokenizer->encode(t));
      } catch (const std::exception& e) {
        bad(field("stop"), std::string("cannot be encoded: ") + e.what());
      }
    }
  }
}

}  // namespace api

void parse_sampling_params(const json& j, const std::string& where, const ApiLimits& limits, SamplingParams& p) {
  if (!j.is_object()) bad(where, "must be an object");
  only_keys(j, where, kSamplingFields);
  p = SamplingParams{};
  p.max_new_tokens = 128;  // SGLang's default
  sampling_fields(j, where, limits, "max_new_tokens", "sampling_seed", p);
  if (j.contains("stop_token_ids") && !j["stop_token_ids"].is_null())
    p.stop_token_ids = token_ids(j["stop_token_ids"], where + ".stop_token_ids", limits.vocab_size);
  for (const char* k : {"skip_special_tokens", "no_stop_trim"})  // accepted; kiln's outputs never hold them
    if (j.contains(k) && !j[k].is_null()) boolean(j[k], where + "." + k);
  // SGLang stops at the model's end tokens unless ignore_eos: they join the request's own.
  const bool ignore_eos = j.contains("ignore_eos") && !j["ignore_eos"].is_null() && boolean(j["ignore_eos"], where + ".ignore_eos");
  if (!ignore_eos && limits.tokenizer)
    for (auto id : limits.tokenizer->eos_ids())
      if (id < limits.vocab_size && std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), id) == p.stop_token_ids.end())
        p.stop_token_ids.push_back(id);
}

NativeGenerate parse_generate(std::string_view body, const ApiLimits& limits) {
  const json j = parse_json(body, "/generate");
  if (!j.is_object()) bad("/generate", "the body must be a JSON object");
  only_keys(j, "/generate", kGenerateFields);
  NativeGenerate g;
  const bool has_text = j.contains("text") && !j["text"].is_null();
  const bool has_ids = j.contains("input_ids") && !j["input_ids"].is_null();
  if (has_text == has_ids) bad("/generate", "give exactly one of input_ids and text");
  std::vector<std::vector<int64_t>> prompts;
  if (has_ids) {
    const auto& ids = j["input_ids"];
    if (!ids.is_array() || ids.empty()) bad("input_ids", "must be a non-empty list of token ids, or a list of such lists");
    g.batch = ids[0].is_array();
    if (g.batch)
      for (std::size_t i = 0; i < ids.size(); ++i)
        prompts.push_back(token_ids(ids[i], "input_ids[" + std::to_string(i) + "]", limits.vocab_size));
    else
      prompts.push_back(token_ids(ids, "input_ids", limits.vocab_size));
  } else {
    const auto& text = j["text"];
    if (!limits.tokenizer)
      bad("text", "needs a tokenizer: start kiln serve with --set task.tokenizer=PATH/tokenizer.json, or send input_ids");
    g.batch = text.is_array();
    std::vector<std::string> texts;
    if (text.is_string()) texts.push_back(text.get<std::string>());
    else if (text.is_array())
      for (std::size_t i = 0; i < text.size(); ++i) {
        if (!text[i].is_string()) bad("text[" + std::to_string(i) + "]", "must be a string");
        texts.push_back(text[i].get<std::string>());
      }
    else bad("text", "must be a string or a list of strings");
    for (std::size_t i = 0; i < texts.size(); ++i) {
      const auto at = g.batch ? "text[" + std::to_string(i) + "]" : std::string("text");
      try {
        prompts.push_back(limits.tokenizer->encode(texts[i]));
      } catch (const std::exception& e) {
        bad(at, std::string("cannot be encoded: ") + e.what());
      }
    }
  }
  if (prompts.empty()) bad(has_ids ? "input_ids" : "text", "must hold at least one prompt");
  for (std::size_t i = 0; i < prompts.size(); ++i)
    if (prompts[i].empty())
      bad(std::string(has_ids ? "input_ids" : "text") + (g.batch ? "[" + std::to_string(i) + "]" : ""),
          "is an empty prompt");
  const std::size_t N = prompts.size();
  // sampling_params: one object for all prompts, or a list of one per prompt
  std::vector<SamplingParams> sp(N);
  const json none = json::object();
  const json& s = j.contains("sampling_params") && !j["sampling_params"].is_null() ? j["sampling_params"] : none;
  if (s.is_array()) {
    if (s.size() != N)
      bad("sampling_params", "holds " + std::to_string(s.size()) + " objects for " + std::to_string(N) + " prompts");
    for (std::size_t i = 0; i < N; ++i) parse_sampling_params(s[i], "sampling_params[" + std::to_string(i) + "]", limits, sp[i]);
  } else {
    // (each prompt draws a random seed of its own unless sampling_seed gives one for all)
    for (std::size_t i = 0; i < N; ++i) parse_sampling_params(s, "sampling_params", limits, sp[i]);
  }
  if (j.contains("rid") && !j["rid"].is_null()) {
    const auto& r = j["rid"];
    if (r.is_string() && N == 1) g.rids.push_back(r.get<std::string>());
    else if (r.is_array() && r.size() == N)
      for (std::size_t i = 0; i < N; ++i) {
        if (!r[i].is_string()) bad("rid[" + std::to_string(i) + "]", "must be a string");
        g.rids.push_back(r[i].get<std::string>());
      }
    else bad("rid", "must be a string (one prompt) or a list of one string per prompt");
  }
  g.rids.resize(N);
  if (j.contains("return_logprob")) g.return_logprob = flag(j["return_logprob"], "return_logprob");
  if (j.contains("return_routed_experts")) g.return_routed_experts = flag(j["return_routed_experts"], "return_routed_experts");
  if (j.contains("return_topk_indices")) g.return_topk_indices = flag(j["return_topk_indices"], "return_topk_indices");
  if (g.return_topk_indices && limits.sparse_layers == 0)
    bad("return_topk_indices", "this model has no sparse-attention layers to report (num_sparse_layers 0 in "
                               "/get_model_info; glm5_next has them)");
  if (j.contains("return_text_in_logprobs"))
    g.return_text_in_logprobs = flag(j["return_text_in_logprobs"], "return_text_in_logprobs");
  if (j.contains("stream") && flag(j["stream"], "stream"))
    bad("stream", "kiln serve's /generate answers whole completions (stream from /v1/completions instead)");
  if (j.contains("logprob_start_len") && !j["logprob_start_len"].is_null() &&
      (j["logprob_start_len"].is_array() || integer(j["logprob_start_len"], "logprob_start_len") != -1))
    bad("logprob_start_len", "must be -1 (kiln serve returns the log-probs of output tokens only)");
  if (j.contains("top_logprobs_num") && !j["top_logprobs_num"].is_null() &&
      (j["top_logprobs_num"].is_array() || integer(j["top_logprobs_num"], "top_logprobs_num") != 0))
    bad("top_logprobs_num", "must be 0 (kiln serve returns the sampled token's log-prob only)");
  for (std::size_t i = 0; i < N; ++i) {
    const int64_t P = int64_t(prompts[i].size());
    if (sp[i].max_new_tokens > limits.context_tokens - P)  // not P + max_new_tokens: it may overflow
      bad(std::string(has_ids ? "input_ids" : "text") + (g.batch ? "[" + std::to_string(i) + "]" : ""),
          "the prompt of " + std::to_string(P) + " tokens with max_new_tokens " + std::to_string(sp[i].max_new_tokens) +
              " exceeds the server's context of " + std::to_string(limits.context_tokens) +
              " tokens (rollout.cache_blocks x rollout.block_size)");
    GenerationRequest q;
    q.prompt = std::move(prompts[i]);
    q.sampling = std::move(sp[i]);
    g.requests.push_back(std::move(q));
  }
  return g;
}

json generate_output(const Completion& c, const std::string& rid, const NativeGenerate& g, const Tokenizer* tokenizer,
                     double e2e_latency_s) {
  const int64_t n = int64_t(c.tokens.size());
  json meta = {{"id", rid},
               {"prompt_tokens", c.prompt.size()},
               {"completion_tokens", n},
               {"cached_tokens", 0},
               {"e2e_latency", e2e_latency_s},
               {"weight_version", std::to_string(c.policy_versions.empty() ? 0 : c.policy_versions.back())}};
  if (c.finish_reason == FinishReason::stop) meta["finish_reason"] = {{"type", "stop"}, {"matched", c.tokens.back()}};
  else meta["finish_reason"] = {{"type", "length"}, {"length", n}};
  if (g.return_logprob) {
    json lp = json::array();
    for (int64_t i = 0; i < n; ++i) {
      json text = nullptr;
      if (g.return_text_in_logprobs && tokenizer) text = tokenizer->decode(std::span<const int64_t>(&c.tokens[i], 1));
      lp.push_back(json::array({c.logprobs[i], c.tokens[i], text}));
    }
    meta["output_token_logprobs"] = std::move(lp);
    meta["output_token_entropies"] = c.entropies;
    meta["output_token_weight_versions"] = c.policy_versions;
  }
  if (g.return_routed_experts && c.routed_experts.defined()) {
    const auto e = c.routed_experts.to(torch::kInt32).contiguous();  // [P + n - 1, L, K]
    meta["routed_experts"] = base64_encode(std::string_view(static_cast<const char*>(e.data_ptr()), e.nbytes()));
  }
  if (g.return_topk_indices && c.topk_indices.defined()) {
    const auto k = c.topk_indices.to(torch::kInt32).contiguous();  // [P + n - 1, Ls, W]
    meta["topk_indices"] = base64_encode(std::string_view(static_cast<const char*>(k.data_ptr()), k.nbytes()));
  }
  return {{"text", tokenizer ? tokenizer->decode(c.tokens) : std::string()}, {"output_ids", c.tokens}, {"meta_info", meta}};
}

json parse_object(std::string_view body, const std::string& what, const std::vector<std::string>& allowed) {
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) return json::object();
  json j = parse_json(body, what);
  if (!j.is_object()) bad(what, "the body must be a JSON object");
  only_keys(j, what, allowed);
  return j;
}

std::string json_text(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_body(int status, const std::string& message) {
  return json_text(json{{"error", {{"message", message}, {"code", status}}}});
}

namespace {
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = uint32_t(uint8_t(bytes[i])) << 16 | uint32_t(uint8_t(bytes[i + 1])) << 8 | uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (const std::size_t rest = bytes.size() - i) {
    uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
    if (rest == 2) v |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) throw std::invalid_argument("base64: length " + std::to_string(text.size()) + " is not a multiple of 4");
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const char ch = text[i + k];
      const char* at = ch ? std::strchr(kAlphabet, ch) : nullptr;
      if (ch == '=' && i + 4 == text.size() && k >= 2) {
        ++pad;
        v <<= 6;
        continue;
      }
      if (!at || pad) throw std::invalid_argument("base64: character " + std::to_string(i + k) + " is not base64");
      v = v << 6 | uint32_t(at - kAlphabet);
    }
    out += char(v >> 16);
    if (pad < 2) out += char((v >> 8) & 255);
    if (pad < 1) out += char(v & 255);
  }
  return out;
}

}  // namespace kiln::rollout
