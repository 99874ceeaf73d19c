#include "actors/trainer/checkpoint.hpp"

#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "model/checkpoint/safetensors.hpp"
#include "model/key_table.hpp"

namespace kiln::trainer {

namespace {

// The archive's bytes into `file`; a failed write is remembered (the archive writer is always
// told every byte went, so LibTorch never throws from inside its writer) and thrown afterwards.
template <typename T>
void save_checked(const std::filesystem::path& file, const T& value) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot create '" + file.string() + "'");
  bool failed = false;
  uint64_t written = 0;
  torch::save(value, std::function<size_t(const void*, size_t)>([&](const void* data, size_t n) -> size_t {
                if (!failed && n > 0) {
                  out.write(static_cast<const char*>(data), std::streamsize(n));
                  failed = !out;
                  if (!failed) written += n;
                }
                return n;
              }));
  if (!failed) failed = !out.flush();
  out.close();
  if (failed || out.fail())
    throw std::runtime_error("writing '" + file.string() + "' failed after " + std::to_string(written) +
                             " bytes (disk full, or a file-size limit?)");
}

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

std::string shard_ranges_file(int rank, int ranks) {
  auto name = shard_file(rank, ranks);
  return name.substr(0, name.size() - 3) + ".json";
}

// The HF export of an expert-parallel policy, written without a gather: file k of P holds ep
// rank k's experts (and, for k = 0, every other tensor), written by the rank of that ep
// coordinate whose replica coordinate is 0.
std::string hf_part_file(int k, int parts) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", k + 1, parts);
  return name;
}

// model.safetensors.index.json over the HF parts in `dir`, from their headers.
void write_hf_index(const std::filesystem::path& dir, int parts) {
  nlohmann::json map = nlohmann::json::object();
  uint64_t total = 0;
  for (int k = 0; k < parts; ++k) {
    const auto file = hf_part_file(k, parts);
    const auto f = checkpoint::SafetensorsFile::open((dir / file).string());
    for (const auto& [name, info] : f.tensors()) {
      map[name] = file;
      total += info.end - info.begin;
    }
  }
  std::ofstream out(dir / "model.safetensors.index.json");
  out << nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", map}}.dump(2) << "\n";
  if (!out.flush()) throw std::runtime_error("cannot write '" + (dir / "model.safetensors.index.json").string() + "'");
}

// A policy with a NaN or infinite weight (a step's update overflowed: too large an lr) is not
// written: every resume would refuse the checkpoint, and the advice to resume from it would
// fail. Every rank of a data-parallel trainer throws together (one all-reduce), before any
// rank starts writing.
void refuse_non_finite(model::CausalLM& policy, Trainer& trainer) {
  std::string first;
  int64_t bad = 0;
  for (const auto& p : policy.named_parameters())
    if (!model::all_finite(p.value().detach()) && bad++ == 0) first = "'" + p.key() + "'";
  const auto& masters = trainer.master_parameters();
  for (std::size_t i = 0; trainer.uses_master_weights() && i < masters.size(); ++i)
    if (!model::all_finite(masters[i]) && bad++ == 0) first = "fp32 master weight " + std::to_string(i);
  int64_t any = bad;
  if (auto* dp = trainer.data_parallel()) {
    auto t = torch::full({1}, bad, torch::kInt64).to(dp->device());
    dp->all_reduce(t, parallel::ReduceOp::max);
    any = t.to(torch::kCPU).item<int64_t>();
  }
  if (any == 0) return;
  throw std::runtime_error("the policy holds NaN or infinite weights (" +
                           (bad ? first + (bad > 1 ? " and " + std::to_string(bad - 1) + " more tensors" : "")
                                : std::string("on another rank")) +
                           "; a step's update overflowed, e.g. too large an lr): not saved, since no run could resume "
                           "from it");
}

// Collective over the trainer's group (all its ranks, on a filesystem they share): the policy in
// HF layout (data parallel: by rank 0, which holds all of it; expert parallel: a file per ep
// rank, from the ranks of replica 0, no gather), config.json, state.json and the buffers by
// rank 0, and every rank's optimizer parts (optimizer_shard_R_of_W.pt, their ranges of the
// whole model's flat index in optimizer_shard_R_of_W.json). The directory is renamed into
// place once every rank has written.
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
  const auto& ep = trainer.expert_parallel();
  if (ep.experts) {
    if (ep.replicas->rank() == 0)
      checkpoint::write_safetensors((tmp / hf_part_file(ep.experts->rank(), ep.experts->size())).string(),
                                    policy.hf_state_dict_local(/*with_dense=*/ep.experts->rank() == 0));
    if (dp.rank() == 0) policy.save_hf_config(tmp.string());
  } else if (dp.rank() == 0) {
    policy.save_hf_checkpoint(tmp.string(), uint64_t(5) << 30);
  }
  if (dp.rank() == 0) {
    std::vector<torch::Tensor> buffers;
    for (const auto& b : policy.buffers()) buffers.push_back(b.detach().cpu());
    save_torch_file(tmp / "buffers.pt", buffers);
    write_in_flight(tmp, state.in_flight_rollouts);
    write_state_json(tmp, state.step, trainer.version(), state.prompt_rng, state.in_flight_rollouts.size());
  }
  const auto parts = trainer.optimizer_state_parts();
  const int64_t params = int64_t(policy.parameters().size());
  // One steps tensor per file: each part's counts merged (a parameter's count is the same in
  // every part that touches it).
  auto steps = torch::full({params}, int64_t{-1}, torch::kInt64);
  for (const auto& p : parts) steps = torch::maximum(steps, p.steps);
  std::vector<torch::Tensor> record{torch::tensor({int64_t{2}, trainer.optimizer_numel(), params, int64_t(parts.size())}),
                                    steps};
  nlohmann::json ranges = nlohmann::json::array();
  for (const auto& p : parts) {
    record.insert(record.end(), {torch::tensor({p.begin}), p.master, p.exp_avg, p.exp_avg_sq});
    ranges.push_back({p.begin, p.begin + p.master.numel()});
  }
  save_torch_file(tmp / shard_file(dp.rank(), dp.size()), record);
  {
    std::ofstream out(tmp / shard_ranges_file(dp.rank(), dp.size()));
    out << nlohmann::json{{"numel", trainer.optimizer_numel()}, {"params", params}, {"ranges", ranges}}.dump() << "\n";
    if (!out.flush()) throw std::runtime_error("cannot write '" + (tmp / shard_ranges_file(dp.rank(), dp.size())).string() + "'");
  }
  dp.barrier();
  if (dp.rank() == 0) {
    if (ep.experts) write_hf_index(tmp, ep.experts->size());
    fs::remove_all(dir);
    fs::rename(tmp, dir);
  }
  dp.barrier();  // no rank returns before the checkpoint exists
}

// The ranges of the whole model's flat index rank `r` of `ranks` wrote: from its .json (format
// 2), or, for format 1 (data-parallel shards of kiln before expert-parallel checkpoints), the
// rank's equal share of the N elements.
std::vector<std::pair<int64_t, int64_t>> shard_ranges(const std::filesystem::path& dir, int r, int ranks, int64_t n) {
  const auto file = dir / shard_ranges_file(r, ranks);
  std::vector<std::pair<int64_t, int64_t>> out;
  if (!std::filesystem::exists(file)) {
    for (int other = 0; other < ranks; ++other)  // format 2 writes one per rank: this one is lost
      if (std::filesystem::exists(dir / shard_ranges_file(other, ranks)))
        throw std::invalid_argument("'" + dir.string() + "' lacks " + file.filename().string() + " (the ranges of " +
                                    shard_file(r, ranks) + "; " + shard_ranges_file(other, ranks) + " is there)");
    const int64_t per = (n + ranks - 1) / ranks;
    out.emplace_back(std::min(n, r * per), std::min(n, (r + 1) * per));
    return out;
  }
  try {
    std::ifstream in(file);
    auto j = nlohmann::json::parse(in);
    if (j.at("numel").get<int64_t>() != n)
      throw std::invalid_argument("it is of a policy of " + std::to_string(j.at("numel").get<int64_t>()) +
                                  " elements, this one has " + std::to_string(n));
    for (const auto& range : j.at("ranges")) out.emplace_back(range.at(0).get<int64_t>(), range.at(1).get<int64_t>());
  } catch (const std::exception& e) {
    throw std::invalid_argument(file.filename().string() + " in '" + dir.string() + "': " + e.what());
  }
  return out;
}

// The optimizer parts of `dir` (written by `ranks` ranks) that overlap what this rank holds.
std::vector<FlatAdamWState> read_shards(const std::filesystem::path& dir, Trainer& trainer, int ranks) {
  const int64_t n = trainer.optimizer_numel(), params = int64_t(trainer.policy().parameters().size());
  const auto mine = trainer.optimizer_ranges();
  auto overlaps = [&](const std::vector<std::pair<int64_t, int64_t>>& theirs) {
    for (const auto& [a, b] : theirs)
      for (const auto& [c, d] : mine)
        if (a < d && c < b) return true;
    return false;
  };
  std::vector<FlatAdamWState> parts;
  for (int r = 0; r < ranks; ++r) {
    const auto ranges = shard_ranges(dir, r, ranks, n);
    if (!overlaps(ranges)) continue;
    const auto file = shard_file(r, ranks);
    std::vector<torch::Tensor> record;
    load_file(dir, file, record);
    auto bad = [&](const std::string& why) {
      return std::invalid_argument(file + " in '" + dir.string() + "' " + why);
    };
    const bool format1 = record.size() == 5 && record[0].numel() == 2;
    if (!format1 && !std::filesystem::exists(dir / shard_ranges_file(r, ranks)))
      throw bad("has no " + shard_ranges_file(r, ranks) + " beside it (its ranges)");
    if (format1) {  // one part
      record = {torch::tensor({int64_t{2}, record[0][1].item<int64_t>(), record[4].numel(), int64_t{1}}), record[4],
                record[0][0].reshape({1}), record[1], record[2], record[3]};
    }
    if (record.size() < 2 || record[0].numel() != 4 || record[0][0].item<int64_t>() != 2)
      throw bad("is not an optimizer shard of kiln (" + std::to_string(record.size()) + " tensors)");
    const int64_t count = record[0][3].item<int64_t>();
    if (int64_t(record.size()) != 2 + 4 * count) throw bad("is cut short: " + std::to_string(record.size()) + " tensors for " + std::to_string(count) + " parts");
    if (record[0][1].item<int64_t>() != n || record[0][2].item<int64_t>() != params)
      throw bad("is of a policy of " + std::to_string(record[0][1].item<int64_t>()) + " elements in " +
                std::to_string(record[0][2].item<int64_t>()) + " parameters, this one has " + std::to_string(n) +
                " in " + std::to_string(params));
    std::vector<std::pair<int64_t, int64_t>> held;
    for (int64_t k = 0; k < count; ++k) {
      const auto* t = &record[std::size_t(2 + 4 * k)];
      if (t[1].numel() != t[2].numel() || t[1].numel() != t[3].numel())
        throw bad("part " + std::to_string(k) + " has masters and moments of different sizes");
      parts.push_back(FlatAdamWState{t[0].item<int64_t>(), t[1], t[2], t[3], record[1]});
      held.emplace_back(parts.back().begin, parts.back().begin + t[1].numel());
    }
    if (held != ranges)
      throw bad("holds other ranges than " + shard_ranges_file(r, ranks) + " lists (" + std::to_string(held.size()) +
                " parts from " + std::to_string(held.empty() ? 0 : held.front().first) + ", the file lists " +
                std::to_string(ranges.size()) + " from " + std::to_string(ranges.empty() ? 0 : ranges.front().first) + ")");
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

}  // namespace

void save_torch_file(const std::filesystem::path& file, const std::vector<torch::Tensor>& value) {
  save_checked(file, value);
}
void save_torch_file(const std::filesystem::path& file, const torch::optim::Optimizer& value) {
  save_checked(file, value);
}

void save_checkpoint(const std::filesystem::path& dir, model::CausalLM& policy, Trainer& trainer,
                     const CheckpointState& state) {
  refuse_non_finite(policy, trainer);
  if (auto* dp = trainer.data_parallel()) return save_sharded(dir, policy, trainer, state, *dp);
  namespace fs = std::filesystem;
  // Written beside the target, then renamed into place: a writer that dies midway leaves a
  // ".partial" directory, never a checkpoint directory that lacks files.
  fs::path tmp = dir;
  tmp += ".partial";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    policy.save_hf_checkpoint(tmp.string(), uint64_t(5) << 30);
    save_torch_file(tmp / "optimizer.pt", trainer.optimizer());
    // bf16 policies: the fp32 master weights too, or a resumed run would restart from rounded ones.
    if (trainer.uses_master_weights()) save_torch_file(tmp / "master_weights.pt", trainer.master_parameters());
    write_in_flight(tmp, state.in_flight_rollouts);
    write_state_json(tmp, state.step, trainer.version(), state.prompt_rng, state.in_flight_rollouts.size());
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // what was written is of no use, and holds space the disk lacks
    throw;
  }
  fs::remove_all(dir);  // an older checkpoint of the same step (a re-run after a resume)
  fs::rename(tmp, dir);
}

std::optional<int64_t> checkpoint_name_step(const std::string& name) {
  if (name.size() <= 5 || name.rfind("step_", 0) != 0 || name.find_first_not_of("0123456789", 5) != std::string::npos)
    return std::nullopt;
  const auto first = name.find_first_not_of('0', 5);
  const auto digits = first == std::string::npos ? std::string("0") : name.substr(first);  // no leading zeros
  return digits.size() > 18 ? -1 : std::stoll(digits);
}

std::filesystem::path newest_checkpoint_in(const std::filesystem::path& parent) {
  std::filesystem::path newest;
  int64_t newest_step = -1;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(parent, ec)) {
    const auto name = e.path().filename().string();
    const auto step = checkpoint_name_step(name);
    // (one step under two names, step_6 and step_000006: the larger name, whatever the listing's order)
    if (step && (*step > newest_step || (*step == newest_step && name > newest.filename().string())) &&
        std::filesystem::exists(e.path() / "state.json", ec)) {
      newest = e.path();
      newest_step = *step;
    }
  }
  return newest;
}

CheckpointState read_checkpoint_state(const std::filesystem::path& dir) {
  std::ifstream in(dir / "state.json");
  if (!in) {
    // A run directory, or its checkpoints/, given for one checkpoint: name the newest inside.
    auto newest = newest_checkpoint_in(dir / "checkpoints");
    if (newest.empty()) newest = newest_checkpoint_in(dir);
    throw std::invalid_argument("no state.json in '" + dir.string() + "'" +
                                (newest.empty() ? std::string()
                                                : " (a checkpoint is one step_N directory; the newest here is '" +
                                                      newest.string() + "')"));
  }
  CheckpointState st;
  uint64_t in_flight_bytes = 0;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::invalid_argument("state.json in '" + dir.string() + "': " + e.what());
  }
  // Each field by name, with the value found when it has the wrong type (nlohmann's get<> would
  // truncate 3.5 to 3 and wrap -5 into an unsigned). Every count here is >= 0.
  auto field = [&](const char* name, auto& out) {
    using T = std::decay_t<decltype(out)>;
    if (!j.is_object() || !j.contains(name))
      throw std::invalid_argument("state.json in '" + dir.string() + "': no '" + name + "'");
    const auto& v = j.at(name);
    bool ok = false;
    const char* want = "";
    if constexpr (std::is_same_v<T, std::string>) {
      ok = v.is_string();
      want = "a string";
    } else {
      ok = v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max());
      want = "a whole number in [0, 2^63)";
    }
    if (!ok)
      throw std::invalid_argument("state.json in '" + dir.string() + "': '" + name + "' is " + v.dump() + ", not " + want);
    out = v.get<T>();
  };
  field("step", st.step);
  field("policy_version", st.policy_version);
  field("prompt_rng", st.prompt_rng);
  // One optimizer step per run step at most (a skipped step takes none): a larger version is
  // not one kiln wrote, and would move the lr schedule and the next versions (2^63-1 wrapped).
  if (st.policy_version > st.step)
    throw std::invalid_argument("state.json in '" + dir.string() + "': 'policy_version' " +
                                std::to_string(st.policy_version) + " is above 'step' " + std::to_string(st.step) +
                                " (the trainer takes at most one optimizer step per step)");
  if (j.is_object() && j.contains("in_flight_rollouts_bytes")) field("in_flight_rollouts_bytes", in_flight_bytes);
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
  // Every read first, with no collective in between; with a group the ranks then agree, so that
  // a rank that cannot read its part fails every rank at once (not in a collective left waiting
  // until the timeout), before any rank's masters and AdamW state change.
  auto* group = trainer.data_parallel();
  CheckpointState st;
  std::vector<FlatAdamWState> parts;
  bool from_parts = false;  // masters and AdamW state from `parts` (not optimizer.pt in place)
  std::exception_ptr failed;
  try {
    st = read_checkpoint_state(dir);
    const int shards = shard_count(dir);
    if (trainer.expert_parallel().experts) {
      // The weights come from the masters (load_optimizer_state_parts), the buffers from rank 0's file.
      if (shards == 0)
        throw std::invalid_argument("'" + dir.string() +
                                    "' was written by one trainer rank: an expert-parallel trainer resumes from sharded "
                                    "checkpoints only (written with parallel.dp or parallel.ep > 1); resume it at one rank "
                                    "or with data parallel, whose next checkpoint an expert-parallel run resumes");
      // Sharded checkpoints with range files (this format) always have buffers.pt.
      const bool format2 = std::filesystem::exists(dir / shard_ranges_file(0, shards));
      if (format2 && !std::filesystem::exists(dir / "buffers.pt"))
        throw std::invalid_argument("'" + dir.string() + "' lacks buffers.pt (the policy's buffers, written by rank 0)");
      if (format2) {
        std::vector<torch::Tensor> saved;
        load_file(dir, "buffers.pt", saved);
        auto buffers = policy.buffers();
        if (saved.size() != buffers.size())
          throw std::invalid_argument("buffers.pt in '" + dir.string() + "' holds " + std::to_string(saved.size()) +
                                      " tensors, the policy has " + std::to_string(buffers.size()) + " buffers");
        for (std::size_t i = 0; i < saved.size(); ++i)
          if (saved[i].sizes() != buffers[i].sizes())
            throw std::invalid_argument("buffers.pt in '" + dir.string() + "': tensor " + std::to_string(i) +
                                        " has another shape than the policy's buffer");
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < saved.size(); ++i) buffers[i].copy_(saved[i]);
      }
    } else {
      policy.load_hf_checkpoint(dir.string());
    }
    from_parts = shards > 0 || group;
    if (shards > 0) {  // written by `shards` ranks: the parts of their state this rank holds
      parts = read_shards(dir, trainer, shards);
    } else if (group) {  // a one-rank checkpoint: this rank's range of it
      parts = {read_whole_optimizer(dir, trainer)};
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
  } catch (...) {
    if (!group) throw;
    failed = std::current_exception();
  }
  if (group) {
    // The highest rank (plus one) that failed to read, 0 when none did.
    auto worst = torch::tensor({failed ? double(group->rank() + 1) : 0.0},
                               torch::TensorOptions().dtype(torch::kFloat64).device(group->device()));
    group->all_reduce(worst, parallel::ReduceOp::max);
    const int who = int(worst.item<double>()) - 1;
    if (failed) std::rethrow_exception(failed);
    if (who >= 0)
      throw std::invalid_argument("'" + dir.string() + "': trainer rank " + std::to_string(who) + " of group '" +
                                  group->name() + "' could not read its part of the checkpoint (its error names it)");
  }
  if (from_parts) trainer.load_optimizer_state_parts(parts);
  trainer.set_version(st.policy_version);
  return st;
}

}  // namespace kiln::trainer
