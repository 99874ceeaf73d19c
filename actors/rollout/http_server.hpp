#pragma once
// `kiln serve`: the in-process engine (engine.hpp, driven by an EngineLoop) behind HTTP
// (cpp-httplib, Debian's libcpp-httplib-dev), speaking SGLang's native API (http_api.hpp):
//   POST /generate                  input_ids or text + sampling_params -> output ids, log-probs,
//                                   routed experts, meta_info.weight_version
//   GET  /health, /health_generate  200 while serving
//   GET  /get_model_info            model_path, weight_version, and kiln's vocab_size,
//                                   num_moe_layers, experts_per_token, num_experts, context_tokens
//   GET  /get_server_info           the engine's state: running, waiting, free cache pages
//   GET  /get_weight_version        {"weight_version": "V"}
//   POST /pause_generation          {"mode": "abort" | "retract" | "in_place"}
//   POST /continue_generation
//   POST /flush_cache               kiln keeps no prefix cache: succeeds while nothing runs
//   POST /update_weights_from_disk  {"model_path": HF checkpoint dir, "weight_version": "V"}
//   POST /init_weights_update_group, /update_weights_from_distributed,
//        /destroy_weights_update_group   weights broadcast by a trainer over a c10d group
//                                   (Gloo or NCCL) that this server joins (weight_routes.cpp)
// and OpenAI's /v1/completions, /v1/chat/completions (streamed as server-sent events too) and
// /v1/models (openai_api.cpp).
// Every request is handled on its own thread of a pool; /generate requests join the engine's
// running batch (continuous batching). A bad request gets a 4xx with {"error": {"message"}}
// naming the field, and the server goes on. A /generate whose client disconnects is cancelled
// (its cache pages freed) within about a second: the answer is sent chunked, led by a space
// every second while it waits (JSON allows leading whitespace), which fails once the peer is gone.
// docs/serving.md is the user's page.
#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "actors/rollout/chat_template.hpp"
#include "actors/rollout/engine_loop.hpp"
#include "actors/rollout/tokenizer.hpp"
#include "model/causal_lm.hpp"

namespace kiln::rollout {

/// Where and how the server listens (`kiln serve --host --port --port-file --threads`).
struct ListenOptions {
  std::string host = "127.0.0.1";
  int port = 30000;        ///< 0: a free port (printed, and written to port_file)
  std::string port_file;   ///< where the bound port is written once listening ("": nowhere)
  int threads = 128;       ///< HTTP worker threads: requests handled at once
};

struct ServeOptions {
  ListenOptions listen;
  std::string model_path;  ///< what /get_model_info calls the model
  std::string tokenizer_path;
  /// Joining a weight-update group (every rank meeting) and each broadcast of an update may
  /// take this long; a trainer lost or stopped mid-update fails it within this.
  std::chrono::milliseconds weight_update_timeout = std::chrono::minutes(10);
  /// The ids of a chat's turns with the generation prompt (/v1/chat/completions); empty: the
  /// server has no chat template and refuses chats.
  std::function<std::vector<int64_t>(std::span<const ChatMessage>)> chat;
};

/// Serves `model` (whose engine `loop` drives) until SIGINT or SIGTERM, which the caller must
/// have blocked in every thread (this function waits for them with sigwait). On the signal the
/// engine's requests are aborted and answered; a handler still running 5 s later (a
/// weight-update group join, which c10d cannot interrupt) is abandoned: the process exits 0. `tokenizer`
/// (may be null) encodes "text" prompts and decodes outputs. Returns 0 after a signal, 2 when
/// the address cannot be bound or the port file cannot be written (reported on stderr).
int serve_http(EngineLoop& loop, std::shared_ptr<model::CausalLM> model, const Tokenizer* tokenizer,
               const ServeOptions& options);

}  // namespace kiln::rollout
