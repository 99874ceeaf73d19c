// The OpenAI-compatible endpoints of `kiln serve`: /v1/completions, /v1/chat/completions (the
// task's chat template) and /v1/models, whole answers or streamed as server-sent events.
// Field names and shapes follow OpenAI's API reference (Completions, Chat Completions).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>

#include "actors/rollout/serve_context.hpp"

namespace kiln::rollout {

namespace {
using nlohmann::json;
using namespace api;
using Clock = std::chrono::steady_clock;

const std::vector<std::string> kCommon = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
                                          "stream_options", "stop", "seed", "user", "presence_penalty",
                                          "frequency_penalty", "logit_bias"};

struct OpenAiRequest {
  std::vector<GenerationRequest> requests;  ///< one per choice
  bool stream = false, include_usage = false, logprobs = false;
};

// The sampling keys both endpoints share, into `p` (defaults: OpenAI's max_tokens 16, temperature 1).
void sampling(const json& j, const std::string& what, ServeContext& c, SamplingParams& p, bool& stream, bool& usage) {
  auto field = [&](const char* k) { return what + "." + k; };
  p.max_new_tokens = 16;  // OpenAI's default
  sampling_fields(j, what, c.limits, "max_tokens", "seed", p);
  if (j.contains("max_completion_tokens") && !j["max_completion_tokens"].is_null()) {
    const int64_t n = integer(j["max_completion_tokens"], field("max_completion_tokens"));
    if (n < 1) bad(field("max_completion_tokens"), "must be >= 1, got " + std::to_string(n));
    if (j.contains("max_tokens") && !j["max_tokens"].is_null() && n != p.max_new_tokens)
      bad(field("max_completion_tokens"), "is " + std::to_string(n) + " but max_tokens is " +
                                              std::to_string(p.max_new_tokens) + ": send one of them (or the same value)");
    p.max_new_tokens = n;
  }
  for (const char* k : {"presence_penalty", "frequency_penalty"})
    if (j.contains(k) && !j[k].is_null() && number(j[k], field(k)) != 0) bad(field(k), "must be 0 (kiln applies no penalties)");
  if (j.contains("logit_bias") && !j["logit_bias"].is_null() && !j["logit_bias"].empty())
    bad(field("logit_bias"), "is not supported by kiln serve");
  if (j.contains("user") && !j["user"].is_null() && !j["user"].is_string()) bad(field("user"), "must be a string");
  if (j.contains("model") && !j["model"].is_null() && !j["model"].is_string()) bad(field("model"), "must be a string");
  p.stop_token_ids = c.tokenizer->eos_ids();  // the model's end tokens end a completion
  stream = j.contains("stream") && !j["stream"].is_null() && boolean(j["stream"], field("stream"));
  usage = false;
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const auto& o = j["stream_options"];
    if (!o.is_object()) bad(field("stream_options"), "must be an object");
    only_keys(o, field("stream_options"), {"include_usage"});
    usage = o.contains("include_usage") && boolean(o["include_usage"], field("stream_options.include_usage"));
    if (!stream) bad(field("stream_options"), "is only read with \"stream\": true (as OpenAI's API has it)");
  }
}

void check_fits(ServeContext& c, const GenerationRequest& q, const std::string& where) {
  const int64_t P = int64_t(q.prompt.size());
  if (P == 0) bad(where, "is an empty prompt");
  if (q.sampling.max_new_tokens > c.limits.context_tokens - P)  // not P + max_tokens: it may overflow
    bad(where, "the prompt of " + std::to_string(P) + " tokens with max_tokens " + std::to_string(q.sampling.max_new_tokens) +
                   " exceeds the server's context of " + std::to_string(c.limits.context_tokens) + " tokens");
}

OpenAiRequest parse_completion(std::string_view body, ServeContext& c) {
  const json j = parse_json(body, "/v1/completions");
  if (!j.is_object()) bad("/v1/completions", "the body must be a JSON object");
  auto keys = kCommon;
  for (const char* k : {"prompt", "logprobs", "echo", "suffix", "best_of"}) keys.push_back(k);
  only_keys(j, "/v1/completions", keys);
  OpenAiRequest r;
  SamplingParams p;
  sampling(j, "/v1/completions", c, p, r.stream, r.include_usage);
  if (j.contains("echo") && !j["echo"].is_null() && boolean(j["echo"], "/v1/completions.echo")) bad("/v1/completions.echo", "must be false");
  if (j.contains("suffix") && !j["suffix"].is_null()) bad("/v1/completions.suffix", "is not supported by kiln serve");
  if (j.contains("best_of") && !j["best_of"].is_null() && integer(j["best_of"], "/v1/completions.best_of") != 1)
    bad("/v1/completions.best_of", "must be 1");
  if (j.contains("logprobs") && !j["logprobs"].is_null()) {
    const int64_t n = integer(j["logprobs"], "/v1/completions.logprobs");
    if (n != 0) bad("/v1/completions.logprobs", "must be 0 (the sampled token's log-prob; no alternatives)");
    r.logprobs = true;
  }
  if (!j.contains("prompt") || j["prompt"].is_null()) bad("/v1/completions.prompt", "is required");
  const auto& pr = j["prompt"];
  std::vector<std::vector<int64_t>> prompts;
  auto text = [&](const json& t, const std::string& where) {
    if (!t.is_string()) bad(where, "must be a string, a list of strings, a list of token ids or a list of such lists");
    try {
      return c.tokenizer->encode(t.get<std::string>());
    } catch (const std::exception& e) {
      bad(where, std::string("cannot be encoded: ") + e.what());
    }
  };
  if (pr.is_string()) prompts.push_back(text(pr, "/v1/completions.prompt"));
  else if (pr.is_array() && !pr.empty() && pr[0].is_number())
    prompts.push_back(token_ids(pr, "/v1/completions.prompt", c.limits.vocab_size));
  else if (pr.is_array() && !pr.empty())
    for (std::size_t i = 0; i < pr.size(); ++i) {
      const auto at = "/v1/completions.prompt[" + std::to_string(i) + "]";
      prompts.push_back(pr[i].is_array() ? token_ids(pr[i], at, c.limits.vocab_size) : text(pr[i], at));
    }
  else bad("/v1/completions.prompt", "must be a string, a list of strings, a list of token ids or a list of such lists");
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest q{0, std::move(prompts[i]), p};
    q.sampling.seed = p.seed + i;  // one seed for the request: prompt i samples with seed + i
    std::string where = "/v1/completions.prompt";
    if (prompts.size() > 1) where.append("[").append(std::to_string(i)).append("]");  // (operator+ trips GCC 12's -Wstringop-overflow)
    check_fits(c, q, where);
    r.requests.push_back(std::move(q));
  }
  return r;
}

OpenAiRequest parse_chat(std::string_view body, ServeContext& c) {
  const json j = parse_json(body, "/v1/chat/completions");
  if (!j.is_object()) bad("/v1/chat/completions", "the body must be a JSON object");
  auto keys = kCommon;
  for (const char* k : {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}) keys.push_back(k);
  only_keys(j, "/v1/chat/completions", keys);
  if (!c.options.chat)
    bad("/v1/chat/completions", "needs a chat template: start kiln serve with --set task.tokenizer=PATH/tokenizer.json "
                                "--set task.chat_template=glm47 (or glm4)");
  OpenAiRequest r;
  SamplingParams p;
  sampling(j, "/v1/chat/completions", c, p, r.stream, r.include_usage);
  if (j.contains("logprobs") && !j["logprobs"].is_null()) r.logprobs = boolean(j["logprobs"], "/v1/chat/completions.logprobs");
  if (j.contains("top_logprobs") && !j["top_logprobs"].is_null() && integer(j["top_logprobs"], "/v1/chat/completions.top_logprobs") != 0)
    bad("/v1/chat/completions.top_logprobs", "must be 0 (the sampled token's log-prob; no alternatives)");
  if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty())
    bad("/v1/chat/completions.messages", "must be a non-empty list of {role, content}");
  std::vector<ChatMessage> messages;
  for (std::size_t i = 0; i < j["messages"].size(); ++i) {
    const auto& m = j["messages"][i];
    const auto at = "/v1/chat/completions.messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad(at, "must be an object {role, content}");
    only_keys(m, at, {"role", "content", "name"});
    if (!m.contains("role") || !m["role"].is_string()) bad(at + ".role", "must be \"system\", \"user\" or \"assistant\"");
    const auto role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      bad(at + ".role", "must be \"system\", \"user\" or \"assistant\", got \"" + role + "\"");
    if (m.contains("name") && !m["name"].is_null() && !m["name"].is_string()) bad(at + ".name", "must be a string");
    std::string content;
    static const json kNone;  // an lvalue: a temporary here copied the whole content (70000 levels overran the stack)
    const auto& ct = m.contains("content") ? m["content"] : kNone;
    if (ct.is_string()) content = ct.get<std::string>();
    else if (ct.is_array())  // content parts: text only
      for (std::size_t k = 0; k < ct.size(); ++k) {
        const auto part = at + ".content[" + std::to_string(k) + "]";
        // (value("type", "") throws a library type_error for a "type" that is not a string)
        const bool text_part = ct[k].is_object() && ct[k].contains("type") && ct[k]["type"].is_string() &&
                               ct[k]["type"].get_ref<const std::string&>() == "text";
        if (!text_part || !ct[k].contains("text") || !ct[k]["text"].is_string())
          bad(part, "must be {\"type\": \"text\", \"text\": ...} (kiln serve reads text only)");
        content += ct[k]["text"].get<std::string>();
      }
    else bad(at + ".content", "must be a string or a list of text parts");
    messages.push_back({role, content});
  }
  GenerationRequest q{0, c.options.chat(messages), p};
  check_fits(c, q, "/v1/chat/completions.messages");
  r.requests.push_back(std::move(q));
  return r;
}

std::string fresh_id(const char* prefix) {
  static std::atomic<uint64_t> next{1};
  return std::string(prefix) + std::to_string(std::time(nullptr)) + "-" + std::to_string(next++);
}

// The longest prefix of `text` that does not end inside a UTF-8 sequence (streamed text is
// sent up to there; the rest waits for the tokens that complete it).
std::size_t complete_utf8(const std::string& text) {
  std::size_t i = text.size(), back = 0;
  while (i > 0 && back < 4 && (uint8_t(text[i - 1]) & 0xC0) == 0x80) --i, ++back;
  if (i == 0) return text.size();
  const uint8_t lead = uint8_t(text[i - 1]);
  const std::size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
  return need == back + 1 || need == 1 ? text.size() : i - 1;
}

json usage_of(const std::vector<Completion>& done) {
  int64_t prompt = 0, completion = 0;
  for (const auto& d : done) {
    prompt += int64_t(d.prompt.size());
    completion += int64_t(d.tokens.size());
  }
  return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

// The answer's text (end tokens decode to nothing).
std::string text_of(ServeContext& c, const Completion& d) { return c.tokenizer->decode(d.tokens); }

void serve_openai(ServeContext& c, const std::string& body, httplib::Response& res, bool chat) {
  auto r = std::make_shared<OpenAiRequest>(chat ? parse_chat(body, c) : parse_completion(body, c));
  auto ids = std::make_shared<std::vector<uint64_t>>();
  auto tickets = std::make_shared<std::vector<std::shared_ptr<Ticket>>>(c.loop.submit(r->requests, *ids, r->stream));
  const std::string id = fresh_id(chat ? "chatcmpl-" : "cmpl-"), object = chat ? "chat.completion" : "text_completion";
  const auto created = int64_t(std::time(nullptr));
  const auto model = c.options.model_path;
  if (!r->stream) {
    res.set_chunked_content_provider("application/json", [&c, r, ids, tickets, id, object, created, model, chat](
                                                             size_t, httplib::DataSink& sink) {
      auto beat = Clock::now();
      for (std::size_t i = 0; i < tickets->size();) {
        if ((*tickets)[i]->wait_for(std::chrono::milliseconds(100))) ++i;
        else if (Clock::now() - beat >= std::chrono::seconds(1)) {
          beat = Clock::now();
          if (!client_alive(c, *ids, sink, chat ? "/v1/chat/completions" : "/v1/completions", " ")) return false;
        }
      }
      json choices = json::array();
      std::vector<Completion> done;
      for (std::size_t i = 0; i < tickets->size(); ++i) {
        auto d = (*tickets)[i]->completion();
        if (!d) {
          const auto body = error_body(500, (*tickets)[i]->error());
          sink.write(body.data(), body.size());
          sink.done();
          return true;
        }
        json choice = {{"index", i}, {"finish_reason", to_string(d->finish_reason)}};
        if (chat) choice["message"] = {{"role", "assistant"}, {"content", text_of(c, *d)}};
        else choice["text"] = text_of(c, *d);
        if (r->logprobs) {
          json tokens = json::array(), lps = json::array();
          for (std::size_t k = 0; k < d->tokens.size(); ++k) {
            tokens.push_back(c.tokenizer->decode(std::span<const int64_t>(&d->tokens[k], 1)));
            lps.push_back(d->logprobs[k]);
          }
          if (chat) {
            json content = json::array();
            for (std::size_t k = 0; k < d->tokens.size(); ++k)
              content.push_back({{"token", tokens[k]}, {"logprob", lps[k]}, {"top_logprobs", json::array()}});
            choice["logprobs"] = {{"content", content}};
          } else {
            choice["logprobs"] = {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", nullptr}, {"text_offset", nullptr}};
          }
        } else {
          choice["logprobs"] = nullptr;
        }
        choices.push_back(std::move(choice));
        done.push_back(std::move(*d));
      }
      const auto body = json_text(json{{"id", id}, {"object", object}, {"created", created}, {"model", model},
                             {"choices", choices}, {"usage", usage_of(done)}});
      sink.write(body.data(), body.size());
      sink.done();
      return true;
    });
    return;
  }
  // Server-sent events: a chunk per step that produced text, a last one per choice with its
  // finish_reason, the usage when asked, then [DONE].
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream", [&c, r, ids, tickets, id, created, model, chat](
                                                            size_t, httplib::DataSink& sink) {
    const std::string object = chat ? "chat.completion.chunk" : "text_completion";
    auto event = [&](const json& choice) {
      const auto text = "data: " + json_text(json{{"id", id}, {"object", object}, {"created", created}, {"model", model},
                                        {"choices", json::array({choice})}}) + "\n\n";
      return sink.write(text.data(), text.size());
    };
    std::vector<Completion> done;
    for (std::size_t i = 0; i < tickets->size(); ++i) {
      auto& t = *(*tickets)[i];
      std::size_t seen = 0, text_sent = 0;
      bool first = true;
      auto beat = Clock::now();
      for (;;) {
        t.tokens_from(seen, std::chrono::milliseconds(200));  // waits for a token, or the end
        const bool finished = t.wait_for(std::chrono::milliseconds(0));
        const auto all = t.tokens_from(0, std::chrono::milliseconds(0));
        if (all.size() > seen || finished) {
          seen = all.size();
          const auto text = c.tokenizer->decode(all);  // end tokens decode to nothing
          const std::size_t upto = finished ? text.size() : complete_utf8(text);
          if (upto > text_sent) {
            json delta = {{"content", text.substr(text_sent, upto - text_sent)}};
            if (chat && first) delta["role"] = "assistant";
            json choice = chat ? json{{"index", i}, {"delta", delta}, {"finish_reason", nullptr}}
                               : json{{"index", i}, {"text", delta["content"]}, {"finish_reason", nullptr}, {"logprobs", nullptr}};
            if (!event(choice)) {
              for (auto x : *ids) c.loop.cancel(x);
              return false;
            }
            first = false;
            text_sent = upto;
            beat = Clock::now();
          }
        }
        if (finished) break;
        if (Clock::now() - beat >= std::chrono::seconds(1)) {
          beat = Clock::now();
          if (!client_alive(c, *ids, sink, chat ? "/v1/chat/completions" : "/v1/completions", ":\n\n")) return false;
        }
      }
      auto d = t.completion();
      if (!d) {
        const auto text = "data: " + error_body(500, t.error()) + "\n\n";
        sink.write(text.data(), text.size());
        sink.done();
        return true;
      }
      json last = chat ? json{{"index", i}, {"delta", json::object()}, {"finish_reason", to_string(d->finish_reason)}}
                       : json{{"index", i}, {"text", ""}, {"finish_reason", to_string(d->finish_reason)}, {"logprobs", nullptr}};
      if (!event(last)) return false;
      done.push_back(std::move(*d));
    }
    if (r->include_usage) {
      const auto text = "data: " + json_text(json{{"id", id}, {"object", object}, {"created", created}, {"model", model},
                                        {"choices", json::array()}, {"usage", usage_of(done)}}) + "\n\n";
      sink.write(text.data(), text.size());
    }
    sink.write("data: [DONE]\n\n", 14);
    sink.done();
    return true;
  });
}
}  // namespace

void register_openai_routes(httplib::Server& svr, ServeContext& c) {
  post(svr, "/v1/completions", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded(res, [&] { serve_openai(c, body, res, false); });
  });
  post(svr, "/v1/chat/completions", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded(res, [&] { serve_openai(c, body, res, true); });
  });
  svr.Get("/v1/models", [&c](const httplib::Request&, httplib::Response& res) {
    answer(res, 200, {{"object", "list"},
                      {"data", json::array({{{"id", c.options.model_path}, {"object", "model"}, {"created", 0},
                                             {"owned_by", "kiln"}}})}});
  });
}

}  // namespace kiln::rollout
