// Model registry: user packages from a plugin directory come before built-ins; a miss names
// every place it looked.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/glm4_moe_lite/model.hpp"
#include "model/glm5_next/model.hpp"
#include "model/registry.hpp"
#include "tests/test_util.hpp"

using namespace kiln::model;

TEST_CASE("built-in glm4_moe_lite builds its flavors") {
  auto r = Registry::with_builtins();
  const auto& p = r.find("glm4_moe_lite");
  CHECK(r.origin("glm4_moe_lite") == "built-in");
  auto m = p.build_flavor("debug");
  auto out = m->forward(PackedBatch::from_documents({{3, 4, 5}, {6, 7}}));
  CHECK((out.hidden.sizes() == torch::IntArrayRef({5, 64})));
  CHECK_THROWS_WITH_AS(p.build_flavor("huge"), doctest::Contains("flavors: glm47_flash, debug"), std::invalid_argument);
}

TEST_CASE("built-in glm5_next builds its flavors and reads an HF directory the way its adapter does") {
  auto r = Registry::with_builtins();
  const auto& p = r.find("glm5_next");
  CHECK(r.origin("glm5_next") == "built-in");
  CHECK(p.hf_model_type == "glm5_next");
  torch::manual_seed(1);
  auto m = r.build(ModelSpec{"glm5_next", "debug", "", "cpu", "fp32"});
  const auto batch = PackedBatch::from_documents({{3, 4, 5}, {6, 7}});
  ForwardOptions ask;
  ask.return_routed_experts = true;
  ask.return_topk_indices = true;
  auto out = m->forward(batch, ask);
  CHECK((out.hidden.sizes() == torch::IntArrayRef({5, 64})));
  CHECK((out.routed_experts.sizes() == torch::IntArrayRef({5, 3, 2})));  // 3 MoE layers, top-2
  CHECK((out.topk_indices.sizes() == torch::IntArrayRef({5, 2, 5})));    // 2 sparse layers, topk 4 + tail 1
  CHECK(m->num_moe_layers() == 3);
  CHECK(m->vocab_size() == 96);
  // Random weights: the routed experts are drawn, not left zero (they would give no gradient).
  CHECK(m->named_parameters()["layers.1.moe.experts.w_gate_up_EFD"].abs().sum().item<double>() > 0);
  CHECK_THROWS_WITH_AS(p.build_flavor("huge"), doctest::Contains("flavors: glm53_flash, glm53_flash_5l, debug"),
                       std::invalid_argument);
  // From the fixture directory: the same logits as a second load, and hf_state_dict round-trips.
  auto a = r.build("glm5_next", "", KILN_FIXTURES_DIR "/glm5_next_tiny");
  auto b = r.build("glm5_next", "debug", "");
  b->load_hf_tensors(a->hf_state_dict());
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(a->logits(a->forward(batch)), b->logits(b->forward(batch))));
  // glm4_moe_lite has no sparse-attention layers to replay.
  auto glm4 = r.build("glm4_moe_lite", "debug", "");
  ForwardOptions replay;
  replay.replay_topk_indices = out.topk_indices;
  CHECK_THROWS_WITH_AS(glm4->forward(batch, replay), doctest::Contains("glm4_moe_lite has no sparse-attention layers"),
                       std::invalid_argument);
}

namespace {
int64_t numel_of(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}
}  // namespace

TEST_CASE("the built-in packages count their models' parameters from the config alone, as built") {
  namespace g4 = glm4_moe_lite;
  namespace g5 = glm5_next;
  auto r = Registry::with_builtins();
  // glm4_moe_lite: the debug flavor and variants of each branch (no q LoRA, no shared experts,
  // all layers dense), whole and as an expert-parallel share.
  std::vector<g4::Glm4MoeLiteConfig> configs{g4::flavors::debug()};
  configs.push_back(configs[0]);
  configs.back().attention.q_lora_rank.reset();
  configs.push_back(configs[0]);
  configs.back().moe.n_shared_experts = 0;
  configs.push_back(configs[0]);
  configs.back().moe_layers.assign(configs.back().moe_layers.size(), false);
  for (std::size_t k = 0; k < configs.size(); ++k)
    for (const ExpertSlice slice : {ExpertSlice{}, ExpertSlice{1, 2}}) {
      CAPTURE(k);
      CAPTURE(slice.ranks);
      g4::Glm4MoeLiteModel m(configs[k], slice, /*random_init=*/false);
      CHECK(g4::parameter_count(configs[k], slice) == numel_of(m));
    }
  CHECK(r.find("glm4_moe_lite").parameter_count("debug", "", {}) == g4::parameter_count(g4::flavors::debug()));
  const auto tiny4 = std::string(KILN_FIXTURES_DIR) + "/glm4_moe_lite_tiny";
  CHECK(r.find("glm4_moe_lite").parameter_count("", tiny4, {}) == numel_of(*r.build("glm4_moe_lite", "", tiny4)));
  // GLM-4.7-Flash: "30B-A3B".
  const auto flash = g4::parameter_count(g4::flavors::by_name("glm47_flash"));
  MESSAGE("glm47_flash: " << flash << " parameters");
  CHECK(flash > 29e9);
  CHECK(flash < 32e9);
  // glm5_next: the debug flavor (KDA and sparse layers, full and shared indexers, dense and MoE
  // layers) with and without an MTP layer, and with every layer sparse.
  std::vector<g5::Glm5NextConfig> c5{g5::flavors::debug()};
  c5.push_back(c5[0]);
  c5.back().num_nextn_predict_layers = 1;
  c5.push_back(c5[0]);
  c5.back().layer_types.assign(c5.back().layer_types.size(), g5::LayerType::sparse_attention);
  for (std::size_t k = 0; k < c5.size(); ++k) {
    CAPTURE(k);
    g5::Glm5NextModelImpl m(c5[k]);
    CHECK(g5::parameter_count(c5[k]) == numel_of(m));
  }
  const auto tiny5 = std::string(KILN_FIXTURES_DIR) + "/glm5_next_tiny";
  CHECK(r.find("glm5_next").parameter_count("", tiny5, {}) == numel_of(*r.build("glm5_next", "", tiny5)));
}

TEST_CASE("a model whose fp32 build exceeds the host's available memory is refused before it is built") {
  CHECK_NOTHROW(check_fits_host_memory(int64_t(3e9), 4, int64_t(12.5e9), "small", "in fp32"));
  CHECK_NOTHROW(check_fits_host_memory(int64_t(30e9), 4, -1, "unknown memory", "in fp32"));  // nothing to compare with
  CHECK_NOTHROW(check_fits_host_memory(-1, 4, 1000, "unknown count", "in fp32"));
  CHECK_THROWS_WITH_AS(check_fits_host_memory(int64_t(30e9), 4, int64_t(22e9), "model package p, flavor 'f'", "in fp32"),
                       doctest::Contains("model package p, flavor 'f': 30 billion parameters take 120 GB in fp32, "
                                         "but this machine has 22 GB of memory available"),
                       std::invalid_argument);
  // Large ones too (not "7.7e+03 GB").
  CHECK_THROWS_WITH_AS(check_fits_host_memory(int64_t(7.7e11), 10, int64_t(22e9), "m", "in all"),
                       doctest::Contains("m: 770 billion parameters take 7.7 TB in all"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(check_fits_host_memory(int64_t(3e15), 4, int64_t(22e9), "m", "in all"),
                       doctest::Contains("m: 3000 trillion parameters take 12000 TB in all"), std::invalid_argument);
  // Small numbers in their own units (not "0.0 GB").
  CHECK_THROWS_WITH_AS(check_fits_host_memory(126000, 20, 406000, "m", "for the run"),
                       doctest::Contains("m: 126 thousand parameters take 2.52 MB for the run, but this machine has "
                                         "406 kB"),
                       std::invalid_argument);
}

TEST_CASE("host memory: the smallest headroom of every cgroup limit from this process's group up to the root, v2 and v1") {
  namespace fs = std::filesystem;
  const auto root = fs::temp_directory_path() / ("kiln_cgroup_" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto put = [&](const fs::path& file, const std::string& text) {
    fs::create_directories(file.parent_path());
    std::ofstream(file) << text << "\n";
  };
  // A group's limit and usage: cgroup v2's files, or v1's memory controller's.
  auto v2 = [&](const std::string& group, const std::string& max, const std::string& current) {
    put(root / "cg" / group / "memory.max", max);
    put(root / "cg" / group / "memory.current", current);
  };
  auto v1 = [&](const std::string& group, const std::string& limit, const std::string& usage) {
    put(root / "cg/memory" / group / "memory.limit_in_bytes", limit);
    put(root / "cg/memory" / group / "memory.usage_in_bytes", usage);
  };
  put(root / "meminfo", "MemTotal:       64000000 kB\nMemAvailable:   40000000 kB\nSwapFree:        1000000 kB");
  const int64_t meminfo = int64_t(41000000) * 1024;
  HostMemorySources src{(root / "meminfo").string(), (root / "self").string(), (root / "cg").string()};

  SUBCASE("no cgroup files: MemAvailable + SwapFree") {
    put(root / "self", "0::/");
    CHECK(host_memory_available_bytes(src) == meminfo);
  }
  SUBCASE("v2: a limit two levels above the process's group is the tightest") {
    put(root / "self", "0::/user.slice/job/step");
    put(root / "cg/cgroup.controllers", "memory");
    v2("user.slice", "max", "100");
    v2("user.slice/job", "8000000000", "3000000000");  // 8 GB, 3 GB used: 5 GB left
    v2("user.slice/job/step", "max", "2000000000");
    CHECK(host_memory_available_bytes(src) == int64_t(5000000000));
    // The process's own limit tighter still (1 GB, 0.5 used), and a limit above the root ignored.
    v2("user.slice/job/step", "1000000000", "500000000");
    put(root / "memory.max", "1");
    put(root / "memory.current", "0");
    CHECK(host_memory_available_bytes(src) == int64_t(500000000));
    // Over its limit: 0 left, not negative.
    put(root / "cg/user.slice/job/step/memory.current", "2000000000");
    CHECK(host_memory_available_bytes(src) == 0);
  }
  SUBCASE("v2 in a container (a cgroup namespace: the group reads as /): the root's limit") {
    put(root / "self", "0::/");
    put(root / "cg/cgroup.controllers", "memory");
    v2("", "20000000000", "1000000000");
    CHECK(host_memory_available_bytes(src) == int64_t(19000000000));
  }
  SUBCASE("v1 (a hybrid host: v2's unified tree has no memory files): the memory controller's nested limits") {
    put(root / "self", "9:name=systemd:/\n4:memory:/process_api/abc\n0::/");
    put(root / "cg/unified/cgroup.controllers", "");
    v1("", "9223372036854771712", "5000000000");  // v1's "no limit"
    v1("process_api", "24000000000", "4000000000");
    v1("process_api/abc", "9223372036854771712", "4000000000");
    CHECK(host_memory_available_bytes(src) == int64_t(20000000000));
  }
  SUBCASE("a group the process cannot see (outside its namespace) is skipped, the levels it can see count") {
    put(root / "self", "4:cpu,memory:/not/mounted/here");
    v1("", "30000000000", "1000000000");
    CHECK(host_memory_available_bytes(src) == int64_t(29000000000));
  }
  SUBCASE("the page cache a group holds (inactive file pages) is not counted against its limit") {
    put(root / "self", "0::/job");
    put(root / "cg/cgroup.controllers", "memory");
    v2("job", "32000000000", "24000000000");  // 20 GB of it a checkpoint just read
    put(root / "cg/job/memory.stat", "anon 4000000000\nfile 20000000000\ninactive_file 19000000000\nactive_file 1000000000");
    CHECK(host_memory_available_bytes(src) == int64_t(27000000000));
    put(root / "self", "4:memory:/job\n0::/");  // v1 names it total_inactive_file
    fs::remove_all(root / "cg");
    v1("job", "32000000000", "24000000000");
    put(root / "cg/memory/job/memory.stat", "cache 20000000000\ninactive_file 1\ntotal_inactive_file 19000000000");
    CHECK(host_memory_available_bytes(src) == int64_t(27000000000));
  }
  SUBCASE("a group above the namespace's root (\"/../job\") reads the root's limit, not none") {
    put(root / "self", "0::/../job");
    put(root / "cg/cgroup.controllers", "memory");
    v2("", "10000000000", "2000000000");
    put(root / "memory.max", "1");  // outside the root: never read
    put(root / "memory.current", "0");
    CHECK(host_memory_available_bytes(src) == int64_t(8000000000));
    // A root given with a trailing separator reads the same groups.
    put(root / "self", "0::/job");
    v2("job", "5000000000", "1000000000");
    CHECK(host_memory_available_bytes(src) == int64_t(4000000000));
    src.cgroup_root += "/";
    CHECK(host_memory_available_bytes(src) == int64_t(4000000000));
  }
  SUBCASE("swap counts only as far as every group up the tree lets the process swap") {
    put(root / "self", "0::/job/step");
    put(root / "cg/cgroup.controllers", "memory");
    v2("job", "max", "1000000000");
    put(root / "cg/job/memory.swap.max", "max");
    put(root / "cg/job/memory.swap.current", "0");
    CHECK(host_memory_available_bytes(src) == meminfo);  // no swap limit: MemAvailable + SwapFree
    put(root / "cg/job/memory.swap.max", "0");  // no swap for the job: MemAvailable only
    CHECK(host_memory_available_bytes(src) == int64_t(40000000) * 1024);
    put(root / "cg/job/memory.swap.max", "500000000");  // 500 MB of swap, 100 MB used, below SwapFree
    put(root / "cg/job/memory.swap.current", "100000000");
    CHECK(host_memory_available_bytes(src) == int64_t(40000000) * 1024 + 400000000);
    // v1: the memory+swap limit bounds both; 4 GB of its 28 GB used in memory, 2 GB more in swap.
    fs::remove_all(root / "cg");
    put(root / "self", "4:memory:/job\n0::/");
    v1("job", "28000000000", "4000000000");
    put(root / "cg/memory/job/memory.memsw.limit_in_bytes", "28000000000");
    put(root / "cg/memory/job/memory.memsw.usage_in_bytes", "6000000000");
    CHECK(host_memory_available_bytes(src) == int64_t(22000000000));
  }
  SUBCASE("nothing readable: -1") {
    HostMemorySources none{(root / "no_meminfo").string(), (root / "no_self").string(), (root / "no_cg").string()};
    CHECK(host_memory_available_bytes(none) == -1);
  }
  fs::remove_all(root);
}

TEST_CASE("Registry::build checks one fp32 build for each trainer rank that builds on this host at once") {
  // A package that claims available / 12 parameters: one fp32 build (4 B each) takes a third of
  // the memory available now, two at once two thirds, four more than all of it.
  const int64_t available = host_memory_available_bytes();
  if (kiln::test::skip_unless(available > 0, "this machine reports no available memory")) return;
  auto r = Registry::with_builtins();
  ModelPackage p = r.find("glm4_moe_lite");
  p.name = "claims_a_third";
  const int64_t claimed = available / 12;
  p.parameter_count = [claimed](const std::string&, const std::string&, ExpertSlice) { return claimed; };
  r.add(p);
  const ModelSpec spec{"claims_a_third", "debug", "", "cpu", "fp32"};
  CHECK_NOTHROW(r.build(spec));
  CHECK_NOTHROW(r.build(spec, {}, 2));
  CHECK_THROWS_WITH_AS(r.build(spec, {}, 4),
                       doctest::Contains("for the 4 trainer ranks that build it on this host at once (LOCAL_WORLD_SIZE), "
                                         "one copy each, but this machine has"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(r.build(spec, {}, 0), doctest::Contains("builders_on_host must be >= 1, got 0"),
                       std::invalid_argument);
}

TEST_CASE("GLM-4.7-Flash in full on a host without the memory for its fp32 build is refused by Registry::build") {
  const int64_t available = host_memory_available_bytes();
  MESSAGE("host memory available: " << double(available) / 1e9 << " GB");
  // GLM-4.7-Flash in full (~30e9 parameters, 120 GB in fp32) through Registry::build, as `kiln
  // run --set model.flavor=glm47_flash` asks for it: refused by name, not killed part way.
  const double need = 4.0 * double(glm4_moe_lite::parameter_count(glm4_moe_lite::flavors::by_name("glm47_flash")));
  if (kiln::test::skip_unless(available >= 0 && double(available) < need,
                              "this machine has the memory to build GLM-4.7-Flash in fp32 (or reports none)"))
    return;
  auto r = Registry::with_builtins();
  CHECK_THROWS_WITH_AS(r.build(ModelSpec{"glm4_moe_lite", "glm47_flash", "", "cpu", "bf16"}),
                       doctest::Contains("model package glm4_moe_lite, flavor 'glm47_flash': 29.9 billion parameters take 120 GB in fp32"),
                       std::invalid_argument);
}

TEST_CASE("a checkpoint of another package's model_type is refused naming that package, one its reader takes is not") {
  auto r = Registry::with_builtins();
  CHECK_THROWS_WITH_AS(r.build("glm4_moe_lite", "", KILN_FIXTURES_DIR "/glm5_next_tiny"),
                       doctest::Contains("is a \"glm5_next\" checkpoint (config.json model_type); model package "
                                         "glm4_moe_lite reads \"glm4_moe_lite\" ones: use package glm5_next"),
                       std::invalid_argument);
  // glm5_next's reader also takes a root model_type of "glm5_next_text", which no package declares.
  const auto dir = std::filesystem::temp_directory_path() / ("kiln_registry_type_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::copy(KILN_FIXTURES_DIR "/glm5_next_tiny", dir);
  std::ifstream in(dir / "config.json");
  auto j = nlohmann::json::parse(in);
  in.close();
  j["model_type"] = "glm5_next_text";
  std::ofstream(dir / "config.json") << j.dump(2);
  CHECK_NOTHROW(r.build("glm5_next", "", dir.string()));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a plugin's packages are found first, shadowing a built-in of the same name") {
  auto r = Registry::with_builtins();
  CHECK(r.load_plugins(KILN_TEST_PLUGIN_DIR) == 1);
  CHECK(r.origin("toy_lm").find("kiln_test_model_plugin.so") != std::string::npos);
  CHECK(r.origin("glm4_moe_lite").find("kiln_test_model_plugin.so") != std::string::npos);
  auto toy = r.find("toy_lm").build_flavor("toy");
  CHECK(toy->num_moe_layers() == 1);
  CHECK(r.find("glm4_moe_lite").description == "user override of the built-in glm4_moe_lite");
}

TEST_CASE("a miss names the plugin directory and the built-ins it looked in") {
  auto r = Registry::with_builtins();
  r.load_plugins(KILN_TEST_PLUGIN_DIR);
  try {
    r.find("llama9");
    FAIL("found a package that does not exist");
  } catch (const std::invalid_argument& e) {
    std::string m = e.what();
    CHECK(m.find("no model package 'llama9'") != std::string::npos);
    CHECK(m.find(KILN_TEST_PLUGIN_DIR) != std::string::npos);
    CHECK(m.find("toy_lm") != std::string::npos);
    CHECK(m.find("built-in packages (glm4_moe_lite, glm5_next)") != std::string::npos);
  }
}

TEST_CASE("a library without the entry point is refused by name") {
  auto r = Registry::with_builtins();
  CHECK_THROWS_WITH_AS(r.load_plugins(KILN_TEST_BAD_PLUGIN_DIR), doctest::Contains("kiln_register_model_packages"),
                       std::runtime_error);
}
