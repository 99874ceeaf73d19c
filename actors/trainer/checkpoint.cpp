#include "actors/trainer/checkpoint.hpp"

#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace kiln::trainer {

namespace {
constexpr const char* kInFlightFile = "in_flight_rollouts.msgpack";
}

void save_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer,
                     const CheckpointState& state) {
  namespace fs = std::filesystem;
  // Written beside the target, then renamed into place: a writer that dies midway leaves a
  // ".partial" directory, never a checkpoint directory that lacks files.
  fs::path tmp = dir;
  tmp += ".partial";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  policy.save_hf_checkpoint(tmp.string(), uint64_t(5) << 30);
  torch::save(trainer.optimizer(), (tmp / "optimizer.pt").string());
  // bf16 policies: the fp32 master weights too, or a resumed run would restart from rounded ones.
  if (trainer.uses_master_weights()) torch::save(trainer.master_parameters(), (tmp / "master_weights.pt").string());
  if (!state.in_flight_rollouts.empty()) {
    std::ofstream out(tmp / kInFlightFile, std::ios::binary);
    out.write(state.in_flight_rollouts.data(), std::streamsize(state.in_flight_rollouts.size()));
    if (!out.flush()) throw std::runtime_error("cannot write '" + (tmp / kInFlightFile).string() + "'");
  }
  nlohmann::json j{{"step", state.step}, {"policy_version", trainer.version()}, {"prompt_rng", state.prompt_rng}};
  {
    std::ofstream out(tmp / "state.json");
    out << j.dump(2) << "\n";
    if (!out.flush()) throw std::runtime_error("cannot write '" + (tmp / "state.json").string() + "'");
  }
  fs::remove_all(dir);  // an older checkpoint of the same step (a re-run after a resume)
  fs::rename(tmp, dir);
}

CheckpointState read_checkpoint_state(const std::filesystem::path& dir) {
  std::ifstream in(dir / "state.json");
  if (!in) throw std::invalid_argument("no state.json in '" + dir.string() + "'");
  CheckpointState st;
  try {
    auto j = nlohmann::json::parse(in);
    st.step = j.at("step").get<int64_t>();
    st.policy_version = j.at("policy_version").get<int64_t>();
    st.prompt_rng = j.at("prompt_rng").get<std::string>();
  } catch (const std::exception& e) {
    throw std::invalid_argument("state.json in '" + dir.string() + "': " + e.what());
  }
  if (std::filesystem::exists(dir / kInFlightFile)) {
    std::ifstream f(dir / kInFlightFile, std::ios::binary);
    st.in_flight_rollouts.assign(std::istreambuf_iterator<char>(f), {});
    if (!f && !f.eof()) throw std::invalid_argument("cannot read '" + (dir / kInFlightFile).string() + "'");
  }
  return st;
}

CheckpointState load_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer) {
  auto st = read_checkpoint_state(dir);
  policy.load_hf_checkpoint(dir.string());
  // LibTorch's errors carry a C++ backtrace: keep the message, name the file.
  auto load = [&](const char* file, auto& into) {
    try {
      torch::load(into, (dir / file).string());
    } catch (const c10::Error& e) {
      throw std::invalid_argument(std::string(file) + " in '" + dir.string() + "' cannot be read: " +
                                  e.what_without_backtrace());
    }
  };
  load("optimizer.pt", trainer.optimizer());
  trainer.reload_master_weights();
  if (trainer.uses_master_weights() && std::filesystem::exists(dir / "master_weights.pt")) {
    std::vector<torch::Tensor> saved;
    load("master_weights.pt", saved);
    const auto& masters = trainer.master_parameters();
    if (saved.size() != masters.size())
      throw std::invalid_argument("master_weights.pt in '" + dir.string() + "' holds " + std::to_string(saved.size()) +
                                  " tensors, the policy " + std::to_string(masters.size()));
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < saved.size(); ++i) masters[i].copy_(saved[i]);
  }
  trainer.set_version(st.policy_version);
  return st;
}

}  // namespace kiln::trainer
