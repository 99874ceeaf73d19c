// `kiln serve`'s weight endpoints (SGLang's): /update_weights_from_disk, and the weight-update
// group ones, /init_weights_update_group, /update_weights_from_distributed,
// /destroy_weights_update_group (weight_update_groups.hpp receives; this file checks the
// requests against the model and writes). Every update is applied whole between two engine
// steps, after all of it was read and checked, or not at all.
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>

#include "actors/rollout/serve_context.hpp"
#include "messaging/torch_tensor.hpp"
#include "model/checkpoint/safetensors.hpp"
#include "model/key_table.hpp"

namespace kiln::rollout {

using nlohmann::json;

namespace {

// kiln's versions are integers; SGLang sends strings. Absent or null: nullopt.
std::optional<int64_t> weight_version(const json& j, const std::string& what) {
  if (!j.contains("weight_version") || j["weight_version"].is_null()) return std::nullopt;
  const auto& v = j["weight_version"];
  std::string text = v.is_string() ? v.get<std::string>() : v.is_number_integer() ? v.dump() : "";
  // Decimal digits only ("+1", " 1", "-0" and a NUL inside are refused); past 2^63 - 1 refused, not capped.
  int64_t parsed = 0;
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  if (!digits || std::from_chars(text.data(), text.data() + text.size(), parsed).ec != std::errc())
    throw ApiError(400, what + ".weight_version: kiln's versions are integers >= 0, got " + api::shown(v));
  return parsed;
}

bool flag(const json& j, const std::string& key, const std::string& what, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return api::boolean(j[key], what + "." + key);
}

std::string text(const json& j, const std::string& key, const std::string& what, const std::string& fallback) {
  if (!j.contains(key) || j[key].is_null()) {
    if (fallback.empty()) api::bad(what + "." + key, "is required");
    return fallback;
  }
  if (!j[key].is_string() || j[key].get<std::string>().empty()) api::bad(what + "." + key, "must be a non-empty string");
  return j[key].get<std::string>();
}

// Between two engine steps: pauses, runs `write` (which checks before it writes anything),
// marks the weights as `version` (default: the current + 1) and resumes unless the engine was
// paused before or `keep_pause`. Returns the requests in flight, which continue with the new
// weights.
template <class Write>
int64_t apply_weights(ServeContext& c, std::optional<int64_t> version, bool keep_pause, Write write) {
  return c.loop.call([&](Engine& e) {
    if (!version && e.policy_version() == std::numeric_limits<int64_t>::max())
      throw ApiError(400, "weight_version: the weights are at version 2^63 - 1, which has no next one: give "
                          "weight_version");
    const bool was_paused = e.paused();
    e.pause();
    try {
      write();
    } catch (...) {
      if (!was_paused) e.resume();
      throw;
    }
    e.weights_written(version ? *version : e.policy_version() + 1);
    if (!was_paused && !keep_pause) e.resume();
    return int64_t(e.running() + e.waiting());
  });
}

std::string current_version(ServeContext& c) { return std::to_string(c.loop.status().policy_version); }

std::string shape_text(at::IntArrayRef shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// SGLang answers its weight endpoints {"success", "message"} (400 on failure); kiln's clients
// read {"error": {"message"}}: a failure carries both.
template <class F>
void guarded_update(httplib::Response& res, F handle) {
  auto fail = [&](int status, const std::string& message) {
    answer(res, status, {{"success", false}, {"message", message}, {"error", {{"message", message}, {"code", status}}}});
  };
  try {
    handle();
  } catch (const ApiError& e) {
    fail(e.status, e.what());
  } catch (const GroupBusy& e) {
    fail(409, e.what());
  } catch (const parallel::CollectiveError& e) {  // the trainer lost or stopped mid-update
    fail(400, e.what());
  } catch (const parallel::RendezvousError& e) {  // the trainer's address not reached
    fail(400, e.what());
  } catch (const std::invalid_argument& e) {
    fail(400, e.what());
  } catch (const c10::Error& e) {  // LibTorch's (an allocation that failed): without its C++ backtrace
    fail(500, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(500, e.what());
  }
}

void update_from_disk(ServeContext& c, const std::string& body, httplib::Response& res) {
  const std::string what = "/update_weights_from_disk";
  const auto j = parse_object(body, what,
                              {"model_path", "load_format", "weight_version", "abort_all_requests", "flush_cache",
                               "keep_pause", "is_async", "torch_empty_cache", "recapture_cuda_graph", "token_step"});
  if (!j.contains("model_path") || !j["model_path"].is_string() || j["model_path"].get<std::string>().empty())
    throw ApiError(400, what + ".model_path: must name an HF checkpoint directory");
  const auto path = j["model_path"].get<std::string>();
  if (!std::filesystem::is_directory(path)) throw ApiError(400, what + ".model_path: '" + path + "' is not a directory");
  if (j.contains("load_format") && !j["load_format"].is_null() &&
      (!j["load_format"].is_string() || (j["load_format"] != "auto" && j["load_format"] != "safetensors")))
    throw ApiError(400, what + ".load_format: kiln reads \"safetensors\" (or \"auto\")");
  const auto version = weight_version(j, what);
  const bool keep_pause = flag(j, "keep_pause", what, false);
  const auto model = c.model;
  try {  // a config.json of another model (its tensors may still fit): refused before anything changes
    model->check_hf_config(path);
  } catch (const std::exception& e) {
    throw ApiError(400, what + ".model_path: " + e.what());
  }
  if (flag(j, "abort_all_requests", what, false)) c.loop.abort_all("aborted by " + what);
  int64_t in_flight = 0;
  try {  // a checkpoint that does not fit is the client's fault: 400, naming the tensor
    in_flight = apply_weights(c, version, keep_pause, [&] { model->load_hf_checkpoint(path); });
  } catch (const checkpoint::CheckpointError& e) {
    throw ApiError(400, what + ".model_path: " + e.what());
  }
  answer(res, 200, {{"success", true},
                    {"message", "loaded '" + path + "' as weight version " + current_version(c)},
                    {"num_paused_requests", in_flight}});
}

void init_group(ServeContext& c, const std::string& body, httplib::Response& res) {
  const std::string what = "/init_weights_update_group";
  const auto j = parse_object(body, what, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"});
  parallel::TorchGroupAddress at;
  at.address = text(j, "master_address", what, "");
  if (at.address.empty()) api::bad(what + ".master_address", "is required (the trainer's host)");
  {  // a name or address that resolves to nothing is named now, not after the join's whole timeout
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(at.address.c_str(), nullptr, &hints, &found);
    if (found) ::freeaddrinfo(found);
    if (rc == EAI_AGAIN)
      api::bad(what + ".master_address", "'" + at.address + "' cannot be resolved now (" + ::gai_strerror(rc) +
                                             "): the name service did not answer; try again");
    if (rc != 0)
      api::bad(what + ".master_address", "'" + at.address + "' resolves to no address (" + ::gai_strerror(rc) + ")");
  }
  for (const char* k : {"master_port", "rank_offset", "world_size"})
    if (!j.contains(k) || j[k].is_null()) api::bad(what + "." + k, "is required");
  const int64_t port = api::integer(j["master_port"], what + ".master_port");
  const int64_t rank = api::integer(j["rank_offset"], what + ".rank_offset");
  const int64_t world = api::integer(j["world_size"], what + ".world_size");
  if (port < 1 || port > 65535) api::bad(what + ".master_port", "must be in 1..65535, got " + std::to_string(port));
  if (world < 2 || world > (1 << 20)) api::bad(what + ".world_size", "must be >= 2 (the trainer and this server), got " + std::to_string(world));
  // kiln serve is one rank (SGLang: rank_offset + its tensor-parallel rank; rank 0 is the trainer)
  if (rank < 1 || rank >= world)
    api::bad(what + ".rank_offset", "must be in 1..world_size-1 = " + std::to_string(world - 1) +
                                        " (rank 0 is the trainer), got " + std::to_string(rank));
  at.port = int(port);
  at.rank = int(rank);
  at.world_size = int(world);
  at.group_name = text(j, "group_name", what, "weight_update_group");
  const auto backend = text(j, "backend", what, "nccl");  // SGLang's default
  const auto model_device = c.model->parameters().front().device();
  torch::Device device(torch::kCPU);
  if (backend == "nccl") {
    if (!model_device.is_cuda())
      api::bad(what + ".backend", "\"nccl\" needs the model on a CUDA device; this server's model is on " +
                                      model_device.str() + ": use \"gloo\"");
    device = model_device;
  } else if (backend != "gloo") {
    api::bad(what + ".backend", "must be \"nccl\" or \"gloo\", got \"" + backend + "\"");
  }
  c.weight_groups->init(at, device);
  answer(res, 200, {{"success", true},
                    {"message", "joined group '" + at.group_name + "' as rank " + std::to_string(at.rank) + " of " +
                                    std::to_string(at.world_size) + " (" + backend + ")"}});
}

void destroy_group(ServeContext& c, const std::string& body, httplib::Response& res) {
  const std::string what = "/destroy_weights_update_group";
  const auto j = parse_object(body, what, {"group_name"});
  const auto name = text(j, "group_name", what, "weight_update_group");
  c.weight_groups->destroy(name);
  answer(res, 200, {{"success", true}, {"message", "left group '" + name + "'"}});
}

// The request's tensors, checked against the model's HF tensors: names known (or of a part the
// model skips: received and dropped), shapes equal, dtypes floating (each is cast to its
// parameter's dtype as checkpoint loads are).
std::vector<TensorSpec> update_specs(ServeContext& c, const json& j, const std::string& what,
                                     const std::map<std::string, torch::Tensor>& targets) {
  for (const char* k : {"names", "dtypes", "shapes"})
    if (!j.contains(k) || !j[k].is_array()) api::bad(what + "." + k, "must be a list");
  const auto &names = j["names"], &dtypes = j["dtypes"], &shapes = j["shapes"];
  if (names.empty()) api::bad(what + ".names", "must name at least one tensor");
  if (dtypes.size() != names.size() || shapes.size() != names.size())
    api::bad(what, std::to_string(names.size()) + " names, " + std::to_string(dtypes.size()) + " dtypes and " +
                       std::to_string(shapes.size()) + " shapes: one of each per tensor");
  std::vector<TensorSpec> specs;
  std::set<std::string> seen;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    if (!names[i].is_string() || names[i].get<std::string>().empty()) api::bad(what + ".names" + at, "must be a non-empty string");
    TensorSpec s;
    s.name = names[i].get<std::string>();
    if (!seen.insert(s.name).second) api::bad(what + ".names" + at, "'" + s.name + "' is named twice");
    if (!dtypes[i].is_string()) api::bad(what + ".dtypes" + at, "must be a string such as \"bfloat16\"");
    const auto dt = messaging::dtype_from_torch_name(dtypes[i].get<std::string>());
    if (!dt) api::bad(what + ".dtypes" + at, "'" + dtypes[i].get<std::string>() + "' (for '" + s.name + "') is not a torch dtype name");
    s.dtype = messaging::dtype_to_torch(*dt);
    if (!c10::isFloatingType(s.dtype) || c10::isFloat8Type(s.dtype))
      api::bad(what + ".dtypes" + at, "'" + dtypes[i].get<std::string>() + "' for '" + s.name +
                                          "': weights travel as float32, bfloat16, float16 or float64");
    if (!shapes[i].is_array()) api::bad(what + ".shapes" + at, "must be a list of sizes");
    for (std::size_t d = 0; d < shapes[i].size(); ++d) {
      const int64_t n = api::integer(shapes[i][d], what + ".shapes" + at + "[" + std::to_string(d) + "]");
      if (n < 0) api::bad(what + ".shapes" + at, "has a negative size " + std::to_string(n));
      s.shape.push_back(n);
    }
    auto t = targets.find(s.name);
    if (t == targets.end()) {
      if (!c.model->hf_key_skipped(s.name))
        api::bad(what + ".names" + at, "'" + s.name + "' is not a tensor of this model (" + c.options.model_path + ")");
    } else if (t->second.sizes() != at::IntArrayRef(s.shape)) {
      api::bad(what + ".shapes" + at, shape_text(s.shape) + " for '" + s.name + "': the model's is " +
                                          shape_text(t->second.sizes()));
    }
    specs.push_back(std::move(s));
  }
  return specs;
}

void update_from_distributed(ServeContext& c, const std::string& body, httplib::Response& res) {
  const std::string what = "/update_weights_from_distributed";
  const auto j = parse_object(body, what, {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                           "abort_all_requests", "weight_version", "load_format"});
  const auto group = text(j, "group_name", what, "weight_update_group");
  const auto names = c.weight_groups->names();
  if (std::find(names.begin(), names.end(), group) == names.end())
    api::bad(what + ".group_name", "'" + group + "': this server is in no such group (/init_weights_update_group first)");
  const auto model = c.model;
  std::optional<int64_t> version;
  bool abort = false;
  std::map<std::string, torch::Tensor> targets;
  std::vector<TensorSpec> specs;
  try {  // refused here, nothing was received
    if (j.contains("load_format") && !j["load_format"].is_null())
      api::bad(what + ".load_format", "kiln receives one broadcast per tensor (no load_format), got " + api::shown(j["load_format"]));
    version = weight_version(j, what);
    flag(j, "flush_cache", what, true);  // kiln keeps no prefix cache: nothing to flush
    abort = flag(j, "abort_all_requests", what, false);
    // The model's views, taken on the engine's thread (named_parameters walks the modules).
    targets = c.loop.call([&](Engine&) { return model->hf_targets(); });
    specs = update_specs(c, j, what, targets);
  } catch (const ApiError& e) {
    // A trainer broadcasts while its request is in flight (SGLang's protocol): its sends would
    // wait for this side until its timeout. Leaving the group fails them now.
    std::string left;
    try {
      c.weight_groups->destroy(group);
      left = "; this server left group '" + group + "' (a trainer broadcasting meanwhile fails at once): form it again";
    } catch (const std::exception&) {
      // busy with another update, or gone: that one decides
    }
    throw ApiError(e.status, e.what() + left);
  }
  const auto received = c.weight_groups->receive(group, specs);
  // Every tensor finite before any is written (as a load from disk checks them): a NaN weight
  // would turn every log-prob it touches into NaN. The broadcasts are complete, so the group
  // stays usable for the next update.
  for (std::size_t i = 0; i < specs.size(); ++i) {
    try {
      (void)model::checked("the broadcast", specs[i].name, received[i], received[i].sizes());
    } catch (const checkpoint::CheckpointError& e) {
      api::bad(what + ".names[" + std::to_string(i) + "]", std::string(e.what()) + "; nothing was written");
    }
  }
  if (abort) c.loop.abort_all("aborted by " + what);
  std::size_t written = 0;
  const int64_t in_flight = apply_weights(c, version, false, [&] {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      auto t = targets.find(specs[i].name);
      if (t == targets.end()) continue;  // a part the model does not build
      auto view = t->second;
      view.copy_(received[i]);
      ++written;
    }
  });
  answer(res, 200, {{"success", true},
                    {"message", "received " + std::to_string(specs.size()) + " tensors on group '" + group + "', wrote " +
                                    std::to_string(written) + ", as weight version " + current_version(c)},
                    {"weight_version", current_version(c)},
                    {"num_paused_requests", in_flight}});
}

}  // namespace

void register_weight_routes(httplib::Server& svr, ServeContext& c) {
  post(svr, "/update_weights_from_disk", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded(res, [&] { update_from_disk(c, body, res); });
  });
  post(svr, "/init_weights_update_group", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded_update(res, [&] { init_group(c, body, res); });
  });
  post(svr, "/update_weights_from_distributed", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded_update(res, [&] { update_from_distributed(c, body, res); });
  });
  post(svr, "/destroy_weights_update_group", [&c](const httplib::Request&, const std::string& body, httplib::Response& res) {
    guarded_update(res, [&] { destroy_group(c, body, res); });
  });
}

}  // namespace kiln::rollout
