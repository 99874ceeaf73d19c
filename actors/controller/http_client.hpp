#pragma once
// The HTTP rollout backend's client side of one request to a server speaking SGLang's native
// API (http_engines.hpp, http_weight_update.hpp): retries while the server is unreachable, and
// reads the answer as JSON, turning an error answer into an exception naming the server.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace kiln::controller::http {

/// An answer: the HTTP status and the body.
struct Reply {
  int status = 0;
  std::string body;
};

/// GET (`body` null) or POST (`body` as application/json) url + path. An attempt that gets no
/// answer (connection refused or lost) is retried with backoff 0.1 s .. 2 s while the server has
/// been unreachable for less than `retry_s` (0: no retry); an attempt that outlives `timeout_s`
/// is not retried. Throws std::runtime_error naming the URL, the path and the limit that ran out
/// (rollout.http_timeout_s or rollout.http_retry_s: "the server is lost").
Reply call(const std::string& url, const std::string& path, const std::string* body, int64_t timeout_s, int64_t retry_s);

/// `r` as JSON. Throws std::runtime_error naming the server, the path and the server's message
/// for an answer that is not 2xx or holds {"error": {"message"}}, or that is not JSON.
nlohmann::json answer_json(const std::string& url, const std::string& path, const Reply& r);

}  // namespace kiln::controller::http
