#include "actors/trainer/checkpoint.hpp"

#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

namespace kiln::trainer {

namespace {

// A data-parallel rank's optimizer file: its flat range, masters, moments and step counts.
std::string shard_file(int rank, int ranks) {
  char name[64];
  std::snprintf(name, sizeof name, "optimizer_shard_%05d_of_%05d.pt", rank, ranks);
  return name;
}

// The controller's rollouts in flight (CheckpointState::in_flight_rollouts), when there are any.
void write_in_flight(const std::filesystem::path& dir, const std::string& bytes) {
  if (bytes.empty()) return;
  std::ofstream out(dir / kInFlightRolloutsFile, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out.flush()) throw std::runtime_error("cannot write '" + (dir / kInFlightRolloutsFile).string() + "'");
}

// `in_flight_bytes`: the size of in_flight_rollouts.msgpack (0: none), so that a reader notices
// the file missing, emptied or cut short.
void write_state_json(const std::filesystem::path& dir, int64_t step, int64_t version, const std::string& rng,
                      std::size_t in_flight_bytes) {
  nlohmann::json j{{"step", step}, {"policy_version", version}, {"prompt_rng", rng}};
  if (in_flight_bytes > 0) j["in_flight_rollouts_bytes"] = in_flight_bytes;
  std::ofstream out(dir / "state.json");
  out << j.dump(2) << "\n";
  if (!out.flush()) throw std::runtime_error("cannot write '" + (dir / "state.json").string() + "'");
}

// LibTorch's errors carry a C++ backtrace: keep the message, name the file.
template <typename T>
void load_file(const std::filesystem::path& dir, const std::string& file, T& into) {
  try {
    torch::load(into, (dir / file).string());
  } catch (const c10::Error& e) {
    throw std::invalid_argument(file + " in '" + dir.string() + "' cannot be read: " + e.what_without_backtrace());
  }
}

// Collective over the trainer's data-parallel group: rank 0 writes the policy (every rank holds
// all of it) and state.json, every rank its optimizer shard; the directory is renamed into
// place once every rank has written. The ranks must share the filesystem that holds `dir`.
void save_sharded(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer,
                  const CheckpointState& state, parallel::Group& dp) {
  namespace fs = std::filesystem;
  fs::path tmp = dir;
  tmp += ".partial";
  if (dp.rank() == 0) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  dp.barrier();
  if (dp.rank() == 0) {
    policy.save_hf_checkpoint(tmp.string(), uint64_t(5) << 30);
    write_in_flight(tmp, state.in_flight_rollouts);
    write_state_json(tmp, state.step, trainer.version(), state.prompt_rng, state.in_flight_rollouts.size());
  }
  const auto st = trainer.flat_optimizer_state();
  std::vector<torch::Tensor> record{torch::tensor({st.begin, trainer.flat_numel()}, torch::kInt64), st.master,
                                    st.exp_avg, st.exp_avg_sq, st.steps};
  torch::save(record, (tmp / shard_file(dp.rank(), dp.size())).string());
  dp.barrier();
  if (dp.rank() == 0) {
    fs::remove_all(dir);
    fs::rename(tmp, dir);
  }
  dp.barrier();  // no rank returns before the checkpoint exists
}

// The optimizer shards of `dir` that overlap this rank's flat range, written by W ranks.
std::vector<FlatAdamWState> read_shards(const std::filesystem::path& dir, Trainer& trainer, int ranks) {
  const int64_t n = trainer.flat_numel(), per = (n + ranks - 1) / ranks;
  const auto [begin, end] = trainer.flat_range();
  std::vector<FlatAdamWState> parts;
  for (int r = 0; r < ranks; ++r) {
    if (std::min(n, (r + 1) * per) <= begin || std::min(n, r * per) >= end) continue;
    const auto file = shard_file(r, ranks);
    std::vector<torch::Tensor> record;
    load_file(dir, file, record);
    if (record.size() != 5 || record[0].numel() != 2)
      throw std::invalid_argument(file + " in '" + dir.string() + "' holds " + std::to_string(record.size()) +
                                  " tensors, not an optimizer shard's 5");
    if (record[0][1].item<int64_t>() != n || record[4].numel() != int64_t(trainer.policy().parameters().size()))
      throw std::invalid_argument(file + " in '" + dir.string() + "' is of a policy of " +
                                  std::to_string(record[0][1].item<int64_t>()) + " elements in " +
                                  std::to_string(record[4].numel()) + " parameters, this one has " + std::to_string(n) +
                                  " in " + std::to_string(trainer.policy().parameters().size()));
    parts.push_back(FlatAdamWState{record[0][0].item<int64_t>(), record[1], record[2], record[3], record[4]});
  }
  return parts;
}

// The number of ranks whose optimizer shards `dir` holds (0: none), checking that each is there.
int shard_count(const std::filesystem::path& dir) {
  int ranks = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    int r = 0, w = 0;
    if (std::sscanf(entry.path().filename().c_str(), "optimizer_shard_%d_of_%d.pt", &r, &w) == 2) ranks = w;
  }
  for (int r = 0; r < ranks; ++r)
    if (!std::filesystem::exists(dir / shard_file(r, ranks)))
      throw std::invalid_argument("'" + dir.string() + "' lacks " + shard_file(r, ranks) + " of its " +
                                  std::to_string(ranks) + " optimizer shards");
  return ranks;
}

// A one-rank checkpoint's optimizer.pt (and master_weights.pt) as flat state over all elements:
// loaded into a one-rank AdamW over fp32 copies of the policy's parameters.
FlatAdamWState read_whole_optimizer(const std::filesystem::path& dir, Trainer& trainer) {
  std::vector<torch::Tensor> masters;
  for (const auto& p : trainer.policy().parameters()) masters.push_back(p.detach().to(torch::kFloat32).clone());
  if (std::filesystem::exists(dir / "master_weights.pt")) {
    std::vector<torch::Tensor> saved;
    load_file(dir, "master_weights.pt", saved);
    if (saved.size() != masters.size())
      throw std::invalid_argument("master_weights.pt in '" + dir.string() + "' holds " + std::to_string(saved.size()) +
                                  " tensors, the policy " + std::to_string(masters.size()));
    masters = saved;
  }
  torch::optim::AdamW adamw(masters);
  load_file(dir, "optimizer.pt", adamw);
  std::vector<FlatPiece> pieces;
  int64_t offset = 0;
  for (std::size_t i = 0; i < masters.size(); ++i) {
    pieces.push_back(FlatPiece{i, offset, masters[i]});
    offset += masters[i].numel();
  }
  return read_flat_state(adamw, pieces, 0, offset, masters.size());
}

// Expert-parallel trainers hold a slice of the experts and two flat indices (dense, experts);
// their checkpoints are not written yet: refused by name, before anything is read or written.
void refuse_expert_parallel(const Trainer& trainer, const char* what, const std::filesystem::path& dir) {
  if (const auto* ep = trainer.expert_parallel().experts)
    throw std::invalid_argument(std::string(what) + " '" + dir.string() + "': the trainer is expert-parallel (ep group '" +
                                ep->name() + "', " + std::to_string(ep->size()) +
                                " ranks), whose checkpoints kiln does not write or load yet");
}

}  // namespace

void save_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer,
                     const CheckpointState& state) {
  refuse_expert_parallel(trainer, "save_checkpoint", dir);
  if (auto* dp = trainer.data_parallel()) return save_sharded(dir, policy, trainer, state, *dp);
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
  write_in_flight(tmp, state.in_flight_rollouts);
  write_state_json(tmp, state.step, trainer.version(), state.prompt_rng, state.in_flight_rollouts.size());
  fs::remove_all(dir);  // an older checkpoint of the same step (a re-run after a resume)
  fs::rename(tmp, dir);
}

CheckpointState read_checkpoint_state(const std::filesystem::path& dir) {
  std::ifstream in(dir / "state.json");
  if (!in) throw std::invalid_argument("no state.json in '" + dir.string() + "'");
  CheckpointState st;
  uint64_t in_flight_bytes = 0;
  try {
    auto j = nlohmann::json::parse(in);
    st.step = j.at("step").get<int64_t>();
    st.policy_version = j.at("policy_version").get<int64_t>();
    st.prompt_rng = j.at("prompt_rng").get<std::string>();
    if (j.contains("in_flight_rollouts_bytes")) in_flight_bytes = j.at("in_flight_rollouts_bytes").get<uint64_t>();
  } catch (const std::exception& e) {
    throw std::invalid_argument("state.json in '" + dir.string() + "': " + e.what());
  }
  const auto file = dir / kInFlightRolloutsFile;
  std::error_code ec;
  const bool present = std::filesystem::exists(file, ec);
  if (in_flight_bytes == 0 && present)
    throw std::invalid_argument("'" + file.string() + "' is not listed in state.json (in_flight_rollouts_bytes)");
  if (in_flight_bytes > 0) {
    if (!present || !std::filesystem::is_regular_file(file, ec))
      throw std::invalid_argument("'" + file.string() + "' is missing (state.json lists " +
                                  std::to_string(in_flight_bytes) + " bytes of rollouts in flight)");
    const auto size = std::filesystem::file_size(file, ec);
    if (ec || size != in_flight_bytes)
      throw std::invalid_argument("'" + file.string() + "' holds " + std::to_string(size) + " bytes, state.json lists " +
                                  std::to_string(in_flight_bytes));
    std::ifstream f(file, std::ios::binary);
    st.in_flight_rollouts.assign(std::istreambuf_iterator<char>(f), {});
    if (st.in_flight_rollouts.size() != in_flight_bytes) throw std::invalid_argument("cannot read '" + file.string() + "'");
  }
  return st;
}

CheckpointState load_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer) {
  refuse_expert_parallel(trainer, "load_checkpoint", dir);
  auto st = read_checkpoint_state(dir);
  policy.load_hf_checkpoint(dir.string());
  const int shards = shard_count(dir);
  if (shards > 0) {  // written by `shards` data-parallel ranks: this rank's range of their state
    trainer.load_flat_optimizer_state(read_shards(dir, trainer, shards));
  } else if (trainer.data_parallel()) {  // a one-rank checkpoint: this rank's range of it
    trainer.load_flat_optimizer_state({read_whole_optimizer(dir, trainer)});
  } else {
    load_file(dir, "optimizer.pt", trainer.optimizer());
    trainer.reload_master_weights();
    if (trainer.uses_master_weights() && std::filesystem::exists(dir / "master_weights.pt")) {
      std::vector<torch::Tensor> saved;
      load_file(dir, "master_weights.pt", saved);
      const auto& masters = trainer.master_parameters();
      if (saved.size() != masters.size())
        throw std::invalid_argument("master_weights.pt in '" + dir.string() + "' holds " +
                                    std::to_string(saved.size()) + " tensors, the policy " +
                                    std::to_string(masters.size()));
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < saved.size(); ++i) masters[i].copy_(saved[i]);
    }
  }
  trainer.set_version(st.policy_version);
  return st;
}

}  // namespace kiln::trainer
