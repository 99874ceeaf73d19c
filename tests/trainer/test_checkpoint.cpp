// RL checkpoints (actors/trainer/checkpoint.hpp) round-trip everything a step depends on: after
// one step, save and load into a fresh trainer; every parameter, fp32 master weight, AdamW
// moment and step count, the lr and the version are equal bit for bit, and the next step of
// both is the same.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>

#include "../scratch.hpp"
#include "actors/trainer/checkpoint.hpp"
#include "trainer_fixture.hpp"

using namespace kiln;
using namespace kiln::trainer;
using test::debug_model;
using test::differences;
using test::snapshot;

TEST_CASE("a checkpoint after one step loads into a fresh trainer bit for bit, fp32 and bf16 (with master weights)") {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    CAPTURE(dtype);
    auto m = debug_model(7);
    m->to_dtype(dtype);
    auto samples = test::rollout_samples(m, 4);
    TrainerConfig c;
    c.lr = 1e-5;  // bf16: updates far below bf16's spacing live only in the fp32 masters
    Trainer t(m, c);
    t.train_step(samples);
    if (dtype == torch::kBFloat16) {
      // Otherwise the test could not tell saved masters from masters re-read from the policy.
      REQUIRE(t.uses_master_weights());
      int64_t differ = 0;
      auto params = m->parameters();
      for (std::size_t i = 0; i < params.size(); ++i)
        differ += !torch::equal(t.master_parameters()[i], params[i].to(torch::kFloat32));
      MESSAGE(differ << " of " << params.size() << " masters differ from their bf16 parameters");
      REQUIRE(differ > 0);
    }
    const auto dir = test::scratch_path(std::string("checkpoint-") + (dtype == torch::kFloat32 ? "fp32" : "bf16"));
    save_checkpoint(dir, *m, t, CheckpointState{1, t.version(), "rng"});
    auto fresh = debug_model(99);  // other weights: everything must come from the checkpoint
    fresh->to_dtype(dtype);
    Trainer loaded(fresh, c);
    auto state = load_checkpoint(dir, *fresh, loaded);
    CHECK(state.step == 1);
    CHECK(state.policy_version == 1);
    for (const auto& d : differences(snapshot(t), snapshot(loaded))) FAIL_CHECK("differs after loading: " << d);
    // And training continues identically.
    t.train_step(samples);
    loaded.train_step(samples);
    for (const auto& d : differences(snapshot(t), snapshot(loaded))) FAIL_CHECK("differs one step later: " << d);
  }
}

TEST_CASE("a checkpoint write that fails (disk full, a file-size limit) throws naming the file and leaves the older checkpoint and no partial one") {
  // /dev/full: every write fails with ENOSPC. LibTorch's own file writer std::terminate()d here.
  CHECK_THROWS_WITH_AS(save_torch_file("/dev/full", std::vector<torch::Tensor>{torch::ones({4096})}),
                       doctest::Contains("writing '/dev/full' failed"), std::runtime_error);
  auto m = debug_model(7);
  auto samples = test::rollout_samples(m, 4);
  Trainer t(m, TrainerConfig{});
  t.train_step(samples);
  CHECK_THROWS_WITH_AS(save_torch_file("/dev/full", t.optimizer()), doctest::Contains("(disk full, or a file-size limit?)"),
                       std::runtime_error);
  // A file-size limit between the weights' shard and optimizer.pt (its two moments are larger):
  // the weights are written, optimizer.pt is not.
  const std::filesystem::path dir = test::scratch_path("checkpoint-fsize");
  save_checkpoint(dir, *m, t, CheckpointState{1, t.version(), "rng"});
  uintmax_t shard = 0;  // the largest weights shard
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") shard = std::max(shard, e.file_size());
  const auto optimizer = std::filesystem::file_size(dir / "optimizer.pt");
  REQUIRE(optimizer > shard + 8192);
  const auto before = snapshot(t);
  struct rlimit old_limit {};
  getrlimit(RLIMIT_FSIZE, &old_limit);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
  struct rlimit limit = old_limit;
  limit.rlim_cur = rlim_t(shard + (optimizer - shard) / 2);
  REQUIRE(setrlimit(RLIMIT_FSIZE, &limit) == 0);
  std::string error;
  try {
    save_checkpoint(dir, *m, t, CheckpointState{1, t.version(), "rng"});
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  CHECK(error.find("optimizer.pt' failed") != std::string::npos);
  auto partial = dir;
  partial += ".partial";
  CHECK_FALSE(std::filesystem::exists(partial));
  CHECK(std::filesystem::file_size(dir / "optimizer.pt") == optimizer);  // the older checkpoint, whole
  auto fresh = debug_model(99);
  Trainer loaded(fresh, TrainerConfig{});
  CHECK(load_checkpoint(dir, *fresh, loaded).step == 1);
  for (const auto& d : differences(before, snapshot(loaded))) FAIL_CHECK("the older checkpoint differs: " << d);
  // Saved again over it, with nothing failing: the directory is replaced whole (this once crashed
  // the run: std::filesystem::remove_all bound to LibTorch's copy).
  t.train_step(samples);
  save_checkpoint(dir, *m, t, CheckpointState{2, t.version(), "rng"});
  CHECK_FALSE(std::filesystem::exists(partial));
  auto again = debug_model(98);
  Trainer reloaded(again, TrainerConfig{});
  CHECK(load_checkpoint(dir, *again, reloaded).step == 2);
  for (const auto& d : differences(snapshot(t), snapshot(reloaded))) FAIL_CHECK("the replaced checkpoint differs: " << d);
}

TEST_CASE("a state.json with a field missing or of another type is refused naming the field and the value") {
  const std::filesystem::path dir = test::scratch_path("checkpoint-bad-state");
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& text) { std::ofstream(dir / "state.json") << text; };
  write(R"({"step": "three", "policy_version": 3, "prompt_rng": "x"})");
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir), doctest::Contains("'step' is \"three\", not a whole number in [0, 2^63)"), std::invalid_argument);
  write(R"({"step": 3, "prompt_rng": "x"})");
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir), doctest::Contains("no 'policy_version'"), std::invalid_argument);
  write(R"({"step": 3, "policy_version": 3, "prompt_rng": "x", "in_flight_rollouts_bytes": -5})");
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir), doctest::Contains("'in_flight_rollouts_bytes' is -5, not a whole number"), std::invalid_argument);
  write(R"({"step": -1, "policy_version": 3, "prompt_rng": "x"})");  // was read as step -1: three steps for two
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir), doctest::Contains("'step' is -1"), std::invalid_argument);
  write(R"({"step": 1, "policy_version": -5, "prompt_rng": "x"})");
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir), doctest::Contains("'policy_version' is -5"), std::invalid_argument);
  write(R"({"step": 2, "policy_version": 9223372036854775807, "prompt_rng": "x"})");  // wrapped at the next step
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir),
                       doctest::Contains("'policy_version' 9223372036854775807 is above 'step' 2"), std::invalid_argument);
  write(R"({"step": 2, "policy_version": 3, "prompt_rng": "x"})");
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir), doctest::Contains("is above 'step' 2"), std::invalid_argument);
  write(R"({"step": 2, "policy_version": 1, "prompt_rng": "x"})");  // a skipped step: fine
  CHECK(read_checkpoint_state(dir).policy_version == 1);
  write(R"({"step": 3.5, "policy_version": 3, "prompt_rng": "x"})");
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir), doctest::Contains("'step' is 3.5"), std::invalid_argument);
  write("[1, 2]");
  CHECK_THROWS_WITH_AS(read_checkpoint_state(dir), doctest::Contains("no 'step'"), std::invalid_argument);
  write(R"({"step": 3, "policy_version": 2, "prompt_rng": "x"})");
  const auto st = read_checkpoint_state(dir);
  CHECK(st.step == 3);
  CHECK(st.policy_version == 2);
}

TEST_CASE("a run directory given for a checkpoint is refused naming its newest complete checkpoint") {
  namespace fs = std::filesystem;
  const fs::path run = test::scratch_path("checkpoint-run-dir");
  fs::remove_all(run);
  const auto with_state = [&](const char* step) {
    fs::create_directories(run / "checkpoints" / step);
    std::ofstream(run / "checkpoints" / step / "state.json") << R"({"step": 1, "policy_version": 1, "prompt_rng": "x"})";
  };
  for (const char* step : {"step_000002", "step_000010", "step_000012.partial"}) with_state(step);
  fs::create_directories(run / "checkpoints" / "step_000011");  // no state.json: cut short
  const auto newest = (run / "checkpoints" / "step_000010").string();
  CHECK(newest_checkpoint_in(run / "checkpoints").string() == newest);
  CHECK_THROWS_WITH_AS(read_checkpoint_state(run), doctest::Contains(("the newest here is '" + newest + "'").c_str()), std::invalid_argument);
  CHECK_THROWS_WITH_AS(read_checkpoint_state(run / "checkpoints"), doctest::Contains(("the newest here is '" + newest + "'").c_str()),
                       std::invalid_argument);
  CHECK(newest_checkpoint_in(run / "nothing").empty());
  // Past the 6 digits of padding the names no longer sort as the steps do.
  for (const char* step : {"step_999999", "step_1000000"}) with_state(step);
  CHECK(newest_checkpoint_in(run / "checkpoints") == run / "checkpoints" / "step_1000000");
  const fs::path empty = test::scratch_path("checkpoint-empty-dir");
  fs::create_directories(empty);
  try {
    (void)read_checkpoint_state(empty);
    FAIL("an empty directory was read as a checkpoint");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()) == "no state.json in '" + empty.string() + "'");
  }
}

TEST_CASE("checkpoint_name_step reads kiln's step_N names and nothing else") {
  CHECK(checkpoint_name_step("step_000006") == 6);
  CHECK(checkpoint_name_step("step_000000") == 0);
  CHECK(checkpoint_name_step("step_1000000") == 1000000);
  CHECK(checkpoint_name_step("step_1234567890123456789") == -1);  // does not fit an int64's 18 safe digits
  for (const char* other : {"step_", "step_6.partial", "step_6.superseded", "step_-1", "latest", "Step_6", "step_6 "})
    CHECK_MESSAGE(!checkpoint_name_step(other), other);
}
