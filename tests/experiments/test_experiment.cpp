// Experiment files: defaults, TOML overrides, --set, and bad input rejected by name.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "../scratch.hpp"
#include "actors/shown_value.hpp"
#include "experiments/experiment.hpp"

using kiln::experiments::ExperimentConfig;

namespace {
std::string write(const std::string& text) {
  auto p = kiln::test::scratch_path("experiment.toml");
  std::ofstream(p) << text;
  return p;
}
}  // namespace

TEST_CASE("the built-in default is valid and round-trips through TOML") {
  ExperimentConfig c;
  CHECK_NOTHROW(c.validate());
  CHECK(c.task.name == "next_digit");
  auto back = ExperimentConfig::from_file(write(c.to_toml()));
  CHECK(back.to_toml() == c.to_toml());
}

TEST_CASE("a file overrides some keys and --set any") {
  auto c = ExperimentConfig::from_file(write("[run]\nsteps = 7\n[algorithm]\nlr = 1e-4\nkl_coef = 0.1\n"));
  CHECK(c.run.steps == 7);
  CHECK(c.trainer.lr == 1e-4);
  CHECK(c.trainer.loss.kl_coef == 0.1);
  CHECK(c.algorithm.samples_per_prompt == 16);  // untouched default
  c.set("algorithm.temperature=0.7");
  c.set("task.name=arithmetic");  // bare text
  c.set("logging.plot=false");
  c.set("algorithm.lr=3");  // an integer where a number is expected is fine
  CHECK(c.trainer.logprobs.temperature == 0.7);
  CHECK(c.task.name == "arithmetic");
  CHECK_FALSE(c.logging.plot);
  CHECK(c.trainer.lr == 3.0);
}

TEST_CASE("type and range errors echo the value they refuse") {
  auto refused = [](const std::string& set) {
    ExperimentConfig c;
    try {
      c.set(set);
      c.validate();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(refused("run.steps=\"many\"").find("'run.steps' must be an integer, got \"many\"") != std::string::npos);
  CHECK(refused("run.steps=1.5").find("'run.steps' must be an integer, got 1.5") != std::string::npos);
  CHECK(refused("run.steps=[1]").find("'run.steps' must be an integer, got an array") != std::string::npos);
  // Past int64 TOML cannot hold the number: --set reads it as text, and the error says why.
  CHECK(refused("run.steps=99999999999999999999").find("must be an integer in [-2^63, 2^63), got 99999999999999999999") !=
        std::string::npos);
  CHECK(refused("run.steps=\"12\"").find("'run.steps' must be an integer, got \"12\"") != std::string::npos);
  CHECK(refused("algorithm.lr=\"big\"").find("'algorithm.lr' must be a number, got \"big\"") != std::string::npos);
  CHECK(refused("run.overwrite=1").find("'run.overwrite' must be true or false, got 1") != std::string::npos);
  CHECK(refused("model.device=0").find("'model.device' must be a string, got 0") != std::string::npos);
  CHECK(refused("run.steps=0").find("'run.steps' must be >= 1, got 0") != std::string::npos);
  CHECK(refused("algorithm.top_p=1.5").find("'algorithm.top_p' must be in (0, 1], got 1.5") != std::string::npos);
  CHECK(refused("algorithm.lr=-0.001").find("'algorithm.lr' must be > 0, got -0.001") != std::string::npos);
  CHECK(refused("algorithm.temperature=1e-300").find("'algorithm.temperature' must be >= 1e-5") != std::string::npos);
  CHECK(refused("rollout.block_size=8192").find("must be <= 4096 tokens, got 8192") != std::string::npos);
  CHECK(refused("rollout.block_size=0").find("'rollout.block_size' must be >= 1, got 0") != std::string::npos);
  CHECK(refused("rollout.max_batch=0").find("'rollout.max_batch' must be >= 1, got 0") != std::string::npos);
  CHECK(refused("task.min_digits=0").find("accepted") != std::string::npos);  // read by the arithmetic task only
  CHECK(refused("task.name=bogus").find("got \"bogus\"") != std::string::npos);
  CHECK(refused("model.dtype=fp16").find("'model.dtype' must be \"fp32\" or \"bf16\", got \"fp16\"") != std::string::npos);
  CHECK(refused("rollout.backend=carrier").find("got \"carrier\"") != std::string::npos);
  ExperimentConfig a;
  a.set("task.name=arithmetic");
  a.set("task.max_digits=12");
  CHECK_THROWS_WITH_AS(a.validate(),
                       doctest::Contains("'task.max_digits' must be in [task.min_digits, 9] = [1, 9] with task.name "
                                         "\"arithmetic\", got 12"),
                       std::invalid_argument);
  a.set("task.max_digits=3");
  a.set("task.operators=+/");
  CHECK_THROWS_WITH_AS(a.validate(), doctest::Contains("'task.operators' must be a non-empty string"), std::invalid_argument);
  a.set("task.operators=*");
  CHECK_NOTHROW(a.validate());
}

TEST_CASE("unknown keys, wrong types and bad values are rejected by name") {
  CHECK_THROWS_WITH_AS(ExperimentConfig::from_file(write("[algorithm]\nlearning_rate = 0.1\n")),
                       doctest::Contains("'algorithm.learning_rate' is not an experiment key"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(ExperimentConfig::from_file(write("[run]\nsteps = \"many\"\n")),
                       doctest::Contains("'run.steps' must be an integer"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(ExperimentConfig::from_file(write("[run\nsteps = 3\n")), doctest::Contains("line 1"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(ExperimentConfig::from_file(write("steps = 3\n")), doctest::Contains("'steps' must be a [section]"),
                       std::invalid_argument);
  ExperimentConfig c;
  CHECK_THROWS_WITH_AS(c.set("algorithm.nope=1"), doctest::Contains("'algorithm.nope'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("steps=1"), doctest::Contains("section.key"), std::invalid_argument);
  // A file after --set is taken as one more override (CLI11 gives --set every value after it).
  CHECK_THROWS_WITH_AS(c.set("exp.toml"), doctest::Contains("an experiment file goes before --set"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("steps"), "--set 'steps': expected section.key=value", std::invalid_argument);
  // A line break in the value started a second key, which was dropped without a word.
  CHECK_THROWS_WITH_AS(c.set("run.steps=1\nalgorithm.lr=5.0"), doctest::Contains("more than one TOML key-value pair"),
                       std::invalid_argument);
  // Bare text's later line that reads as a key was dropped into the text (the name "abc\nalgorithm.lr = 5").
  CHECK_THROWS_WITH_AS(c.set("run.name=abc\nalgorithm.lr = 5"), doctest::Contains("'algorithm.lr = 5' reads as another key"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("run.name=abc\r\n run . seed=1"), doctest::Contains("reads as another key"),
                       std::invalid_argument);
  for (const char* quoted_key : {"\"run\".seed = 1", "'run'.seed = 1", "run.\"seed\"=1", "\"a\\\"b\".c = 1"})
    CHECK_THROWS_WITH_AS(c.set(std::string("run.name=abc\n") + quoted_key), doctest::Contains("reads as another key"),
                         std::invalid_argument);
  ExperimentConfig kept;  // no '=' after a quoted part: text
  kept.set("run.name=abc\n\"quoted\" words");
  CHECK(kept.run.name == "abc\n\"quoted\" words");
  CHECK(c.run.name != "abc");
  CHECK_THROWS_WITH_AS(c.set("run.name= "), doctest::Contains("no value after '='"), std::invalid_argument);
  // The parser's own messages name the key, not a stand-in.
  CHECK_THROWS_WITH_AS(c.set("run.name=\"a\"\n[name]"), doctest::Contains("'name'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("run.=1"), doctest::Contains("key 'run.' is not an experiment key"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("run.\xFFname=1"), doctest::Contains("key 'run.\\xFFname' is not an experiment key"),
                       std::invalid_argument);
  // Values in errors: control characters, C1 controls, no-break spaces and bytes not UTF-8 escaped.
  CHECK_THROWS_WITH_AS(c.set("run.seed=\xC2\xA0" "5"), "--set run.seed: key 'run.seed' must be an integer, got \"\\u00A05\"",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("run.seed=ab\rc\x1b[2J"), doctest::Contains("got \"ab\\rc\\u001B[2J\""), std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("run.na\xC2\x85me=1"), doctest::Contains("key 'run.na\\u0085me'"), std::invalid_argument);
  CHECK(kiln::printable("caf\xC3\xA9 \xFF\xE0\x80 \xF0\x9F\x99\x82") == "caf\xC3\xA9 \\xFF\\xE0\\x80 \xF0\x9F\x99\x82");
  // A NUL cuts a path short where it reaches C: refused by key (a run directory was made at the cut).
  CHECK_THROWS_WITH_AS(c.set("run.output_dir=\"/tmp/a\\u0000b\""),
                       "--set run.output_dir: key 'run.output_dir' must not hold U+0000 (NUL), got \"/tmp/a\\u0000b\"",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("rollout.urls=[\"http://a:1\", \"x\\u0000\"]"), doctest::Contains("must not hold U+0000"),
                       std::invalid_argument);
  ExperimentConfig empty;
  empty.set("run.name=\"\"");
  CHECK(empty.run.name.empty());
  // A key's control characters and no-break spaces are shown as escapes, not printed raw.
  CHECK_THROWS_WITH_AS(c.set("algorithm.no\rpe=1"), doctest::Contains("key 'algorithm.no\\rpe' is not an experiment key"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("run.steps\xC2\xA0=1"), doctest::Contains("key 'run.steps\\u00A0' is not"),
                       std::invalid_argument);
  ExperimentConfig text;
  text.set("task.name=two\nlines");  // bare text with a line break is text (a path may hold one)
  CHECK(text.task.name == "two\nlines");
  text.set("task.name=/tmp/nl\nsystem \"touch x\"\n`a == b`");  // no line opens as key = ...
  CHECK(text.task.name == "/tmp/nl\nsystem \"touch x\"\n`a == b`");
  text.set("task.name=\"two\\nlines\"");  // quoted, the break written as \n
  CHECK(text.task.name == "two\nlines");
  c.set("algorithm.samples_per_prompt=1");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("'algorithm.samples_per_prompt'"), std::invalid_argument);
  ExperimentConfig d;
  d.set("algorithm.staleness=-1");
  CHECK_THROWS_WITH_AS(d.validate(), doctest::Contains("'algorithm.staleness'"), std::invalid_argument);
  ExperimentConfig keep;
  keep.set("algorithm.keep_logits_gib=-0.5");
  CHECK_THROWS_WITH_AS(keep.validate(), doctest::Contains("'algorithm.keep_logits_gib' must be in [0, 1048576]"),
                       std::invalid_argument);
  keep.set("algorithm.keep_logits_gib=12");
  CHECK_NOTHROW(keep.validate());
  CHECK(keep.trainer.keep_logits_gib == 12.0);
  keep.set("algorithm.activation_checkpointing_layers=-1");
  CHECK_THROWS_WITH_AS(keep.validate(), doctest::Contains("'algorithm.activation_checkpointing_layers' must be >= 0"),
                       std::invalid_argument);
  keep.set("algorithm.activation_checkpointing_layers=3");
  CHECK(keep.trainer.activation_checkpointing_layers == 3);
  CHECK_THROWS_WITH_AS(keep.validate(),
                       doctest::Contains("'algorithm.activation_checkpointing_layers' is 3 but activation checkpointing "
                                         "is off: set algorithm.activation_checkpointing = true too"),
                       std::invalid_argument);
  keep.set("algorithm.activation_checkpointing=true");
  CHECK_NOTHROW(keep.validate());
  ExperimentConfig e;
  e.set("algorithm.kl_estimator=k9");
  CHECK_THROWS_WITH_AS(e.validate(), doctest::Contains("'algorithm.kl_estimator'"), std::invalid_argument);
  ExperimentConfig g;
  g.set("parallel.reduce_dtype=fp16");
  CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains("'parallel.reduce_dtype' must be \"fp32\" or \"bf16\", got \"fp16\""),
                       std::invalid_argument);
  // Non-finite numbers at parse time, out-of-range ones at validation, each by key.
  ExperimentConfig f;
  CHECK_THROWS_WITH_AS(f.set("algorithm.lr=inf"), doctest::Contains("'algorithm.lr' must be a finite number"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(f.set("algorithm.tis_cap=nan"),
                       doctest::Contains("'algorithm.tis_cap' must be a finite number, got nan"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(f.set("algorithm.lr=-inf"), doctest::Contains("'algorithm.lr' must be a finite number, got -inf"),
                       std::invalid_argument);
  CHECK(std::isfinite(f.trainer.lr));  // a refused value is not kept
  CHECK(std::isfinite(f.trainer.loss.tis_cap));
  for (const char* bad : {"algorithm.top_p=0", "algorithm.top_k=-1", "algorithm.weight_decay=-5", "algorithm.grad_clip=-1",
                          "algorithm.kl_coef=-1", "algorithm.warmup_steps=-3", "algorithm.tis_cap=0",
                          "algorithm.clip_low=1", "placement.rollout_engines=0", "model.dtype=fp8",
                          "algorithm.update_delay_ms=-1", "placement.trainer=gpu",
                          "placement.trainer=process"}) {  // the last: needs multi_process + a ref process
    CAPTURE(bad);
    ExperimentConfig g;
    g.set(bad);
    const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
    const std::string quoted = "'" + key + "'";
    CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains(quoted.c_str()), std::invalid_argument);
  }
  ExperimentConfig h;  // the RL loss never trains glm5_next's indexers
  h.set("algorithm.train_indexer=true");
  CHECK_THROWS_WITH_AS(h.validate(),
                       doctest::Contains("'algorithm.train_indexer' must be false: the RL loss does not train the "
                                         "sparse-attention indexer"),
                       std::invalid_argument);
  ExperimentConfig k;
  k.set("algorithm.train_indexer=false");
  k.validate();
  ExperimentConfig mtp;  // the multi-token-prediction loss: weight and depths, each checked by name
  mtp.set("algorithm.mtp_loss_weight=0.3");
  mtp.set("algorithm.mtp_depths=7");
  mtp.validate();
  CHECK(mtp.trainer.mtp_loss_weight == 0.3);
  CHECK(mtp.trainer.mtp_depths == 7);
  mtp.set("algorithm.mtp_depths=0");
  CHECK_THROWS_WITH_AS(mtp.validate(), doctest::Contains("'algorithm.mtp_depths' must be in [1, 16]"), std::invalid_argument);
  mtp.set("algorithm.mtp_depths=1");
  mtp.set("algorithm.mtp_loss_weight=-0.5");
  CHECK_THROWS_WITH_AS(mtp.validate(), doctest::Contains("'algorithm.mtp_loss_weight' must be finite and >= 0"),
                       std::invalid_argument);
}

TEST_CASE("the trainer in a process needs every model out of the controller") {
  ExperimentConfig c;
  c.set("placement.mode=multi_process");
  c.set("placement.trainer=process");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("placement.reference \"process\""), std::invalid_argument);
  c.set("placement.reference=process");
  CHECK_NOTHROW(c.validate());
  CHECK(c.to_toml().find("trainer = \"process\"") != std::string::npos);
}

TEST_CASE("rollout.weight_update is disk or distributed, read with rollout.backend http only, and round-trips") {
  ExperimentConfig c;
  c.set("rollout.backend=http");
  c.set("rollout.urls=http://127.0.0.1:30000");
  CHECK(c.rollout.weight_update == "disk");
  c.set("rollout.weight_update=distributed");
  c.set("rollout.weight_update_address=10.0.0.1");
  c.set("rollout.weight_update_timeout_s=30");
  CHECK_NOTHROW(c.validate());
  const auto toml = c.to_toml();
  CHECK(toml.find("weight_update = \"distributed\"") != std::string::npos);
  CHECK(toml.find("weight_update_address = \"10.0.0.1\"") != std::string::npos);
  CHECK(toml.find("weight_update_timeout_s = 30") != std::string::npos);
  c.set("rollout.weight_update=nccl");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("'rollout.weight_update' must be \"disk\""), std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("got \"nccl\""), std::invalid_argument);
  c.set("rollout.weight_update=distributed");
  c.set("rollout.weight_update_timeout_s=0");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("'rollout.weight_update_timeout_s' must be >= 1"),
                       std::invalid_argument);
  ExperimentConfig engine;
  engine.set("rollout.weight_update=distributed");
  CHECK_THROWS_WITH_AS(engine.validate(), doctest::Contains("'rollout.weight_update' is read by rollout.backend \"http\" only"),
                       std::invalid_argument);
}

TEST_CASE("rollout.backend http: rollout.urls as a list or one string round-trips and is checked by name") {
  ExperimentConfig c;
  c.set("rollout.backend=http");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("'rollout.urls' must list at least one server"), std::invalid_argument);
  c.set("rollout.urls=http://127.0.0.1:30000");
  CHECK(c.rollout.urls == std::vector<std::string>{"http://127.0.0.1:30000"});
  CHECK_NOTHROW(c.validate());
  c.set("rollout.urls=[\"http://a:1\", \"http://b:2\"]");
  CHECK(c.rollout.urls == std::vector<std::string>{"http://a:1", "http://b:2"});
  const auto toml = c.to_toml();
  CHECK(toml.find("urls = [\"http://a:1\", \"http://b:2\"]") != std::string::npos);
  ExperimentConfig again;
  for (const auto& line : {std::string("rollout.backend=http"), std::string("rollout.urls=[\"http://a:1\", \"http://b:2\"]")})
    again.set(line);
  CHECK(again.to_toml() == toml);
  CHECK_THROWS_WITH_AS(c.set("rollout.urls=[1, 2]"), doctest::Contains("'rollout.urls' must be a string or a list of strings"),
                       std::invalid_argument);
  c.set("rollout.urls=[\"ftp://a:1\"]");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("http://HOST:PORT"), std::invalid_argument);
  c.set("rollout.urls=[\"http://a:1\"]");
  c.set("placement.mode=multi_process");
  c.set("placement.reference=process");
  c.set("placement.trainer=process");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("'placement.trainer' must be \"controller\" with rollout.backend"),
                       std::invalid_argument);
  ExperimentConfig engine;
  engine.set("rollout.urls=[\"http://a:1\"]");
  CHECK_THROWS_WITH_AS(engine.validate(), doctest::Contains("'rollout.urls' is read by rollout.backend \"http\" only"),
                       std::invalid_argument);
}

TEST_CASE("placement.rollout_device: one device for every engine or one per engine, checked by name") {
  ExperimentConfig c;
  c.set("placement.mode=multi_process");
  c.set("placement.rollout_engines=3");
  CHECK(c.placement.rollout_device.empty());
  CHECK(c.placement.engine_device(2, "cpu") == "cpu");  // model.device
  c.set("placement.rollout_device=cpu");
  CHECK_NOTHROW(c.validate());
  CHECK(c.placement.engine_device(1, "cuda") == "cpu");
  c.set("placement.rollout_device=[\"cuda:1\", \"cuda:2\", \"cuda:3\"]");
  CHECK_NOTHROW(c.validate());
  CHECK(c.placement.engine_device(0, "cuda") == "cuda:1");
  CHECK(c.placement.engine_device(2, "cuda") == "cuda:3");
  const auto toml = c.to_toml();
  CHECK(toml.find("rollout_device = [\"cuda:1\", \"cuda:2\", \"cuda:3\"]") != std::string::npos);
  c.set("placement.rollout_device=[\"cuda:1\", \"cuda:2\"]");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("'placement.rollout_device' lists 2 devices for 3 engines"),
                       std::invalid_argument);
  c.set("placement.rollout_device=[\"cuda:1\", \"gpu1\", \"cuda:3\"]");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("got \"gpu1\""), std::invalid_argument);
  // torch's spelling only: no leading zeros ("cuda:01" would else dodge the one-GPU-each
  // check below as a name other than "cuda:1"), indices within c10::DeviceIndex.
  for (const char* d : {"cuda:01", "cuda:00", "cuda:128", "cuda:99999999999", "cuda:", "cuda:-1", "CPU", ""}) {
    c.set(std::string("placement.rollout_device=[\"cuda:1\", \"") + d + "\", \"cuda:3\"]");
    const std::string named = std::string("got \"") + d + "\"";
    CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains(named.c_str()), std::invalid_argument);
  }
  c.set("placement.rollout_device=[\"cuda:0\", \"cuda:10\", \"cuda:127\"]");
  CHECK_NOTHROW(c.validate());
  c.set("placement.rollout_device=\"\"");  // the text of an empty list in files written before lists
  CHECK(c.placement.rollout_device.empty());
  // A string, or a list of strings: the type error says both.
  CHECK_THROWS_WITH_AS(c.set("placement.rollout_device=5"),
                       doctest::Contains("must be a string or a list of strings"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("placement.rollout_device=[\"cpu\", 1]"),
                       doctest::Contains("must be a string or a list of strings"), std::invalid_argument);
  // The collective weight sync (NCCL): engines and trainer rank 0 on GPUs of their own.
  ExperimentConfig n;
  for (const char* kv : {"model.device=cuda:0", "placement.mode=multi_process", "placement.rollout_engines=2",
                         "weight_sync.transport=collective", "placement.rollout_device=[\"cuda:1\", \"cuda:2\"]"})
    n.set(kv);
  CHECK_NOTHROW(n.validate());
  n.set("placement.rollout_device=[\"cuda:1\", \"cuda:1\"]");
  CHECK_THROWS_WITH_AS(n.validate(), doctest::Contains("puts engine 1 on cuda:1 beside engine 0"), std::invalid_argument);
  n.set("placement.rollout_device=[\"cuda:2\", \"cuda\"]");
  CHECK_THROWS_WITH_AS(n.validate(), doctest::Contains("puts engine 1 on cuda:0 beside trainer rank 0"),
                       std::invalid_argument);
  n.set("placement.rollout_device=[\"cuda:2\", \"cpu\"]");
  CHECK_THROWS_WITH_AS(n.validate(), doctest::Contains("must be a GPU when model.device is one"), std::invalid_argument);
  ExperimentConfig single;
  single.set("placement.rollout_device=cpu");
  CHECK_THROWS_WITH_AS(single.validate(), doctest::Contains("needs placement.mode \"multi_process\""),
                       std::invalid_argument);
  // The mode is named before a list's length, and the engine count's range before both.
  single.set("placement.rollout_device=[\"cpu\", \"cpu\"]");
  CHECK_THROWS_WITH_AS(single.validate(), doctest::Contains("'placement.rollout_device' needs placement.mode"),
                       std::invalid_argument);
  single.set("placement.mode=multi_process");
  single.set("placement.rollout_engines=0");
  CHECK_THROWS_WITH_AS(single.validate(), doctest::Contains("'placement.rollout_engines' must be in [1, 64]"),
                       std::invalid_argument);
  single.set("placement.rollout_engines=1");
  CHECK_THROWS_WITH_AS(single.validate(), doctest::Contains("lists 2 devices for 1 engine ("), std::invalid_argument);
  // model.device and placement.reference_device take the same spellings.
  ExperimentConfig d;
  d.set("model.device=cuda:007");
  CHECK_THROWS_WITH_AS(d.validate(), doctest::Contains("'model.device' must be"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(d.validate(), doctest::Contains("got \"cuda:007\""), std::invalid_argument);  // the value named
  ExperimentConfig r;
  for (const char* kv : {"placement.mode=multi_process", "placement.reference=process", "placement.reference_device=gpu"})
    r.set(kv);
  CHECK_THROWS_WITH_AS(r.validate(), doctest::Contains("'placement.reference_device' must be"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(r.validate(), doctest::Contains("got \"gpu\""), std::invalid_argument);
}

TEST_CASE("max_new_tokens that cannot fit the engine's cache with a prompt is refused before the run") {
  ExperimentConfig c;
  c.set("algorithm.max_new_tokens=1000000");
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("'algorithm.max_new_tokens' 1000000 cannot fit the engine's cache of 16384"),
                       std::invalid_argument);
  c.set("algorithm.max_new_tokens=16383");  // 1024 pages x 16 tokens, one left for the prompt
  CHECK_NOTHROW(c.validate());
  c.set("rollout.cache_blocks=4");
  CHECK_THROWS_AS(c.validate(), std::invalid_argument);
}

TEST_CASE("to_toml writes text and numbers that read back exactly: quotes, backslashes, control characters, all digits") {
  ExperimentConfig c;
  c.set("run.name=say \"hi\" \\ bye");  // bare text with quotes and a backslash
  c.set("run.output_dir=\"runs/tab\\there\"");  // TOML string with an escaped tab
  c.set("algorithm.lr=1.2345678901234567e-4");
  c.set("algorithm.clip_high=0.28");
  auto back = ExperimentConfig::from_file(write(c.to_toml()));
  CHECK(back.run.name == "say \"hi\" \\ bye");
  CHECK(back.run.output_dir == "runs/tab\there");
  CHECK(back.trainer.lr == 1.2345678901234567e-4);  // << kept 6 digits: 0.000123457
  CHECK(back.trainer.loss.clip_high == 0.28);
  CHECK(back.to_toml() == c.to_toml());
  CHECK(c.to_toml().find("clip_high = 0.28\n") != std::string::npos);
}

TEST_CASE("--set takes spaces around the key and the value as a TOML file does, and keeps them inside quotes") {
  ExperimentConfig c;
  c.set("run.steps = 2");
  CHECK(c.run.steps == 2);
  c.set(" task.name =\tarithmetic ");  // bare text: no leading or trailing space kept
  CHECK(c.task.name == "arithmetic");
  c.set("run.name = \" padded \"");
  CHECK(c.run.name == " padded ");
  std::string refused = "accepted";
  try {
    c.set("run.stepz = 3");
  } catch (const std::invalid_argument& e) {
    refused = e.what();
  }
  CHECK(refused.find("run.stepz") != std::string::npos);
  CHECK(refused.find("run.stepz ") == std::string::npos);  // the key named without the space after it
  CHECK_THROWS_WITH_AS(c.set(" = 3"), doctest::Contains("expected section.key=value"), std::invalid_argument);
  c.set("run.name=x\r");  // a script's line end
  CHECK(c.run.name == "x");
}

TEST_CASE("--set with bare text that is not UTF-8 is refused by key") {
  ExperimentConfig c;
  CHECK_THROWS_WITH_AS(c.set("run.name=caf\xe9"), doctest::Contains("--set 'run.name': the value is not valid TOML, nor text in UTF-8"),
                       std::invalid_argument);
}

TEST_CASE("--set with an array, inline table or string cut short is refused as such, not taken as text") {
  ExperimentConfig c;
  CHECK_THROWS_WITH_AS(c.set("rollout.urls=[\"http://a:1\", \"http://b:2\""),
                       doctest::Contains("--set 'rollout.urls': '[\"http://a:1\", \"http://b:2\"' starts as a TOML array but "
                                         "does not parse"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("run.name= {a = 1"), doctest::Contains("starts as a TOML inline table"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("run.name=\"abc"), doctest::Contains("'\"abc' starts as a TOML string but does not parse"),
                       std::invalid_argument);  // was kept as the text "abc with its quote
  CHECK_THROWS_WITH_AS(c.set("run.name='abc"), doctest::Contains("starts as a TOML string"), std::invalid_argument);
  CHECK(c.rollout.urls.empty());  // nothing applied
  c.set("run.name=\"[draft]\"");  // quoted: text
  CHECK(c.run.name == "[draft]");
  c.set("rollout.urls=[\"http://a:1\"]");
  CHECK(c.rollout.urls == std::vector<std::string>{"http://a:1"});
}

TEST_CASE("algorithm.true_on_policy reaches the engines and is refused by name with settings it contradicts") {
  ExperimentConfig c;
  CHECK_FALSE(c.engine_for_run().true_on_policy);
  c.set("algorithm.true_on_policy=true");
  CHECK(c.trainer.logprobs.true_on_policy);
  CHECK(c.trainer_for_run().logprobs.true_on_policy);
  CHECK(c.engine_for_run().true_on_policy);  // one key for both sides
  CHECK_FALSE(c.rollout.engine.true_on_policy);  // no rollout key of its own
  c.validate();
  CHECK(c.to_toml().find("true_on_policy = true") != std::string::npos);
  ExperimentConfig absorbed = c;
  absorbed.set("rollout.absorbed_decode=true");
  CHECK_THROWS_WITH_AS(absorbed.validate(),
                       doctest::Contains("'algorithm.true_on_policy' contradicts rollout.absorbed_decode = true"),
                       std::invalid_argument);
  ExperimentConfig graphs = absorbed;
  graphs.set("rollout.cuda_graphs=true");
  CHECK_THROWS_WITH_AS(graphs.validate(), doctest::Contains("'algorithm.true_on_policy' contradicts rollout."),
                       std::invalid_argument);
  ExperimentConfig http = c;
  http.set("rollout.backend=\"http\"");
  http.set("rollout.urls=[\"http://127.0.0.1:30000\"]");
  CHECK_THROWS_WITH_AS(http.validate(), doctest::Contains("'algorithm.true_on_policy' needs rollout.backend \"engine\""),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(c.set("algorithm.true_on_policy=1"), doctest::Contains("'algorithm.true_on_policy' must be true or false"),
                       std::invalid_argument);
}
