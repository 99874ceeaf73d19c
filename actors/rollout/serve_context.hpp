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
#include "actors/rollout/weight_update_groups.hpp"

namespace kiln::rollout {

struct ServeContext {
  EngineLoop& loop;
  std::shared_ptr<model::CausalLM> model;
  const Tokenizer* tokenizer;
  const ServeOptions& options;
  ApiLimits limits;
  WeightUpdateGroups* weight_groups;  ///< the groups this server joined (weight_routes.cpp)
};

/// Bodies over this get a 413 with a message.
inline constexpr std::size_t kMaxBodyBytes = std::size_t(256) << 20;

/// A POST route's handler; `body` is the request's body as post() read it.
using PostHandler = std::function<void(const httplib::Request&, const std::string& body, httplib::Response&)>;

/// Registers POST `path`, reading the body itself rather than through cpp-httplib's reader: a
/// body is the same bytes whatever its Content-Type (curl -d sends JSON as
/// application/x-www-form-urlencoded, which cpp-httplib 0.11 refuses over 8 KiB with an empty
/// 413); a request with neither Content-Length nor Transfer-Encoding has no body (RFC 9112
/// 6.3; cpp-httplib would wait for the connection to close, then answer an empty 400); a body
/// over kMaxBodyBytes gets a 413, a multipart one a 415, a body that cannot be read a 400, each
/// with {"error": {"message"}}.
void post(httplib::Server& svr, const std::string& path, PostHandler handle);

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

/// Adds /update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed
/// and /destroy_weights_update_group (weight_routes.cpp).
void register_weight_routes(httplib::Server& svr, ServeContext& c);

/// Adds /v1/completions, /v1/chat/completions and /v1/models (openai_api.cpp).
void register_openai_routes(httplib::Server& svr, ServeContext& c);

}  // namespace kiln::rollout
