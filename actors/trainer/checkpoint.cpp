#include "actors/trainer/checkpoint.hpp"

#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace kiln::trainer {

namespace {
// A data-parallel trainer's optimizer state and masters are sharded over its ranks: saving one
// rank's shard as if it were the whole state, or loading a whole state into a shard, would make
// a checkpoint that resumes wrong without saying so.
void refuse_sharded(const Trainer& trainer, const char* what, const std::filesystem::path& dir) {
  if (const auto* dp = trainer.data_parallel())
    throw std::invalid_argument(std::string(what) + " '" + dir.string() + "': the trainer is data-parallel (group '" +
                                dp->name() + "', " + std::to_string(dp->size()) +
                                " ranks) with sharded optimizer state, and sharded checkpoints are not supported yet");
}
}  // namespace

void save_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer,
                     const CheckpointState& state) {
  refuse_sharded(trainer, "save_checkpoint", dir);
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
  return st;
}

CheckpointState load_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer) {
  refuse_sharded(trainer, "load_checkpoint", dir);
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
