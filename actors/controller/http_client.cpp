#include "actors/controller/http_client.hpp"

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <thread>

#include <httplib.h>

namespace kiln::controller::http {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

Reply call(const std::string& url, const std::string& path, const std::string* body, int64_t timeout_s, int64_t retry_s) {
  std::optional<Clock::time_point> unreachable_since;
  double backoff_s = 0.1;
  for (;;) {
    const auto attempt = Clock::now();
    httplib::Client cli(url);
    cli.set_connection_timeout(5);
    cli.set_read_timeout(time_t(timeout_s));
    cli.set_write_timeout(time_t(timeout_s));
    auto r = body ? cli.Post(path.c_str(), *body, "application/json") : cli.Get(path.c_str());
    if (r) return {r->status, r->body};
    const auto what = httplib::to_string(r.error());
    if (Clock::now() - attempt >= std::chrono::seconds(timeout_s))
      throw std::runtime_error("rollout server " + url + ": " + path + ": no answer within rollout.http_timeout_s = " +
                               std::to_string(timeout_s) + " s (" + what + ")");
    if (!unreachable_since) unreachable_since = attempt;
    if (Clock::now() - *unreachable_since >= std::chrono::seconds(retry_s))
      throw std::runtime_error("rollout server " + url + ": " + path + ": " +
                               (retry_s > 0 ? "unreachable for " + std::to_string(retry_s) + " s (rollout.http_retry_s; " +
                                                  what + ")"
                                            : "no answer (" + what + "; not retried: the server may have acted on it)") +
                               ": the server is lost");
    std::this_thread::sleep_for(std::chrono::duration<double>(backoff_s));
    backoff_s = std::min(2.0, backoff_s * 2);
  }
}

json answer_json(const std::string& url, const std::string& path, const Reply& r) {
  json j;
  try {
    j = json::parse(r.body);
  } catch (const json::exception&) {
    if (r.status / 100 != 2)
      throw std::runtime_error("rollout server " + url + ": " + path + ": HTTP " + std::to_string(r.status) + ": " + r.body.substr(0, 300));
    throw std::runtime_error("rollout server " + url + ": " + path + ": the answer is not JSON: " + r.body.substr(0, 300));
  }
  if (r.status / 100 != 2 || (j.is_object() && j.contains("error"))) {
    const std::string msg = j.is_object() && j.contains("error") && j["error"].is_object() && j["error"].contains("message")
                                ? j["error"]["message"].dump()
                                : r.body.substr(0, 300);
    throw std::runtime_error("rollout server " + url + ": " + path + ": HTTP " + std::to_string(r.status) + ": " + msg);
  }
  return j;
}

}  // namespace kiln::controller::http
