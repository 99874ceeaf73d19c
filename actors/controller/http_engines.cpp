#include "actors/controller/http_engines.hpp"

#include "actors/controller/http_client.hpp"
#include "actors/controller/run_dir.hpp"

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "actors/rollout/http_api.hpp"
#include "model/checkpoint/safetensors.hpp"
#include "model/config_json.hpp"

namespace kiln::controller {

namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using http::answer_json;
using http::call;

json request_json(const rollout::GenerationRequest& q) {
  const auto& s = q.sampling;
  if (!s.stop_sequences.empty())  // SGLang stops on strings and token ids, not on id sequences
    throw std::logic_error("rollout.backend \"http\" sends stop_token_ids only; request " + std::to_string(q.id) +
                           " has stop sequences");
  return {{"max_new_tokens", s.max_new_tokens}, {"temperature", s.temperature}, {"top_p", s.top_p},
          {"top_k", s.top_k == 0 ? -1 : s.top_k},  {"stop_token_ids", s.stop_token_ids}, {"sampling_seed", s.seed},
          {"ignore_eos", true}};  // kiln's engine stops on the request's stop_token_ids only
}

// One /generate answer item as kiln's completion of `q` (checked: lengths, ids, versions).
rollout::Completion completion_of(const json& item, const rollout::GenerationRequest& q, const HttpEngines::Server& s,
                                  int64_t vocab, int64_t loaded_version) {
  const std::string who = "rollout server " + s.url + ": /generate: request " + std::to_string(q.id) + ": ";
  try {
    rollout::Completion c;
    c.id = q.id;
    c.prompt = q.prompt;
    c.tokens = item.at("output_ids").get<std::vector<int64_t>>();
    const auto& meta = item.at("meta_info");
    const auto n = c.tokens.size();
    if (n == 0) throw std::runtime_error("no output tokens");
    for (auto t : c.tokens)
      if (t < 0 || t >= vocab) throw std::runtime_error("output token " + std::to_string(t) + " outside the vocabulary");
    const auto& lp = meta.at("output_token_logprobs");
    if (lp.size() != n) throw std::runtime_error(std::to_string(lp.size()) + " log-probs for " + std::to_string(n) + " tokens");
    for (std::size_t i = 0; i < n; ++i) {
      if (lp[i].at(1).get<int64_t>() != c.tokens[i]) throw std::runtime_error("log-prob " + std::to_string(i) + " is of another token");
      c.logprobs.push_back(lp[i].at(0).get<float>());
    }
    c.entropies = meta.contains("output_token_entropies") ? meta["output_token_entropies"].get<std::vector<float>>()
                                                           : std::vector<float>(n, 0.0f);  // SGLang sends none
    if (meta.contains("output_token_weight_versions")) {
      c.policy_versions = meta["output_token_weight_versions"].get<std::vector<int64_t>>();
    } else {  // one version for the whole sample: SGLang's string, kiln's integers
      const auto& v = meta.at("weight_version");
      int64_t version = loaded_version;
      if (v.is_string()) {
        try {
          version = std::stoll(v.get<std::string>());
        } catch (const std::exception&) {
          // "default": the server's initial weights, which this backend replaced first
        }
      }
      c.policy_versions.assign(n, version);
    }
    if (c.entropies.size() != n || c.policy_versions.size() != n)
      throw std::runtime_error("entropies or weight versions do not match the " + std::to_string(n) + " tokens");
    const auto type = meta.at("finish_reason").at("type").get<std::string>();
    if (type != "stop" && type != "length") throw std::runtime_error("finish_reason " + type);
    c.finish_reason = type == "stop" ? rollout::FinishReason::stop : rollout::FinishReason::length;
    if (s.moe_layers > 0) {
      const auto bytes = rollout::base64_decode(meta.at("routed_experts").get<std::string>());
      const int64_t rows = int64_t(c.prompt.size() + n) - 1;
      const int64_t want = rows * s.moe_layers * s.experts_per_token * 4;
      if (int64_t(bytes.size()) != want)
        throw std::runtime_error("routed_experts holds " + std::to_string(bytes.size()) + " bytes, expected " +
                                 std::to_string(want) + " (int32 [" + std::to_string(rows) + ", " +
                                 std::to_string(s.moe_layers) + ", " + std::to_string(s.experts_per_token) + "])");
      c.routed_experts = torch::from_blob(const_cast<char*>(bytes.data()), {rows, s.moe_layers, s.experts_per_token}, torch::kInt32)
                             .to(torch::kInt64);  // a copy: the bytes go away
    }
    if (s.sparse_layers > 0 && s.topk_width > 0) {
      const auto bytes = rollout::base64_decode(meta.at("topk_indices").get<std::string>());
      const int64_t rows = int64_t(c.prompt.size() + n) - 1;
      const int64_t want = rows * s.sparse_layers * s.topk_width * 4;
      if (int64_t(bytes.size()) != want)
        throw std::runtime_error("topk_indices holds " + std::to_string(bytes.size()) + " bytes, expected " +
                                 std::to_string(want) + " (int32 [" + std::to_string(rows) + ", " +
                                 std::to_string(s.sparse_layers) + ", " + std::to_string(s.topk_width) + "])");
      c.topk_indices = torch::from_blob(const_cast<char*>(bytes.data()), {rows, s.sparse_layers, s.topk_width}, torch::kInt32)
                           .to(torch::kInt64);
    }
    return c;
  } catch (const json::exception& e) {
    throw std::runtime_error(who + "malformed answer: " + e.what());
  } catch (const std::exception& e) {  // a count, an id or base64 that does not fit
    throw std::runtime_error(who + e.what());
  }
}
}  // namespace

HttpEngines::HttpEngines(const Config& c, const fs::path& run_dir, int64_t vocab_size, RoutingShape routing)
    : group_size_(c.algorithm.samples_per_prompt), vocab_size_(vocab_size), timeout_s_(c.rollout.http_timeout_s),
      retry_s_(c.rollout.http_retry_s),
      weights_dir_(fs::absolute(c.rollout.weights_dir.empty() ? run_dir / kRolloutWeightsDir : fs::path(c.rollout.weights_dir))) {
  if (!c.model.checkpoint.empty() && fs::exists(fs::path(c.model.checkpoint) / "config.json"))
    config_json_ = model::config_json::read_config_json(c.model.checkpoint);
  for (auto url : c.rollout.urls) {
    while (!url.empty() && url.back() == '/') url.pop_back();
    Server s{url};
    const auto info = answer_json(url, "/get_model_info", call(url, "/get_model_info", nullptr, 60, retry_s_));
    if (info.contains("vocab_size") && info["vocab_size"].get<int64_t>() != vocab_size)
      throw std::runtime_error("rollout server " + url + ": its model has a vocabulary of " + info["vocab_size"].dump() +
                               " ids, the policy's has " + std::to_string(vocab_size));
    if (info.contains("num_moe_layers") && info.contains("experts_per_token")) {
      s.moe_layers = info["num_moe_layers"].get<int64_t>();
      s.experts_per_token = info["experts_per_token"].get<int64_t>();
      if (s.moe_layers != routing.layers || (s.moe_layers > 0 && s.experts_per_token != routing.per_token))
        throw std::runtime_error("rollout server " + url + ": its model routes " + std::to_string(s.experts_per_token) +
                                 " experts per token in " + std::to_string(s.moe_layers) +
                                 " MoE layers, the policy's " + std::to_string(routing.per_token) + " in " +
                                 std::to_string(routing.layers) + " (another model?)");
      // (kiln serve reports its experts; SGLang does not, and a server of another E is then
      // refused when the first weights reach it)
      if (s.moe_layers > 0 && info.contains("num_experts") && info["num_experts"].get<int64_t>() != routing.experts)
        throw std::runtime_error("rollout server " + url + ": its model has " + info["num_experts"].dump() +
                                 " routed experts, the policy's " + std::to_string(routing.experts) + " (another model?)");
    }
    if (info.contains("num_sparse_layers") && info.contains("topk_width")) {
      s.sparse_layers = info["num_sparse_layers"].get<int64_t>();
      s.topk_width = info["topk_width"].get<int64_t>();
    }
    servers_.push_back(s);
  }
  if (c.rollout.weight_update == "distributed") {
    std::vector<std::string> urls;
    for (const auto& s : servers_) urls.push_back(s.url);
    distributed_ = std::make_unique<DistributedWeightUpdate>(urls, c.rollout.weight_update_address,
                                                             torch::Device(c.model.device),
                                                             std::chrono::seconds(c.rollout.weight_update_timeout_s),
                                                             timeout_s_);
    distributed_->connect();
  }
}

std::vector<rollout::Completion> HttpEngines::generate_on(const Server& s, std::vector<rollout::GenerationRequest> share) const {
  json ids = json::array(), params = json::array(), rids = json::array();
  for (const auto& q : share) {
    ids.push_back(q.prompt);
    params.push_back(request_json(q));
    rids.push_back(std::to_string(q.id));
  }
  json body = {{"input_ids", ids}, {"sampling_params", params}, {"rid", rids}, {"return_logprob", true},
               {"return_routed_experts", s.moe_layers > 0}};
  if (s.sparse_layers > 0 && s.topk_width > 0) body["return_topk_indices"] = true;  // kiln serve's own field
  const auto text = body.dump();
  const auto items = answer_json(s.url, "/generate", call(s.url, "/generate", &text, timeout_s_, retry_s_));
  if (!items.is_array() || items.size() != share.size())
    throw std::runtime_error("rollout server " + s.url + ": /generate answered " +
                             (items.is_array() ? std::to_string(items.size()) + " completions" : std::string("no list")) +
                             " for " + std::to_string(share.size()) + " prompts");
  std::vector<rollout::Completion> out;
  for (std::size_t i = 0; i < share.size(); ++i) out.push_back(completion_of(items[i], share[i], s, vocab_size_, loaded_version_));
  return out;
}

std::vector<rollout::Completion> HttpEngines::generate(std::vector<rollout::GenerationRequest> requests,
                                                       const std::function<void()>& between_steps) {
  const auto shares = prompt_group_shares(requests.size(), group_size_, servers_.size());
  std::vector<std::future<std::vector<rollout::Completion>>> running;
  for (std::size_t i = 0; i < servers_.size(); ++i) {
    std::vector<rollout::GenerationRequest> share(requests.begin() + std::ptrdiff_t(shares[i].first),
                                                  requests.begin() + std::ptrdiff_t(shares[i].second));
    if (share.empty()) continue;
    running.push_back(std::async(std::launch::async, [this, &s = servers_[i], share = std::move(share)]() mutable {
      return generate_on(s, std::move(share));
    }));
  }
  for (auto& f : running)  // new weights reach the servers while they generate (staleness k > 0)
    while (f.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) between_steps();
  std::vector<rollout::Completion> out;
  std::string failed;
  for (auto& f : running) try {
      for (auto& c : f.get()) out.push_back(std::move(c));
    } catch (const std::exception& e) {
      if (failed.empty()) failed = e.what();  // the first server's failure; every share was waited for
    }
  if (!failed.empty()) throw std::runtime_error(failed);
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
  return out;
}

void HttpEngines::load(const PolicyWeights& w, TrainerHandle&) {
  if (distributed_) {
    distributed_->send(w);
    loaded_version_ = w.version;
    return;
  }
  const auto dir = weights_dir_ / ("version_" + std::to_string(w.version));
  fs::create_directories(dir);
  checkpoint::write_checkpoint(dir.string(), w.tensors, uint64_t(4) << 30);
  // The servers check it against their model (a short copy would be refused as not JSON).
  if (!config_json_.is_null()) model::config_json::write_config_json(dir.string(), config_json_);
  const std::string pause = json{{"mode", "in_place"}}.dump(), none = "{}";
  const std::string update = json{{"model_path", dir.string()}, {"weight_version", std::to_string(w.version)}}.dump();
  for (const auto& s : servers_) {
    answer_json(s.url, "/pause_generation", call(s.url, "/pause_generation", &pause, timeout_s_, retry_s_));
    const auto r = answer_json(s.url, "/update_weights_from_disk", call(s.url, "/update_weights_from_disk", &update, timeout_s_, retry_s_));
    if (!r.value("success", false))
      throw std::runtime_error("rollout server " + s.url + ": /update_weights_from_disk: " + r.value("message", r.dump()));
    answer_json(s.url, "/continue_generation", call(s.url, "/continue_generation", &none, timeout_s_, retry_s_));
  }
  loaded_version_ = w.version;
  for (const auto& e : fs::directory_iterator(weights_dir_))  // older versions: every server has this one
    if (e.path() != dir && e.path().filename().string().rfind("version_", 0) == 0) fs::remove_all(e.path());
}

}  // namespace kiln::controller
