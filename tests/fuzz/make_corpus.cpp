// Writes the fuzz harnesses' seed corpus (tests/fuzz/corpus/<harness>/seed-*) from real
// inputs: envelopes of every message type as kiln's encoder writes them, safetensors files
// and an index as kiln's writer lays them out, the fixture's config.json and index
// (transformers' output), the flavors' config.json, the experiment files in experiments/.
// Run: cmake --build BUILD --target kiln_fuzz_make_corpus &&
//      BUILD/tests/fuzz/kiln_fuzz_make_corpus tests/fuzz/corpus
// Seeds (seed-*) are rewritten; regression inputs (regress-*: inputs that once crashed or
// broke a property) are kept.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "experiments/experiment.hpp"
#include "messaging/envelope.hpp"
#include "messaging/schema.hpp"
#include "model/checkpoint/safetensors.hpp"
#include "model/glm4_moe_lite/config.hpp"

namespace fs = std::filesystem;
using namespace kiln;
using messaging::DType;
using messaging::Tensor;

namespace {
fs::path out_dir;

void put(const std::string& harness, const std::string& name, const std::string& bytes) {
  fs::create_directories(out_dir / harness);
  std::ofstream(out_dir / harness / ("seed-" + name), std::ios::binary) << bytes;
}
std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  return std::string(std::istreambuf_iterator<char>(in), {});
}
Tensor filled(const std::string& name, DType dt, std::vector<int64_t> shape) {
  auto t = Tensor::zeros(name, dt, std::move(shape));
  for (std::size_t i = 0; i < t.nbytes; ++i) t.mutable_data()[i] = std::byte(uint8_t(i * 7 + name[0]));
  return t;
}

// The envelope harness's input: each frame as a u32 little-endian length and its bytes.
std::string frames_of(const messaging::Envelope& env) {
  std::vector<std::string> frames{messaging::encode_header(env)};
  for (const auto& t : env.tensors) frames.emplace_back(reinterpret_cast<const char*>(t.data), t.nbytes);
  std::string s;
  for (const auto& f : frames) {
    for (int i = 0; i < 4; ++i) s += char((f.size() >> (8 * i)) & 0xff);
    s += f;
  }
  return s;
}

template <class... T>
void envelopes_of_every_type(std::tuple<T...>*) {
  using messaging::Kind;
  (put("envelope", std::string(T::kType),
       frames_of(messaging::make_envelope(T{}, Kind::request, "controller/0", "node/1"))),
   ...);
}

void envelopes() {
  using namespace messaging;
  envelopes_of_every_type(static_cast<MessageTypes*>(nullptr));
  auto join = make_envelope(GraphJoin{"node-1", "tcp://127.0.0.1:5555", {"rollout/0", "ref/0"}}, Kind::request,
                            "node-1/gateway", "graph");
  join.correlation_id = 42;
  put("envelope", "graph.join-filled", frames_of(join));
  auto bucket = make_envelope(WeightSyncBucket{3, 0, 2}, Kind::tell, "trainer/0", "rollout/0");
  bucket.tensors = {filled("embed.weight", DType::bfloat16, {4, 3}), filled("layers.0.attn.q_a.weight", DType::float32, {2, 2}),
                    filled("empty", DType::int64, {0, 5})};
  put("envelope", "weight_sync.bucket-tensors", frames_of(bucket));
  auto error = make_error_reply(join, make_error(ErrorCode::bad_message, "frame 0 is empty"), "graph");
  put("envelope", "error-reply", frames_of(error));
}

void safetensors(const fs::path& scratch) {
  std::vector<Tensor> every;
  for (auto dt : messaging::kAllDTypes) every.push_back(filled(std::string(messaging::dtype_name(dt)), dt, {2, 3}));
  every.push_back(filled("scalar", DType::float32, {}));
  every.push_back(filled("empty", DType::bfloat16, {0, 4}));
  const std::vector<std::pair<std::string, std::vector<Tensor>>> files = {
      {"every-dtype", every},
      {"hf-names",
       {filled("model.embed_tokens.weight", DType::bfloat16, {8, 4}),
        filled("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", DType::bfloat16, {6, 4}),
        filled("model.layers.1.mlp.gate.e_score_correction_bias", DType::float32, {8}),
        filled("lm_head.weight", DType::bfloat16, {8, 4})}},
      {"no-tensors", {}},
  };
  for (const auto& [name, tensors] : files) {
    const auto p = scratch / (name + ".safetensors");
    checkpoint::write_safetensors(p.string(), tensors, {{"format", "pt"}});
    put("safetensors", name + ".safetensors", read_all(p));
  }
}

void indexes(const fs::path& scratch, const fs::path& source) {
  // The harness's directory holds a, b in shard 1 and c in shard 2: this is their index.
  checkpoint::write_checkpoint((scratch / "ckpt").string(),
                               {filled("a", DType::float32, {2, 3}), filled("b", DType::bfloat16, {4}),
                                filled("c", DType::int64, {2})},
                               32);
  put("checkpoint_index", "kiln-written.json", read_all(scratch / "ckpt" / "model.safetensors.index.json"));
  put("checkpoint_index", "fixture.json",
      read_all(source / "tests/fixtures/glm4_moe_lite_tiny/model.safetensors.index.json"));
}

void hf_configs(const fs::path& source) {
  namespace glm = model::glm4_moe_lite;
  put("hf_config", "fixture.json", read_all(source / "tests/fixtures/glm4_moe_lite_tiny/config.json"));
  put("hf_config", "glm47_flash.json", glm::flavors::glm47_flash().to_hf_json().dump(2));
  auto no_q_lora = glm::flavors::debug().to_hf_json();
  no_q_lora["q_lora_rank"] = nullptr;
  put("hf_config", "debug-no-q-lora.json", no_q_lora.dump(2));
  // DeepSeek-style keys (transformers < 5): first_k_dense_replace, rope_theta, rope_scaling.
  auto legacy = glm::flavors::debug().to_hf_json();
  legacy.erase("mlp_layer_types");
  legacy.erase("rope_parameters");
  legacy["first_k_dense_replace"] = 1;
  legacy["rope_theta"] = 10000.0;
  legacy["rope_scaling"] = nullptr;
  legacy["eos_token_id"] = {1, 2};
  legacy["num_nextn_predict_layers"] = 1;
  legacy["topk_method"] = "noaux_tc";
  legacy["scoring_func"] = "sigmoid";
  put("hf_config", "debug-legacy-keys.json", legacy.dump(2));
}

void experiment_files(const fs::path& source) {
  for (const char* f : {"arithmetic.toml", "next_digit.toml"}) put("experiment_toml", f, read_all(source / "experiments" / f));
  put("experiment_toml", "defaults.toml", experiments::ExperimentConfig().to_toml());
  // Lines as --set assignments (each line of an input is also applied with set()).
  put("experiment_toml", "set-lines.txt",
      "run.steps=30\nrun.name=\"trial\"\nalgorithm.lr=1e-4\nalgorithm.normalize_std=false\n"
      "placement.mode=multi_process\nweight_sync.bucket_mib=0.5\nmodel.device=cuda:1\n");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  out_dir = argv[1];
  const fs::path source = KILN_SOURCE_DIR;
  const fs::path scratch = fs::temp_directory_path() / ("kiln-make-corpus-" + std::to_string(::getpid()));
  fs::create_directories(scratch);
  for (const char* h : {"envelope", "safetensors", "checkpoint_index", "hf_config", "experiment_toml"})
    if (fs::exists(out_dir / h))
      for (const auto& e : fs::directory_iterator(out_dir / h))
        if (e.path().filename().string().rfind("seed-", 0) == 0) fs::remove(e.path());
  envelopes();
  safetensors(scratch);
  indexes(scratch, source);
  hf_configs(source);
  experiment_files(source);
  fs::remove_all(scratch);
  std::printf("seed corpus written to %s\n", out_dir.c_str());
  return 0;
}
