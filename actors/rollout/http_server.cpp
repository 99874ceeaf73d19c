#include "actors/rollout/http_server.hpp"

#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>

#include "actors/rollout/serve_context.hpp"

namespace kiln::rollout {

using nlohmann::json;

namespace {
// How long a stopping server waits for its handlers after SIGINT/SIGTERM (serve_http).
constexpr std::chrono::seconds kStopGrace{5};
}  // namespace

void answer(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(json_text(body), "application/json");
}

void answer_error(httplib::Response& res, int status, const std::string& message) {
  res.status = status;
  res.set_content(error_body(status, message), "application/json");
}

bool client_alive(ServeContext& c, const std::vector<uint64_t>& ids, httplib::DataSink& sink, const char* what,
                  const char* heartbeat) {
  if (sink.is_writable() && sink.write(heartbeat, std::strlen(heartbeat))) return true;
  for (auto id : ids) c.loop.cancel(id);
  std::fprintf(stderr, "kiln serve: a %s client disconnected; its %zu requests are cancelled\n", what, ids.size());
  return false;
}

void post(httplib::Server& svr, const std::string& path, PostHandler handle) {
  svr.Post(path, [handle = std::move(handle), path](const httplib::Request& req, httplib::Response& res,
                                                    const httplib::ContentReader& reader) {
    if (req.is_multipart_form_data()) {
      answer_error(res, 415, path + ": a multipart body is not served; send JSON (Content-Type: application/json)");
      return;
    }
    std::string body;
    const bool chunked = req.get_header_value("Transfer-Encoding").find("chunked") != std::string::npos;
    if (!chunked && req.has_header("Content-Length")) {  // RFC 9110 8.6: 1*DIGIT (httplib reads "-5" as 2^64 - 5)
      const auto length = req.get_header_value("Content-Length");
      if (length.empty() || !std::all_of(length.begin(), length.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
        answer_error(res, 400, path + ": Content-Length " + api::shown(nlohmann::json(length)) +
                                   " is not a byte count (decimal digits)");
        return;
      }
      if (length.size() > 19) {  // digits past int64, past the body limit too
        answer_error(res, 413, path + ": Content-Length " + api::shown(nlohmann::json(length)) + " is over the " +
                                   std::to_string(kMaxBodyBytes >> 20) + " MiB a body may have");
        return;
      }
    }
    if (chunked || req.has_header("Content-Length")) {
      bool over = false;
      const bool read = reader([&](const char* data, size_t n) {
        if (body.size() + n > kMaxBodyBytes) {
          over = true;
          return false;
        }
        body.append(data, n);
        return true;
      });
      if (over || res.status == 413) {
        answer_error(res, 413, path + ": the body is over " + std::to_string(kMaxBodyBytes >> 20) + " MiB");
        return;
      }
      if (!read) {
        answer_error(res, 400, path + ": the body could not be read (" + std::to_string(body.size()) + " bytes arrived; " +
                                   (chunked ? std::string("a chunked body that is malformed or cut short")
                                            : "Content-Length " + req.get_header_value("Content-Length")) + ")");
        return;
      }
    }
    handle(req, body, res);
  });
}

namespace {
using Clock = std::chrono::steady_clock;

// Waits for `tickets` while the client is there (a space every second checks that it is).
// Returns false (its requests cancelled) once the client is gone.
bool wait_while_connected(ServeContext& c, const std::vector<std::shared_ptr<Ticket>>& tickets,
                          const std::vector<uint64_t>& ids, httplib::DataSink& sink) {
  auto last_beat = Clock::now();
  for (std::size_t i = 0; i < tickets.size();) {
    if (tickets[i]->wait_for(std::chrono::milliseconds(100))) {
      ++i;
      continue;
    }
    if (Clock::now() - last_beat < std::chrono::seconds(1)) continue;
    last_beat = Clock::now();
    if (!client_alive(c, ids, sink, "/generate")) return false;
  }
  return true;
}

void generate(ServeContext& c, const std::string& body, httplib::Response& res) {
  auto g = std::make_shared<NativeGenerate>(parse_generate(body, c.limits));
  auto ids = std::make_shared<std::vector<uint64_t>>();
  const auto start = Clock::now();
  auto tickets = std::make_shared<std::vector<std::shared_ptr<Ticket>>>(c.loop.submit(g->requests, *ids));
  res.set_chunked_content_provider("application/json", [&c, g, tickets, ids, start](size_t, httplib::DataSink& sink) {
    if (!wait_while_connected(c, *tickets, *ids, sink)) return false;
    const double latency = std::chrono::duration<double>(Clock::now() - start).count();
    json out = json::array();
    for (std::size_t i = 0; i < tickets->size(); ++i) {
      auto done = (*tickets)[i]->completion();
      if (!done) {  // the status line is out already: the error travels in the body
        const auto body = error_body(500, "/generate: prompt " + std::to_string(i) + ": " + (*tickets)[i]->error());
        sink.write(body.data(), body.size());
        sink.done();
        return true;
      }
      out.push_back(generate_output(*done, g->rids[i], *g, c.tokenizer, latency));
    }
    const auto body = json_text(g->batch ? out : out[0]);
    sink.write(body.data(), body.size());
    sink.done();
    return true;
  });
}

std::string weight_version(ServeContext& c) { return std::to_string(c.loop.status().policy_version); }

void register_routes(httplib::Server& svr, ServeContext& c) {
  auto health = [](const httplib::Request&, httplib::Response& res) { res.status = 200; };
  svr.Get("/health", health);
  svr.Get("/health_generate", health);
  svr.Get("/get_model_info", [&c](const httplib::Request&, httplib::Response& res) {
    guarded(res, [&] {
      answer(res, 200,
             {{"model_path", c.options.model_path},
              {"tokenizer_path", c.options.tokenizer_path.empty() ? json(nullptr) : json(c.options.tokenizer_path)},
              {"is_generation", true},
              {"weight_version", weight_version(c)},
              {"vocab_size", c.limits.vocab_size},
              {"num_moe_layers", c.model->num_moe_layers()},
              {"experts_per_token", c.model->experts_per_token()},
              {"num_experts", c.model->num_experts()},
              {"num_sparse_layers", c.model->num_sparse_layers()},
              {"topk_width", c.model->topk_width()},
              {"context_tokens", c.limits.context_tokens}});
    });
  });
  svr.Get("/get_server_info", [&c](const httplib::Request&, httplib::Response& res) {
    guarded(res, [&] {
      const auto s = c.loop.status();
      const auto& o = c.loop.engine().options();
      answer(res, 200,
             {{"running_requests", s.running}, {"waiting_requests", s.waiting}, {"free_cache_blocks", s.free_blocks},
              {"cache_blocks", o.cache_blocks}, {"block_size", o.block_size}, {"max_batch", o.max_batch},
              {"paused", s.paused}, {"weight_version", std::to_string(s.policy_version)}});
    });
  });
  svr.Get("/get_weight_version", [&c](const httplib::Request&, httplib::Response& res) {
    guarded(res, [&] { answer(res, 200, {{"weight_version", weight_version(c)}}); });
  });
  post(svr, "/generate", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded(res, [&] { generate(c, body, res); });
  });
  post(svr, "/pause_generation", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded(res, [&] {
      const auto j = parse_object(body, "/pause_generation", {"mode"});
      std::string mode = "abort";  // SGLang's default
      if (j.contains("mode")) {
        if (!j["mode"].is_string()) throw ApiError(400, "/pause_generation.mode: must be a string");
        mode = j["mode"].get<std::string>();
      }
      if (mode != "abort" && mode != "retract" && mode != "in_place")
        throw ApiError(400, "/pause_generation.mode: must be \"abort\", \"retract\" or \"in_place\", got \"" + mode + "\"");
      int64_t aborted = 0;
      if (mode == "abort") aborted = c.loop.abort_all("aborted by /pause_generation");
      // retract and in_place alike: sequences keep their cache and continue after /continue_generation
      c.loop.call([](Engine& e) { e.pause(); });
      answer(res, 200, {{"success", true}, {"message", "paused (" + mode + ")"}, {"num_aborted_requests", aborted}});
    });
  });
  post(svr, "/continue_generation", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded(res, [&] {
      parse_object(body, "/continue_generation", {"torch_empty_cache"});
      c.loop.call([](Engine& e) { e.resume(); });
      answer(res, 200, {{"success", true}, {"message", "continued"}});
    });
  });
  post(svr, "/flush_cache", [&c](const httplib::Request&, const std::string&, httplib::Response& res) {
    guarded(res, [&] {
      const auto s = c.loop.status();
      if (s.running + s.waiting > 0)
        throw ApiError(400, "/flush_cache: " + std::to_string(s.running + s.waiting) +
                                " requests are in flight (kiln keeps no prefix cache; pages free as sequences end)");
      res.status = 200;
      res.set_content("Cache flushed.", "text/plain");
    });
  });
}
}  // namespace

int serve_http(EngineLoop& loop, std::shared_ptr<model::CausalLM> model, const Tokenizer* tokenizer,
               const ServeOptions& options) {
  const auto& o = loop.engine().options();
  WeightUpdateGroups groups(parallel::GroupOptions{options.weight_update_timeout, options.weight_update_timeout});
  ServeContext c{loop, model, tokenizer, options, {model->vocab_size(), o.cache_blocks * o.block_size, tokenizer, model->num_sparse_layers()}, &groups};
  httplib::Server svr;
  const ListenOptions& at = options.listen;
  const int threads = at.threads;
  svr.new_task_queue = [threads] { return new httplib::ThreadPool(std::size_t(threads)); };
  svr.set_payload_max_length(kMaxBodyBytes);
  register_routes(svr, c);
  register_weight_routes(svr, c);
  register_openai_routes(svr, c);
  // Errors cpp-httplib answers itself (no route, a request it cannot parse) get the same JSON
  // error body as the handlers' own (theirs already have a body and stay as they are).
  svr.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    answer_error(res, res.status,
                 res.status == 404 ? "no route " + req.method + " " + req.path + " (the routes: docs/serving.md)"
                                   : "the request could not be handled (HTTP " + std::to_string(res.status) + ")");
    return httplib::Server::HandlerResponse::Handled;
  }));
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    answer_error(res, 500, "internal error");
  });
  int listening = -1;  // the listening socket, whose backlog is raised below
  // SO_REUSEADDR only (a restarted server binds past the old one's TIME_WAIT connections).
  // cpp-httplib's default_socket_options sets SO_REUSEPORT, with which a second server on the
  // same port listened too and the kernel split the requests between the two.
  svr.set_socket_options([&listening](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listening = sock;
  });
  const int port = at.port == 0 ? svr.bind_to_any_port(at.host) : svr.bind_to_port(at.host, at.port) ? at.port : -1;
  // An IPv6 address in a URL goes in brackets (RFC 3986 §3.2.2).
  const std::string host = at.host.find(':') != std::string::npos ? "[" + at.host + "]" : at.host;
  if (port <= 0) {
    std::fprintf(stderr, "kiln serve: cannot listen on %s:%d\n", host.c_str(), at.port);
    return 2;
  }
  // cpp-httplib 0.11 listens with a backlog of 5: a burst of clients beyond it is refused or
  // reset. listen() again on the same socket sets the backlog to what the system allows.
  if (listening >= 0) ::listen(listening, SOMAXCONN);
  if (!at.port_file.empty()) {  // whole or not at all: written aside, then renamed
    const auto tmp = at.port_file + ".partial";
    std::error_code ec;
    bool written = bool(std::ofstream(tmp) << port << "\n");
    if (written) std::filesystem::rename(tmp, at.port_file, ec);
    if (!written || ec) {
      std::filesystem::remove(tmp, ec);
      std::fprintf(stderr, "kiln serve: cannot write the port file '%s'%s\n", at.port_file.c_str(),
                   written ? "" : " (its .partial could not be created)");
      return 2;
    }
  }
  std::fprintf(stderr, "kiln serve: listening on http://%s:%d\n", host.c_str(), port);
  // Stopping: generations are aborted at once, so their handlers answer and the pool drains. A
  // handler outside the engine (joining a weight-update group waits for its master up to
  // rollout.weight_update_timeout_s, and c10d cannot be interrupted) is abandoned after
  // kStopGrace: the process exits rather than outlive the signal by minutes.
  std::mutex stop_mutex;
  std::condition_variable stop_cv;
  bool drained = false;
  std::thread waiter([&] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    int sig = 0;
    sigwait(&set, &sig);
    loop.abort_all("the server is stopping");  // handlers waiting for samples answer, so the pool can stop
    svr.stop();
    std::unique_lock lock(stop_mutex);
    if (!stop_cv.wait_for(lock, kStopGrace, [&] { return drained; })) {
      std::fprintf(stderr,
                   "kiln serve: stopped; requests still running after %lld s (a weight-update group join or "
                   "broadcast, which waits up to rollout.weight_update_timeout_s) are abandoned\n",
                   (long long)kStopGrace.count());
      std::fflush(nullptr);
      std::_Exit(0);
    }
  });
  svr.listen_after_bind();
  {
    std::lock_guard lock(stop_mutex);
    drained = true;
  }
  stop_cv.notify_all();
  pthread_kill(waiter.native_handle(), SIGTERM);  // listening ended without a signal: end the waiter too
  waiter.join();
  std::fprintf(stderr, "kiln serve: stopped\n");
  return 0;
}

}  // namespace kiln::rollout
