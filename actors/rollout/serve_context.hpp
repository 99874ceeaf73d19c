#pragma once
// What the route handlers of `kiln serve` share (http_server.cpp: SGLang's native API;
// openai_api.cpp: the OpenAI-compatible one): the engine loop, the model, the tokenizer, the
// limits requests are checked against, and the helpers that answer. Internal to kiln_serve.
#include <functional>
#include <span>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "actors/rollout/chat_template.hpp"
#include "actors/rollout/http_api.hpp"
#include "actors/rollout/http_server.hpp"

namespace kiln::rollout {

struct ServeContext {
  EngineLoop& loop;
  std::shared_ptr<model::CausalLM> model;
  const Tokenizer* tokenizer;
  const ServeOptions& options;
  ApiLimits limits;
};

void answer(httplib::Response& res, int status, const nlohmann::json& body);
void answer_error(httplib::Response& res, int status, const std::string& message);

/// Runs `handle`, turning what it throws into an error answer: ApiError its status, another
/// std::invalid_argument (a checkpoint that does not fit, ...) 400, anything else 500.
template <class F>
void guarded(httplib::Response& res, F handle) {
  try {
    handle();
  } catch (const ApiError& e) {
    answer_error(res, e.status, e.what());
  } catch (const std::invalid_argument& e) {
    answer_error(res, 400, e.what());
  } catch (const std::exception& e) {
    answer_error(res, 500, e.what());
  }
}

/// Whether the client of `sink` is still there: false (after cancelling `ids`) once a write
/// fails. Call about once a second while waiting: each call sends `heartbeat` (a space before
/// a JSON body; an empty comment ":\n\n" between server-sent events).
bool client_alive(ServeContext& c, const std::vector<uint64_t>& ids, httplib::DataSink& sink, const char* what,
                  const char* heartbeat = " ");

/// Adds /v1/completions, /v1/chat/completions and /v1/models (openai_api.cpp).
void register_openai_routes(httplib::Server& svr, ServeContext& c);

}  // namespace kiln::rollout
