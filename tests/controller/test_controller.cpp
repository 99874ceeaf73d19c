// The controller's pieces, each driven directly: GRPO group building, the staleness bound,
// the rollout stream (synchronous and k steps ahead), metric rows a resume drops, prompts and
// rewards, the wire schema's families, and the local handles' weight sync into the engine.
#include <doctest/doctest.h>
#include <msgpack.hpp>

#include <atomic>
#include <fstream>
#include <mutex>

#include "actors/controller/grpo.hpp"
#include "actors/controller/in_flight.hpp"
#include "actors/controller/local_handles.hpp"
#include "actors/controller/metrics.hpp"
#include "actors/controller/placement.hpp"
#include "actors/controller/prompts.hpp"
#include "actors/controller/rollout_stream.hpp"
#include "actors/controller/run_dir.hpp"
#include "actors/controller/staleness.hpp"
#include "actors/reference/ref_messages.hpp"
#include "actors/rollout/generate_messages.hpp"
#include "actors/rollout/tokenizer.hpp"
#include "actors/trainer/messages.hpp"
#include "messaging/replay_frames.hpp"
#include "model/registry.hpp"
#include "tests/scratch.hpp"

using namespace kiln;
using namespace kiln::controller;

namespace {
rollout::Completion completion(uint64_t id, std::vector<int64_t> versions) {
  rollout::Completion c;
  c.id = id;
  c.prompt = {2, 5};
  c.tokens.assign(versions.size(), 7);
  c.logprobs.assign(versions.size(), -1.0f);
  c.entropies.assign(versions.size(), 0.5f);
  c.policy_versions = std::move(versions);
  return c;
}
}  // namespace

TEST_CASE("GRPO groups: group-relative advantages with zero-variance groups filtered and stale groups dropped") {
  AlgorithmConfig a;
  a.samples_per_prompt = 3;
  a.staleness = 1;
  // Three groups of three: rewards vary; all equal (filtered); vary but sampled 2 versions ago.
  std::vector<rollout::Completion> cs;
  for (uint64_t i = 0; i < 9; ++i) cs.push_back(completion(i, {i < 6 ? 4 : 2}));
  const std::vector<float> rewards = {1, 0, 0, 1, 1, 1, 0, 1, 0};
  std::vector<std::vector<float>> ref(9, std::vector<float>{-2.0f});
  auto g = build_groups(cs, rewards, ref, a, /*trainer_version=*/4);
  CHECK(g.filtered == 1);
  CHECK(g.stale_dropped == 1);
  REQUIRE(g.samples.size() == 3);
  // (r - mean) / (population std + eps): mean 1/3, std sqrt(2)/3.
  CHECK(g.samples[0].advantage == doctest::Approx(1.41421).epsilon(1e-4));
  CHECK(g.samples[1].advantage == doctest::Approx(-0.70711).epsilon(1e-4));
  CHECK(g.samples[0].ref_logprobs == std::vector<float>{-2.0f});
  CHECK(g.samples[0].behavior_logprobs == cs[0].logprobs);
  a.normalize_std = false;
  a.filter_zero_variance = false;
  g = build_groups(cs, rewards, ref, a, 4);
  CHECK(g.filtered == 0);
  CHECK(g.samples.size() == 6);
  CHECK(g.samples[0].advantage == doctest::Approx(2.0 / 3));
  CHECK(g.samples[3].advantage == 0.0f);  // the all-equal group trains with zero advantage
  CHECK_THROWS_AS(build_groups(cs, {1, 0}, ref, a, 4), std::invalid_argument);
}

TEST_CASE("staleness: tokens counted by age and a group is stale if any token is past k versions") {
  std::vector<rollout::Completion> cs = {completion(0, {3, 3, 2}), completion(1, {1})};
  CHECK(staleness_histogram(cs, 3) == std::map<int64_t, int64_t>{{0, 2}, {1, 1}, {2, 1}});
  CHECK_FALSE(too_stale(cs, 0, 1, 3, 1));  // ages 0, 0, 1
  CHECK(too_stale(cs, 0, 2, 3, 1));        // the second holds an age-2 token
  CHECK_FALSE(too_stale(cs, 0, 2, 3, 2));
}

TEST_CASE("rollout stream: k = 0 generates on demand and loads at once while k = 2 never runs more than 2 steps ahead") {
  SUBCASE("k = 0") {
    std::vector<std::string> log;
    RolloutStream s([&](int64_t step, const std::function<void()>&) { log.push_back("gen " + std::to_string(step)); return Batch{step}; },
                    [&](const PolicyWeights& w) { log.push_back("load v" + std::to_string(w.version)); }, 1, 3, 0);
    CHECK(s.take(1).step == 1);
    s.consumed(1, PolicyWeights{1, {}});
    CHECK(s.take(2).step == 2);
    s.consumed(2, std::nullopt);  // nothing trained: nothing loaded
    CHECK(log == std::vector<std::string>{"gen 1", "load v1", "gen 2"});
  }
  SUBCASE("k = 2") {
    std::mutex mu;
    std::atomic<int64_t> consumed{0};
    std::vector<int64_t> loaded, consumed_at_start;
    RolloutStream s(
        [&](int64_t step, const std::function<void()>& between) {
          consumed_at_start.push_back(consumed);
          between();
          return Batch{step};
        },
        [&](const PolicyWeights& w) {
          std::lock_guard<std::mutex> l(mu);
          loaded.push_back(w.version);
        },
        1, 8, 2);
    for (int64_t step = 1; step <= 8; ++step) {
      CHECK(s.take(step).step == step);
      consumed = step;
      s.consumed(step, PolicyWeights{step, {}});
    }
    REQUIRE(consumed_at_start.size() == 8);
    for (int64_t step = 1; step <= 8; ++step)  // step s starts once s - 1 - k steps were consumed
      CHECK(consumed_at_start[std::size_t(step - 1)] >= step - 3);
    std::lock_guard<std::mutex> l(mu);
    CHECK(std::is_sorted(loaded.begin(), loaded.end()));  // versions arrive in order (some may be superseded)
  }
  SUBCASE("a failure of the rollout thread surfaces at its step, after the batches made before it") {
    RolloutStream s(
        [&](int64_t step, const std::function<void()>&) {
          if (step == 2) throw std::runtime_error("engine lost");
          return Batch{step};
        },
        [](const PolicyWeights&) {}, 1, 3, 1);
    CHECK(s.take(1).step == 1);
    s.consumed(1, std::nullopt);
    CHECK_THROWS_WITH_AS(s.take(2), doctest::Contains("engine lost"), std::runtime_error);
  }
}

TEST_CASE("metric rows of steps a resume trains again are dropped and so is a jsonl line cut short, the tsv header kept") {
  const std::filesystem::path dir = test::scratch_path("metrics-drop");
  std::filesystem::create_directories(dir);
  {
    std::ofstream j(dir / "metrics.jsonl"), t(dir / "metrics.tsv");
    t << "# step\treward_mean\tkl\n";  // the header MetricsLog writes
    for (int s = 1; s <= 5; ++s) {
      j << "{\"step\": " << s << "}\n";
      t << s << "\t0.5\t0\n";
    }
    j << "{\"step\": 6, \"rew";  // a run killed mid-write
  }
  int64_t cut = -1;
  CHECK(MetricsLog::drop_rows_from(dir, 3, &cut) == 4);
  CHECK(cut == 1);  // reported apart: the step it held has no row
  CHECK_FALSE(std::filesystem::exists(dir / "metrics.jsonl.tmp"));
  std::ifstream j(dir / "metrics.jsonl");
  std::vector<std::string> lines;
  for (std::string l; std::getline(j, l);) lines.push_back(l);
  CHECK(lines == std::vector<std::string>{"{\"step\": 1}", "{\"step\": 2}"});  // still JSON lines
  std::ifstream t(dir / "metrics.tsv");
  lines.clear();
  for (std::string l; std::getline(t, l);) lines.push_back(l);
  CHECK(lines == std::vector<std::string>{"# step\treward_mean\tkl", "1\t0.5\t0", "2\t0.5\t0"});
}

TEST_CASE("metrics: a file that cannot be opened or written stops the run by name (a full disk, a directory of that name)") {
  const std::filesystem::path dir = test::scratch_path("metrics-fail");
  std::filesystem::create_directories(dir / "metrics.jsonl");  // a directory where the file goes
  const std::string cannot_open = "cannot open '" + (dir / "metrics.jsonl").string() + "'";
  CHECK_THROWS_WITH_AS(MetricsLog(dir, 1), doctest::Contains(cannot_open.c_str()), std::runtime_error);
  std::filesystem::remove(dir / "metrics.jsonl");
  std::filesystem::create_symlink("/dev/full", dir / "metrics.jsonl");  // every write fails (ENOSPC)
  MetricsLog log(dir, 1);
  StepRow row;
  row.step = 1;
  const std::string failed = "writing '" + (dir / "metrics.jsonl").string() + "' failed";
  CHECK_THROWS_WITH_AS(log.write(row), doctest::Contains(failed.c_str()), std::runtime_error);
}

TEST_CASE("metrics: a resume's log changes nothing in the run directory before its first row, then drops the rows it trains again") {
  namespace fs = std::filesystem;
  const fs::path dir = test::scratch_path("metrics-deferred");
  fs::create_directories(dir);
  {
    std::ofstream j(dir / "metrics.jsonl"), t(dir / "metrics.tsv");
    t << "# step\treward_mean\tkl\n";
    for (int s = 1; s <= 4; ++s) {
      j << "{\"step\": " << s << "}\n";
      t << s << "\t0.5\t0\n";
    }
  }
  const auto read = [](const fs::path& f) {
    std::ifstream in(f);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  const auto jsonl = read(dir / "metrics.jsonl"), tsv = read(dir / "metrics.tsv");
  {
    MetricsLog log(dir, 3);  // a resume from step 2's checkpoint whose step 3 then fails
    CHECK_FALSE(log.is_open());
  }
  CHECK(read(dir / "metrics.jsonl") == jsonl);
  CHECK(read(dir / "metrics.tsv") == tsv);
  CHECK_FALSE(fs::exists(dir / "tensorboard"));
  {
    MetricsLog log(dir, 3);
    StepRow row;
    row.step = 3;
    log.write(row);
    CHECK(log.is_open());
  }
  std::ifstream j(dir / "metrics.jsonl");
  std::vector<int64_t> steps;
  for (std::string l; std::getline(j, l);) steps.push_back(nlohmann::json::parse(l).at("step").get<int64_t>());
  CHECK(steps == std::vector<int64_t>{1, 2, 3});
  CHECK(fs::is_directory(dir / "tensorboard"));
  // A file where the event files' directory goes: refused before anything is written.
  const fs::path other = test::scratch_path("metrics-tensorboard-file");
  fs::create_directories(other);
  std::ofstream(other / "tensorboard") << "x";
  CHECK_THROWS_WITH_AS(MetricsLog(other, 1), doctest::Contains("tensorboard"), std::runtime_error);
  CHECK_FALSE(fs::exists(other / "metrics.jsonl"));
}

TEST_CASE("prompts: seeds per run step and request with the same draws after restore and rewards by the verifier") {
  Config c;
  c.algorithm.prompts_per_step = 4;
  c.algorithm.samples_per_prompt = 2;
  Prompts p(c);
  const auto state = p.state();
  auto d1 = p.draw(1);
  REQUIRE(d1.requests.size() == 8);
  CHECK(d1.problems.size() == 4);
  CHECK(d1.requests[3].id == 3);
  CHECK(d1.requests[3].prompt == d1.requests[2].prompt);  // a group shares its prompt
  CHECK(d1.requests[3].sampling.seed == uint64_t(c.run.seed) * 1000003u + 7919u + 3u);
  CHECK(d1.rng_after == p.state());
  auto d2 = p.draw(2);
  p.restore(d1.rng_after);
  CHECK(p.draw(2).problems[0].prompt == d2.problems[0].prompt);
  p.restore(state);
  CHECK(p.draw(1).problems[1].prompt == d1.problems[1].prompt);
  CHECK_THROWS_AS(p.restore("not an rng"), std::invalid_argument);
  // A completion that spells the answer (then the stop token) scores 1; another does not.
  rollout::CharTokenizer tok;
  std::vector<rollout::Completion> cs(2);
  cs[0].id = 0;
  cs[0].tokens = tok.encode(d1.problems[0].answer);
  cs[0].tokens.push_back(tok.eos_ids()[0]);
  cs[0].finish_reason = rollout::FinishReason::stop;
  cs[1].id = 1;
  cs[1].tokens = tok.encode(d1.problems[0].answer == "1" ? "2" : "1");
  const auto r = p.rewards(d1.problems, cs);
  CHECK(r[0] == 1.0f);
  CHECK(r[1] < 1.0f);
}

TEST_CASE("prompts: a built-in task whose longest prompt and max_new_tokens overflow the engine's cache is refused before any step") {
  Config c;  // next_digit, the character tokenizer: "9=" plus the end token
  const int64_t cache = c.rollout.engine.cache_blocks * c.rollout.engine.block_size;
  rollout::CharTokenizer tok;
  const auto prompt_tokens = int64_t(tok.encode_prompt("9=").size());
  c.algorithm.max_new_tokens = cache - prompt_tokens;  // just fits
  CHECK_NOTHROW(Prompts{c});
  c.algorithm.max_new_tokens += 1;
  const std::string want = "algorithm.max_new_tokens: task 'next_digit' draws prompts of up to " +
                           std::to_string(prompt_tokens) + " tokens";
  CHECK_THROWS_WITH_AS(Prompts{c}, doctest::Contains(want.c_str()), std::invalid_argument);
  c.task.name = "arithmetic";  // "99*99=" at max_digits 2
  c.task.max_digits = 2;
  c.algorithm.max_new_tokens = cache - int64_t(tok.encode_prompt("99*99=").size()) + 1;
  CHECK_THROWS_WITH_AS(Prompts{c}, doctest::Contains("at most"), std::invalid_argument);
  c.algorithm.max_new_tokens -= 1;
  CHECK_NOTHROW(Prompts{c});
}

TEST_CASE("wire schema families: declared once with their versions where a conflicting declaration is a bug") {
  CHECK(messaging::message_type_version("trainer.init") == messaging::TrainerInit::kVersion);
  CHECK(messaging::message_type_version("ping") == 1u);
  CHECK_FALSE(messaging::message_type_version("trainer.fly").has_value());
  CHECK_NOTHROW(messaging::declare_message_type("trainer.init", messaging::TrainerInit::kVersion));  // again: fine
  CHECK_THROWS_AS(messaging::declare_message_type("trainer.init", 99), std::logic_error);
  auto env = messaging::make_envelope(messaging::TrainerInit{}, messaging::Kind::request, "a", "trainer/0");
  env.type_version = 1;  // an older peer
  auto v = messaging::validate(env);
  REQUIRE_FALSE(v.has_value());
  CHECK(v.error().code == messaging::ErrorCode::schema_mismatch);
}

TEST_CASE("local handles: the trainer's version reaches the in-process engine through checked weight sync") {
  torch::manual_seed(3);
  auto registry = model::Registry::with_plugins();
  messaging::Gateway gw({"controller", ""});
  trainer::TrainerConfig tc;
  LocalTrainer trainer(registry.build("glm4_moe_lite", "debug", ""), tc, gw, 1 << 14);
  LocalEngine engine(registry.build("glm4_moe_lite", "debug", ""), rollout::EngineOptions{}, gw);
  auto w = trainer.weights(/*copy=*/true);
  w.version = 5;  // stamped as version 5
  engine.load(w, trainer);
  std::vector<rollout::GenerationRequest> reqs(2);
  for (uint64_t i = 0; i < 2; ++i) {
    reqs[i].id = 1 - i;
    reqs[i].prompt = {2, 5, 6};
    reqs[i].sampling.max_new_tokens = 2;
    reqs[i].sampling.seed = i;
  }
  int between = 0;
  auto out = engine.generate(reqs, [&] { ++between; });
  REQUIRE(out.size() == 2);
  CHECK(out[0].id == 0);  // sorted by id
  CHECK(out[0].policy_versions == std::vector<int64_t>{5, 5});
  CHECK(between >= 2);  // called between decode steps
  CHECK_THROWS_WITH_AS(trainer.send(w, {"nobody/0"}), doctest::Contains("nobody/0"), std::runtime_error);
}

TEST_CASE("in-flight rollouts: a checkpoint keeps each completion's routed experts and sparse-attention selections") {
  Batch b;
  b.step = 4;
  b.rollout_time = 1.5;
  b.problems.push_back({"1+1", "2", {}, 0});
  auto with = completion(3, {1, 1, 2});
  with.routed_experts = torch::randint(0, 8, {4, 2, 3}, torch::kInt64);   // [P + n - 1, L, K]
  with.topk_indices = torch::randint(-1, 4, {4, 1, 5}, torch::kInt64);    // [P + n - 1, Ls, W]
  auto without = completion(4, {2});
  b.completions = {with, without};
  auto back = decode_in_flight(encode_in_flight({b}), 3, "test");
  REQUIRE(back.size() == 1);
  REQUIRE(back[0].completions.size() == 2);
  const auto& c = back[0].completions[0];
  CHECK(torch::equal(c.routed_experts, with.routed_experts));
  CHECK(torch::equal(c.topk_indices, with.topk_indices));
  CHECK((c.topk_indices.scalar_type() == torch::kInt64));
  CHECK_FALSE(back[0].completions[1].routed_experts.defined());
  CHECK_FALSE(back[0].completions[1].topk_indices.defined());
}

TEST_CASE("in-flight rollouts: a file whose values no rollout gives is refused by file, step, completion and field") {
  auto file_with = [](const std::function<void(Batch&)>& edit) {
    Batch b;
    b.step = 4;
    b.problems.push_back({"1+1", "2", {}, 0});
    auto c = completion(3, {1, 1, 2});
    c.routed_experts = torch::randint(0, 8, {4, 2, 3}, torch::kInt64);
    b.completions = {c, completion(4, {2})};
    edit(b);
    return encode_in_flight({b});
  };
  auto refused = [](const std::string& bytes, const std::string& want) {
    CAPTURE(want);
    CHECK_THROWS_WITH_AS(decode_in_flight(bytes, 3, "F"), doctest::Contains(want.c_str()), std::invalid_argument);
  };
  CHECK_NOTHROW(decode_in_flight(file_with([](Batch&) {}), 3, "F"));
  refused(file_with([](Batch& b) { b.completions[0].logprobs[1] = std::nanf(""); }),
          "F: step 4 completion 3: log-prob nan of token 1 is not a log-probability");
  refused(file_with([](Batch& b) { b.completions[1].logprobs[0] = 50; }), "completion 4: log-prob 50.000000 of token 0");
  refused(file_with([](Batch& b) { b.completions[1].entropies[0] = -1; }), "entropy -1.000000 of token 0");
  refused(file_with([](Batch& b) { b.completions[0].routed_experts = torch::zeros({3, 2, 3}, torch::kInt64); }),
          "routed experts [P + n - 1, L, K] has 3 rows for 4 tokens");
  refused(file_with([](Batch& b) { b.completions[0].routed_experts[0][0][0] = -1; }), "holds the expert id -1");
  refused(file_with([](Batch& b) { b.problems.push_back({"2+2", "4", {}, 0}); b.completions.push_back(completion(5, {2})); }),
          "step 4: 3 completions for 2 problems");
  refused(file_with([](Batch& b) { b.problems.clear(); }), "step 4: 2 completions for 0 problems");
  refused(file_with([](Batch& b) { b.completions[1].id = 3; }), "completion 3: a second completion with this id");
  refused(file_with([](Batch& b) { b.rollout_time = std::nan(""); }), "step 4: rollout_time nan is not a duration");
  refused(file_with([](Batch& b) { b.completions[1].time_to_first_token_s = -1; }), "time_to_first_token_s -1.000000");
  refused(file_with([](Batch& b) {
            auto& c = b.completions[1];
            c.tokens.clear(), c.logprobs.clear(), c.entropies.clear(), c.policy_versions.clear();
          }),
          "completion 4: no tokens");
  // The routed experts' shape edited in the bytes (each edit keeps the length): a negative size;
  // the shape's key renamed, so that the ids come without one (they used to be dropped unseen).
  auto edited = [&](const std::string& from, const std::string& to) {
    auto bytes = file_with([](Batch&) {});
    const auto at = bytes.find(from);
    REQUIRE(at != std::string::npos);
    return bytes.replace(at, from.size(), to);
  };
  const std::string shape_key = "\xb4routed_experts_shape";  // fixstr(20), then fixarray(3) [4, 2, 3]
  refused(edited(shape_key + "\x93\x04\x02\x03", shape_key + "\x93\x04\xfe\x03"),
          "routed experts [P + n - 1, L, K]: the shape [4, -2, 3] is not 3 sizes >= 0");
  refused(edited(shape_key + "\x93\x04\x02\x03", shape_key + "\x93\x04\x02\x02"),
          "routed experts [P + n - 1, L, K]: 24 ids do not fill the shape [4, 2, 2]");
  refused(edited(shape_key, "\xb4routed_experts_other"), "routed experts [P + n - 1, L, K]: 24 ids without a shape");
  // A field of another type (a string where the problem's target, an integer, goes).
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(3);
  pk.pack(std::string("format")), pk.pack(std::string("kiln.in_flight_rollouts"));
  pk.pack(std::string("version")), pk.pack(1);
  pk.pack(std::string("batches")), pk.pack_array(1), pk.pack_map(1), pk.pack(std::string("step")), pk.pack(std::string("x"));
  refused(std::string(buf.data(), buf.size()), "a field holds a value of another type");
}

TEST_CASE("resume: the settings that differ from the run's config.toml are listed, ignored keys left out") {
  const std::string before = "[algorithm]\nlr = 0.002\nkl_coef = 0.0\n\n[run]\nseed = 1\nsteps = 3\nresume_from = \"\"\n";
  const std::string after =
      "[algorithm]\nlr = 0.001\nkl_coef = 0.0\ntop_k = 5\n\n[run]\nseed = 7\nsteps = 9\nresume_from = \"r/step_3\"\n";
  CHECK(changed_settings(before, after, {"run.steps", "run.resume_from"}) ==
        std::vector<std::string>{"algorithm.lr: 0.002 -> 0.001", "algorithm.top_k: (none) -> 5", "run.seed: 1 -> 7"});
  CHECK(changed_settings(before, before, {}).empty());
}

TEST_CASE("replay frames: routed experts, then sparse-attention selections when every item has them, read back by name and shape") {
  auto e0 = torch::randint(0, 8, {4, 2, 3}, torch::kInt64), e1 = torch::randint(0, 8, {2, 2, 3}, torch::kInt64);
  auto k0 = torch::randint(-1, 4, {4, 1, 5}, torch::kInt64), k1 = torch::randint(-1, 2, {2, 1, 5}, torch::kInt64);
  auto frames = messaging::replay_frames({e0, e1}, {k0, k1});
  REQUIRE(frames.size() == 4);
  CHECK(frames[0].name == "routed_experts.0");
  CHECK(frames[3].name == "topk_indices.1");
  auto back = messaging::read_replay_frames(frames, {4, 2}, "test");
  REQUIRE(back.topk_indices.size() == 2);
  CHECK(torch::equal(back.routed_experts[1], e1));
  CHECK(torch::equal(back.topk_indices[0], k0));
  // An item without selections: only the routed experts travel; one without experts: nothing.
  CHECK(messaging::replay_frames({e0, e1}, {k0, torch::Tensor()}).size() == 2);
  CHECK(messaging::replay_frames({e0, torch::Tensor()}, {k0, k1}).empty());
  CHECK(messaging::read_replay_frames({}, {4, 2}, "test").routed_experts.empty());
  auto fewer = frames;
  fewer.pop_back();
  CHECK_THROWS_WITH_AS(messaging::read_replay_frames(fewer, {4, 2}, "test"),
                       doctest::Contains("test: 3 replay tensors for 2 samples (expected 0, 2 or 4)"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(messaging::read_replay_frames(frames, {4, 3}, "test"),
                       doctest::Contains("routed experts 'routed_experts.1' must be I64 [P + n - 1 = 3, L, K] (sample 1)"),
                       std::invalid_argument);
}

TEST_CASE("rollout.generate / rollout.result (generate_messages.hpp): requests and completions round-trip with their routed experts, and a wrong count, an unknown id or frames that do not fit are refused naming the sender") {
  rollout::GenerationRequest q;
  q.id = 7;
  q.prompt = {3, 4, 5};
  q.sampling.temperature = 0.7;
  q.sampling.top_p = 0.9;
  q.sampling.top_k = 5;
  q.sampling.max_new_tokens = 3;
  q.sampling.seed = 11;
  q.sampling.stop_token_ids = {2};
  const auto back = rollout::from_spec(rollout::to_spec(q));
  CHECK(back.id == 7);
  CHECK(back.prompt == q.prompt);
  CHECK(back.sampling.temperature == 0.7);
  CHECK(back.sampling.top_p == 0.9);
  CHECK(back.sampling.top_k == 5);
  CHECK(back.sampling.max_new_tokens == 3);
  CHECK(back.sampling.seed == 11);
  CHECK(back.sampling.stop_token_ids == std::vector<int64_t>{2});

  auto c = completion(7, {4, 4});  // prompt {2, 5}, 2 tokens
  c.routed_experts = torch::arange(3 * 2 * 2, torch::kInt64).reshape({3, 2, 2});  // [P + n - 1, L, K]
  c.finish_reason = rollout::FinishReason::stop;
  auto asked = q;
  asked.prompt = c.prompt;
  const auto request = messaging::make_envelope(messaging::RolloutGenerate{}, messaging::Kind::request, "a", "b");
  const auto reply = rollout::result_reply(request, {c});
  const auto got = rollout::read_result(reply, {asked}, "node x");
  REQUIRE(got.size() == 1);
  CHECK(got[0].id == 7);
  CHECK(got[0].prompt == c.prompt);
  CHECK(got[0].tokens == c.tokens);
  CHECK(got[0].logprobs == c.logprobs);
  CHECK(got[0].policy_versions == c.policy_versions);
  CHECK(got[0].finish_reason == rollout::FinishReason::stop);
  CHECK(torch::equal(got[0].routed_experts, c.routed_experts));

  CHECK_THROWS_WITH_AS(rollout::read_result(reply, {asked, asked}, "node x"),
                       doctest::Contains("node x answered 1 completions for 2 requests"), std::runtime_error);
  auto other = asked;
  other.id = 8;
  CHECK_THROWS_WITH_AS(rollout::read_result(reply, {other}, "node x"),
                       doctest::Contains("node x answered an unknown request id 7"), std::runtime_error);
  auto longer = asked;
  longer.prompt.push_back(9);  // 4 rows expected, the frame has 3
  CHECK_THROWS_WITH_AS(rollout::read_result(reply, {longer}, "node x"), doctest::Contains("node x"),
                       std::runtime_error);
}

TEST_CASE("ref.logprobs (ref_messages.hpp): completions reach the receiver as samples with their replay frames or without, and answers of the wrong shape are refused naming the sender") {
  auto c = completion(3, {0, 0});
  c.routed_experts = torch::arange(3 * 2 * 2, torch::kInt64).reshape({3, 2, 2});
  bool replay = false;
  auto samples = reference::requested_samples(reference::logprobs_request({c}, true, "a", "b"), &replay);
  REQUIRE(samples);
  CHECK(replay);
  REQUIRE(samples->size() == 1);
  CHECK((*samples)[0].prompt == c.prompt);
  CHECK((*samples)[0].completion == c.tokens);
  CHECK(torch::equal((*samples)[0].routed_experts, c.routed_experts));
  samples = reference::requested_samples(reference::logprobs_request({c}, false, "a", "b"), &replay);
  REQUIRE(samples);
  CHECK_FALSE(replay);
  CHECK_FALSE((*samples)[0].routed_experts.defined());
  auto empty = c;
  empty.tokens.clear();
  empty.routed_experts = torch::Tensor();
  auto refused = reference::requested_samples(reference::logprobs_request({empty}, false, "a", "b"), &replay);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == messaging::ErrorCode::bad_message);
  CHECK(refused.error().message.find("empty prompt or completion") != std::string::npos);

  auto answer = [](std::vector<std::vector<float>> lp) {
    return messaging::make_envelope(messaging::RefLogprobsResult{std::move(lp)}, messaging::Kind::reply, "b", "a");
  };
  CHECK(reference::read_logprobs(answer({{-1.f, -2.f}}), {c}, "rank 1") == std::vector<std::vector<float>>{{-1.f, -2.f}});
  CHECK_THROWS_WITH_AS(reference::read_logprobs(answer({}), {c}, "rank 1"),
                       doctest::Contains("rank 1 answered 0 samples for 1"), std::runtime_error);
  CHECK_THROWS_WITH_AS(reference::read_logprobs(answer({{-1.f}}), {c}, "rank 1"),
                       doctest::Contains("rank 1 answered 1 log-probs for a completion of 2 tokens"), std::runtime_error);
}

TEST_CASE("the paths in printed commands are one shell word each") {
  using controller::shell_word;
  CHECK(shell_word("runs/default/checkpoints/step_000003") == "runs/default/checkpoints/step_000003");
  CHECK(shell_word("/a b/c") == "'/a b/c'");
  CHECK(shell_word("it's $(x)") == "'it'\\''s $(x)'");
  CHECK(shell_word("") == "''");
  CHECK(shell_word("a*b;c") == "'a*b;c'");
  CHECK(controller::as_argument("--set/config.toml") == "./--set/config.toml");
  CHECK(controller::as_argument("/abs/config.toml") == "/abs/config.toml");
}

TEST_CASE("run memory: every process and copy the run holds on this machine is counted, by the device each copy lives on") {
  auto need = [](const std::function<void(Config&)>& edit) {
    Config c;
    c.model.device = "cpu";
    c.model.dtype = "bf16";
    edit(c);
    return run_host_bytes_per_parameter(c);
  };
  // One process: the trainer (bf16 20 B: fp32 masters and their gradients too), the in-process
  // engine and reference (2 B each in bf16).
  auto one = need([](Config&) {});
  CHECK(one.bytes == 24);
  CHECK(one.parts == "the trainer's bf16 weights and gradients, fp32 masters, their gradients and AdamW's moments "
                     "(20 B), the engine's copy (2 B), the reference's copy (2 B)");
  CHECK(need([](Config& c) { c.model.dtype = "fp32"; }).bytes == 16 + 4 + 4);
  // Nodes run on this machine too: a trainer node, three CPU engine nodes, a reference node.
  auto nodes = need([](Config& c) {
    c.placement.mode = "multi_process";
    c.placement.trainer = "process";
    c.placement.reference = "process";
    c.placement.rollout_engines = 3;
  });
  CHECK(nodes.bytes == 20 + 3 * 2 + 2);
  CHECK(nodes.parts.find("3 engines' copies (2 B each)") != std::string::npos);
  // Engines and the reference on GPUs hold no copy here; one engine of two on the CPU does.
  CHECK(need([](Config& c) {
          c.placement.mode = "multi_process";
          c.placement.rollout_engines = 2;
          c.placement.rollout_device = {"cuda:0", "cpu"};
          c.placement.reference = "process";
          c.placement.reference_device = "cuda:1";
        }).bytes == 20 + 2);
  // A trainer on the GPU: only the CPU copies count.
  CHECK(need([](Config& c) {
          c.model.device = "cuda";
          c.placement.mode = "multi_process";
          c.placement.rollout_device = {"cpu"};
        }).bytes == 2);
  CHECK(need([](Config& c) { c.model.device = "cuda"; }).bytes == 0);
  // Colocated engines and HTTP servers hold no copy of their own; a colocated reference does.
  CHECK(need([](Config& c) { c.placement.mode = "colocated"; }).bytes == 22);
  CHECK(need([](Config& c) { c.rollout.backend = "http"; c.placement.reference = "colocated"; }).bytes == 22);
  // Asynchronous rollouts: up to 3 host snapshots of the weights, whatever the trainer's device,
  // unless the engines read the trainer's own (colocated) or take a broadcast (collective).
  CHECK(need([](Config& c) { c.algorithm.staleness = 2; }).bytes == 24 + 3 * 2);
  CHECK(need([](Config& c) { c.algorithm.staleness = 1; c.model.device = "cuda"; }).bytes == 3 * 2);
  CHECK(need([](Config& c) { c.algorithm.staleness = 1; c.placement.mode = "colocated"; }).bytes == 22);
  CHECK(need([](Config& c) {  // a trainer node pushes from its live policy: no snapshot
          c.algorithm.staleness = 1;
          c.placement.mode = "multi_process";
          c.placement.trainer = "process";
          c.placement.reference = "process";
        }).bytes == 20 + 2 + 2);
  CHECK(need([](Config& c) {
          c.algorithm.staleness = 1;
          c.model.device = "cuda";
          c.placement.mode = "multi_process";
          c.weight_sync.transport = "collective";
        }).bytes == 0);
  // Several trainer ranks on this machine: each its weights and gradients, the fp32 gradient it
  // reduces and 1/dp of the fp32 masters, their gradients and the moments, over its share of the
  // parameters (expert parallel); rank 0's engine and reference.
  Config dp;
  dp.model.device = "cpu";
  dp.model.dtype = "bf16";
  dp.parallel.dp = 2;
  auto two = run_host_bytes_per_parameter(dp, 2);
  CHECK(two.bytes == 2 * (2 * 2 + 4 + 16.0 / 2) + 2 + 2);
  CHECK(two.parts.find("2 trainer ranks on this machine, each its weights and gradients (2 x 2 B), the fp32 gradient "
                       "it reduces (4 B) and 1/2 of the fp32 masters, their gradients and AdamW's moments (16 B)") == 0);
  CHECK(run_host_bytes_per_parameter(dp, 1).bytes == 2 * 2 + 4 + 16.0 / 2 + 2 + 2);  // the other rank on another host
  dp.parallel.dp = 1;
  dp.parallel.ep = 2;
  dp.placement.mode = "colocated";
  dp.placement.reference = "colocated";
  auto ep = run_host_bytes_per_parameter(dp, 2, 0.5);
  CHECK(ep.bytes == doctest::Approx(2 * 0.5 * (2 * 2 + 4 + 16.0) + 2 * 0.5 * 2));
  CHECK(ep.parts.find("over its 50% of the parameters") != std::string::npos);
  CHECK(ep.parts.find("a colocated reference's copy in each (2 B of its share)") != std::string::npos);
}

TEST_CASE("run directory: one a refused run made is removed again with its nodes' pid files and the parents it made") {
  namespace fs = std::filesystem;
  const fs::path base = test::scratch_path("run_lock");
  fs::create_directories(base);
  {  // refused after its nodes started: .lock and trainer_node.pid are all it left
    RunLock lock(base / "new/parent/run", "", false);
    std::ofstream(base / "new/parent/run/trainer_node.pid") << "123\n";
    std::ofstream(base / "new/parent/run/rollout_node_1.pid") << "124\n";
  }
  CHECK_FALSE(fs::exists(base / "new/parent/run/.lock"));
  CHECK_FALSE(fs::exists(base / "new/parent/run"));
  CHECK_FALSE(fs::exists(base / "new"));
  CHECK(fs::exists(base));  // existed before
  {  // a run that wrote anything else keeps its directory (and its pid files)
    RunLock lock(base / "kept/run/", "", false);
    std::ofstream(base / "kept/run/trainer_node.pid") << "123\n";
    std::ofstream(base / "kept/run/config.toml") << "x\n";
  }
  CHECK(fs::exists(base / "kept/run/config.toml"));
  CHECK(fs::exists(base / "kept/run/trainer_node.pid"));
  {  // a directory that existed is never removed, nor a parent another file lives in
    fs::create_directories(base / "existing");
    RunLock lock(base / "existing/run", "", false);
  }
  CHECK(fs::exists(base / "existing"));
  CHECK_FALSE(fs::exists(base / "existing/run"));
  {
    fs::create_directories(base / "shared");
    RunLock lock(base / "shared/a/run", "", false);
    std::ofstream(base / "shared/a/other_file") << "not the run's\n";
  }
  CHECK(fs::exists(base / "shared/a/other_file"));
  CHECK_FALSE(fs::exists(base / "shared/a/run"));
  {  // through a symbolic link: the physical directories made go, not their lexical namesakes
    fs::create_directories(base / "real/deep");
    fs::create_directories(base / "victim/run");  // the user's, empty
    fs::create_directory_symlink(base / "real/deep", base / "link");
    RunLock lock(base / "link/made/run", "", false);
    CHECK(fs::exists(base / "real/deep/made/run/.lock"));
  }
  CHECK_FALSE(fs::exists(base / "real/deep/made"));
  CHECK(fs::exists(base / "real/deep"));
  {  // "link/.." is real/, not base/: with "." or ".." in the path nothing is removed
    RunLock lock(base / "link/../victim/run", "", false);
    CHECK(fs::exists(base / "real/victim/run/.lock"));
  }
  CHECK(fs::exists(base / "victim/run"));  // the user's directory is untouched
  CHECK(fs::exists(base / "real/victim/run"));
  // A run directory that cannot be made (a name past NAME_MAX) leaves no parent it made.
  CHECK_THROWS_WITH_AS(RunLock(base / "p1/p2" / std::string(300, 'c'), "", false),
                       doctest::Contains("cannot create the run directory"), std::runtime_error);
  CHECK_FALSE(fs::exists(base / "p1"));
}

TEST_CASE("run directory: an overwrite sets the replaced run's checkpoints aside first, puts them back on request, deletes them last with the asides of overwrites killed mid-delete, and refuses a model inside any of them") {
  namespace fs = std::filesystem;
  const fs::path run = test::scratch_path("replaced_checkpoints");
  fs::create_directories(run / "checkpoints/step_000002");
  std::ofstream(run / "checkpoints/step_000002/state.json") << "{}\n";
  // An earlier overwrite killed in its delete: a half-deleted checkpoint, but outside checkpoints/.
  fs::create_directories(run / "checkpoints.replaced/step_000001");
  std::ofstream(run / "checkpoints.replaced/step_000001/state.json") << "{}\n";
  fs::create_directories(run / "checkpoints.replaced.2/step_000001");
  // Not kiln's asides, kept: other names, and a file of an aside's name.
  fs::create_directories(run / "checkpoints.replacedX");
  fs::create_directories(run / "checkpoints.replaced.mine");
  std::ofstream(run / "checkpoints.replaced.7") << "a file\n";
  // A link among the asides goes, not what it points to.
  const fs::path outside = test::scratch_path("replaced_checkpoints_outside");
  fs::create_directories(outside);
  std::ofstream(outside / "keep.txt") << "the user's\n";
  fs::create_directory_symlink(outside, run / "checkpoints.replaced.9");
  CHECK(newest_checkpoint(run) == run / "checkpoints/step_000002");  // asides are never offered

  // Before the run starts: a model inside what the overwrite deletes is refused by its path.
  for (const char* inside : {"checkpoints/step_000002", "checkpoints.replaced/step_000001", "checkpoints.replaced.2"})
    CHECK_THROWS_WITH_AS(check_run_dir(run, "", true, (run / inside).string()),
                         doctest::Contains("which run.overwrite deletes"), std::invalid_argument);
  for (const char* kept : {"checkpoints.replacedX", "checkpoints.replaced.mine"})
    CHECK_NOTHROW(check_run_dir(run, "", true, (run / kept).string()));
  CHECK_NOTHROW(check_run_dir(run, "", false, (run / "checkpoints.replaced").string()));  // no overwrite, nothing deleted

  // Set aside (checkpoints.replaced and .2 taken: .3), an empty checkpoints/ in its place; put back.
  auto aside = set_aside_checkpoints(run);
  CHECK(aside == run / "checkpoints.replaced.3");
  CHECK(fs::exists(aside / "step_000002/state.json"));
  CHECK(fs::is_empty(run / "checkpoints"));
  CHECK(newest_checkpoint(run).empty());
  CHECK(put_back_checkpoints(run, aside));
  CHECK(fs::exists(run / "checkpoints/step_000002/state.json"));
  CHECK_FALSE(fs::exists(aside));

  // Set aside again, then deleted with the leftovers, each leftover named.
  aside = set_aside_checkpoints(run);
  const auto lines = delete_replaced_checkpoints(run, aside);
  REQUIRE(lines.size() == 3);  // checkpoints.replaced, .2 and the link .9; not this run's own aside
  CHECK(lines[0].find("deleted '" + (run / "checkpoints.replaced").string() + "'") == 0);
  CHECK(lines[1].find("checkpoints.replaced.2'") != std::string::npos);
  CHECK(lines[2].find("checkpoints.replaced.9'") != std::string::npos);
  for (const char* gone : {"checkpoints.replaced", "checkpoints.replaced.2", "checkpoints.replaced.3", "checkpoints.replaced.9"})
    CHECK_MESSAGE(!fs::exists(fs::symlink_status(run / gone)), gone);
  for (const char* kept : {"checkpoints.replacedX", "checkpoints.replaced.mine", "checkpoints.replaced.7"})
    CHECK_MESSAGE(fs::exists(run / kept), kept);
  CHECK(fs::exists(outside / "keep.txt"));
  CHECK(fs::is_empty(run / "checkpoints"));
  CHECK(delete_replaced_checkpoints(run, {}).empty());  // nothing left to delete
  fs::remove(run / "checkpoints");
  CHECK(set_aside_checkpoints(run).empty());  // no checkpoints: nothing set aside, nothing made
  CHECK_FALSE(fs::exists(run / "checkpoints"));
}
