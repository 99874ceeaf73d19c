#include "actors/controller/http_weight_update.hpp"

#include <future>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "actors/controller/http_client.hpp"
#include "messaging/torch_tensor.hpp"
#include "parallel/process_group.hpp"

namespace kiln::controller {

using nlohmann::json;

namespace {
// One request to every server at once; each answer (or the error naming its URL) per server.
std::vector<std::future<json>> post_all(const std::vector<std::string>& urls, const std::string& path,
                                        const std::vector<std::string>& bodies, int64_t timeout_s) {
  std::vector<std::future<json>> out;
  for (std::size_t i = 0; i < urls.size(); ++i)
    out.push_back(std::async(std::launch::async, [&url = urls[i], path, body = bodies[i], timeout_s] {
      // no retry: a request that reached the server may have started to receive
      const auto r = http::answer_json(url, path, http::call(url, path, &body, timeout_s, 0));
      if (!r.value("success", false))
        throw std::runtime_error("rollout server " + url + ": " + path + ": " + r.value("message", r.dump()));
      return r;
    }));
  return out;
}

// Waits for every answer; the errors, "; "-separated ("" when all succeeded).
std::string failures(std::vector<std::future<json>>& answers) {
  std::string failed;
  for (auto& a : answers) try {
      a.get();
    } catch (const std::exception& e) {
      failed += (failed.empty() ? "" : "; ") + std::string(e.what());
    }
  return failed;
}
}  // namespace

DistributedWeightUpdate::DistributedWeightUpdate(std::vector<std::string> urls, std::string address, torch::Device device,
                                                 std::chrono::seconds timeout, int64_t http_timeout_s)
    : urls_(std::move(urls)), address_(std::move(address)),
      device_(device.is_cuda() && !device.has_index() ? torch::Device(torch::kCUDA, 0) : device), timeout_(timeout),
      http_timeout_s_(http_timeout_s) {}

DistributedWeightUpdate::~DistributedWeightUpdate() = default;

void DistributedWeightUpdate::connect() {
  group_.reset();
  const std::string leave = json{{"group_name", kGroupName}}.dump();
  for (const auto& url : urls_) {  // a group of this name left over from an earlier run: leave it
    try {
      http::call(url, "/destroy_weights_update_group", &leave, http_timeout_s_, 0);
    } catch (const std::exception&) {
      // unreachable now: /init_weights_update_group below names it
    }
  }
  const int world = int(urls_.size()) + 1;
  const int port = parallel::free_loopback_port();
  std::vector<std::string> bodies;
  for (std::size_t i = 0; i < urls_.size(); ++i)
    bodies.push_back(json{{"master_address", address_}, {"master_port", port}, {"rank_offset", int(i) + 1},
                          {"world_size", world}, {"group_name", kGroupName},
                          {"backend", device_.is_cuda() ? "nccl" : "gloo"}}
                         .dump());
  auto answers = post_all(urls_, "/init_weights_update_group", bodies, http_timeout_s_);
  std::string mine;
  try {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout_);
    group_ = parallel::join_torch_group({address_, port, 0, world, kGroupName}, device_,
                                        parallel::GroupOptions{ms, ms, std::nullopt});
  } catch (const std::exception& e) {
    mine = e.what();
  }
  const auto failed = failures(answers);
  if (!failed.empty() || !mine.empty()) {
    group_.reset();
    throw std::runtime_error("rollout.weight_update \"distributed\": the group did not form: " + failed +
                             (mine.empty() ? "" : (failed.empty() ? "" : "; ") + std::string("controller: ") + mine));
  }
}

void DistributedWeightUpdate::send(const PolicyWeights& w) {
  if (!group_) connect();
  json names = json::array(), dtypes = json::array(), shapes = json::array();
  for (const auto& t : w.tensors) {
    names.push_back(t.name);
    dtypes.push_back(std::string(messaging::torch_dtype_name(t.dtype)));
    shapes.push_back(t.shape);
  }
  const std::string body = json{{"names", names}, {"dtypes", dtypes}, {"shapes", shapes}, {"group_name", kGroupName},
                                {"weight_version", std::to_string(w.version)}, {"flush_cache", true}}
                               .dump();
  auto answers = post_all(urls_, "/update_weights_from_distributed", std::vector<std::string>(urls_.size(), body),
                          http_timeout_s_);
  std::string mine;
  try {
    torch::NoGradGuard no_grad;
    for (const auto& t : w.tensors) {  // in the request's order, one at a time
      auto x = messaging::to_torch(t).to(torch::TensorOptions().device(device_), /*non_blocking=*/false, /*copy=*/true).contiguous();
      group_->broadcast(x, 0);
    }
  } catch (const std::exception& e) {
    mine = e.what();
    group_.reset();  // leaving at once fails servers still waiting now, not at their timeout
  }
  const auto failed = failures(answers);
  if (!failed.empty() || !mine.empty()) {
    group_.reset();
    throw std::runtime_error("weight update of version " + std::to_string(w.version) + " (rollout.weight_update " +
                             "\"distributed\"): " + failed +
                             (mine.empty() ? "" : (failed.empty() ? "" : "; ") + std::string("controller: ") + mine));
  }
}

}  // namespace kiln::controller
