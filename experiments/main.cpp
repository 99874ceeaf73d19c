// The kiln command line: `kiln node`, `kiln bench ...`, `kiln model ...`, `kiln serve`, `kiln run`.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <iomanip>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include "actors/diag/diag_service.hpp"
#include "experiments/bench_messaging.hpp"
#include "experiments/experiment.hpp"
#include "experiments/node.hpp"
#ifdef KILN_WITH_TORCH
#include "experiments/bench_glm5.hpp"
#include "experiments/bench_gpu.hpp"
#include "experiments/bench_model.hpp"
#include "experiments/bench_parallel.hpp"
#include "experiments/bench_rollout.hpp"
#include "experiments/bench_serve.hpp"
#include "actors/reference/ref_service.hpp"
#include "actors/rollout/rollout_service.hpp"
#include "actors/trainer/trainer_service.hpp"
#include "experiments/model_cmd.hpp"
#include "kernels/grouped_gemm_tiles.hpp"
#include "experiments/ranks.hpp"
#include "experiments/serve.hpp"
#endif

namespace {

// A word where a command goes that names none, said as such with the commands there are (CLI11
// says "A subcommand is required"). True when refused (the message printed).
bool refuse_unknown_command(const CLI::App& app, int argc, char** argv) {
  const CLI::App* level = &app;
  for (int i = 1; i < argc && argv[i][0] != '-'; ++i) {
    const auto subs = level->get_subcommands([](const CLI::App*) { return true; });
    if (subs.empty()) return false;  // a command's own positional arguments from here
    const auto it = std::find_if(subs.begin(), subs.end(), [&](const CLI::App* c) { return c->check_name(argv[i]); });
    if (it == subs.end()) {
      std::string names;
      for (const auto* c : subs) names += (names.empty() ? "" : ", ") + c->get_name();
      std::fprintf(stderr, "kiln: unknown command '%s' (commands%s%s: %s)\n", argv[i], level == &app ? "" : " of ",
                   level == &app ? "" : level->get_name().c_str(), names.c_str());
      return true;
    }
    level = *it;
  }
  return false;
}

#ifdef KILN_WITH_TORCH
// `kiln bench rollout`: each device reads its own options, so one given for the other device,
// or --split-profile without --split, is refused rather than ignored. True when refused.
bool refuse_other_device_options(const CLI::App& bench, const kiln::experiments::RolloutBenchOptions& ro) {
  const std::pair<const char*, const char*> read_by[] = {{"--layers", "cuda"},     {"--contexts", "cuda"},
                                                         {"--modes", "cuda"},      {"--split", "cuda"},
                                                         {"--split-profile", "cuda"}, {"--flavor", "cpu"},
                                                         {"--prompt-tokens", "cpu"}};
  for (const auto& [name, device] : read_by)
    if (bench.get_option(name)->count() > 0 && ro.device != device) {
      std::fprintf(stderr, "kiln bench rollout: %s is read with --device %s only (this run: --device %s)\n", name,
                   device, ro.device.c_str());
      return true;
    }
  if (ro.split_profile && !ro.split) {
    std::fprintf(stderr, "kiln bench rollout: --split-profile needs --split\n");
    return true;
  }
  return false;
}
#endif

using Run = std::function<int()>;

// A command and what running it does once CLI11 has parsed the command line.
struct Command {
  CLI::App* app;
  Run run;
};

// A number option's range, said as kiln's own checks say it: "must be an integer in [2, 47],
// got \"99\"" (CLI11's Range calls a word that is no number "not in range" and lets NaN
// through). Integers are decimal only (CLI11 alone reads "010" as octal 8 and "0x10" as 16):
// leading zeros are dropped before CLI11 converts the text; spaces around a value are allowed.
template <typename T>
CLI::Validator between(T lo, T hi) {
  auto text = [](T v) {
    std::ostringstream s;
    s << std::setprecision(15) << v;
    return s.str();
  };
  const std::string want = std::string("must be ") + (std::is_integral_v<T> ? "an integer" : "a number") + " in [" +
                           text(lo) + ", " + text(hi) + "]";
  return CLI::Validator(
      [lo, hi, want](std::string& in) -> std::string {
        const std::string given = in;
        const auto a = in.find_first_not_of(' '), b = in.find_last_not_of(' ');
        std::string t = a == std::string::npos ? "" : in.substr(a, b - a + 1);
        T v{};
        bool ok = !t.empty();
        if constexpr (std::is_integral_v<T>) {
          const bool negative = ok && t[0] == '-';
          std::string digits = ok && (t[0] == '-' || t[0] == '+') ? t.substr(1) : t;
          ok = ok && !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
          if (ok) {
            digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));  // "007" -> "7"
            t = (negative ? "-" : "") + digits;
            const auto r = std::from_chars(t.data(), t.data() + t.size(), v);
            ok = r.ec == std::errc() && r.ptr == t.data() + t.size();
          }
        } else {
          char* end = nullptr;
          errno = 0;
          const double d = ok ? std::strtod(t.c_str(), &end) : 0.0;
          ok = ok && end == t.c_str() + t.size() && errno != ERANGE;
          v = T(d);
        }
        if (!ok || !(v >= lo && v <= hi)) return want + ", got \"" + given + "\"";  // NaN too
        in = t;
        return {};
      },
      "in [" + text(lo) + ", " + text(hi) + "]", "BETWEEN");
}

void add_node(CLI::App& app, std::vector<Command>& commands) {
  auto node = std::make_shared<kiln::experiments::NodeOptions>();
  auto* cmd = app.add_subcommand("node", "Join an actor graph and host actors");
  cmd->add_option("--name", node->name, "Node name (default: node-PID)");
  cmd->add_option("--bind", node->bind, "Endpoint to bind (inproc://, ipc://, tcp://host:port)")->required();
  cmd->add_option("--join", node->join, "Endpoint of the graph's root gateway (empty: be the root)");
  cmd->add_option("--actor", node->actors, "Actor to host, <kind>/<index> (repeatable), e.g. diag/0");
  cmd->add_option("--exit-with-parent", node->exit_with_parent, "Stop when this parent pid dies")
      ->transform(between(int64_t(1), int64_t(1) << 22));  // Linux's largest pid_max
  cmd->add_option("--join-timeout-ms", node->join_timeout_ms, "How long to wait for the root")
      ->default_val(10000)
      ->transform(between(1, 3600000));
  commands.push_back({cmd, [node] {
                        if (node->name.empty()) node->name = "node-" + std::to_string(::getpid());
                        return kiln::experiments::run_node(*node);
                      }});
}

void add_bench_messaging(CLI::App& bench, std::vector<Command>& commands) {
  auto mb = std::make_shared<kiln::experiments::MessagingBenchOptions>();
  auto* cmd = bench.add_subcommand("messaging", "Gateway throughput vs raw ZeroMQ and memcpy");
  cmd->add_option("--sizes-mib", mb->sizes_mib, "Tensor sizes in MiB")->default_str("1 16 64 256")->transform(between(1, 4096));
  cmd->add_option("--bytes-per-cell", mb->bytes_per_cell, "Bytes sent per measurement")
      ->transform(between(std::size_t(1) << 20, std::size_t(1) << 40));
  cmd->add_option("--repeats", mb->repeats, "Measurements per cell (best is shown)")->transform(between(1, 100));
  commands.push_back({cmd, [mb] { return kiln::experiments::run_messaging_bench(*mb); }});
}

#ifdef KILN_WITH_TORCH
void add_bench_model(CLI::App& bench, std::vector<Command>& commands) {
  auto mo = std::make_shared<kiln::experiments::ModelBenchOptions>();
  auto* cmd = bench.add_subcommand("model", "Log-probs and forward+backward speed vs peers/limits");
  cmd->add_option("--logprob-tokens", mo->logprob_tokens, "Tokens for the log-prob comparison")
      ->transform(between(int64_t(1), int64_t(65536)));
  cmd->add_option("--train-tokens", mo->train_tokens, "Packed tokens for the training step (4 documents)")
      ->transform(between(int64_t(8), int64_t(1) << 20));
  cmd->add_option("--repeats", mo->repeats, "Measurements (best is shown)")->transform(between(1, 100));
  commands.push_back({cmd, [mo] { return kiln::experiments::run_model_bench(*mo); }});
}

void add_bench_rollout(CLI::App& bench, std::vector<Command>& commands) {
  auto ro = std::make_shared<kiln::experiments::RolloutBenchOptions>();
  auto* cmd = bench.add_subcommand("rollout", "Engine decode tokens/s and TTFT vs no-cache recompute");
  cmd->add_option("--batch-sizes", ro->batch_sizes, "Batch sizes")
      ->default_str("1 8 32 64; cuda: 1 32 128 256")
      ->transform(between(int64_t(1), int64_t(4096)));
  cmd->add_option("--prompt-tokens", ro->prompt_tokens, "cpu: prompt length")
      ->capture_default_str()->transform(between(int64_t(1), int64_t(65536)));
  cmd->add_option("--new-tokens", ro->new_tokens, "Tokens generated per request")
      ->capture_default_str()->transform(between(int64_t(1), int64_t(65536)));
  cmd->add_option("--flavor", ro->flavor, "cpu: glm4_moe_lite flavor")->capture_default_str();
  cmd->add_option("--device", ro->device,
                  "cpu (--flavor) or cuda (GLM-4.7-Flash dims, decode modes against the roofline); both "
                  "end with a GRPO group: 8 samples of one 2048-token prompt, shared or not")
      ->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--layers", ro->layers, "cuda: decoder layers at GLM-4.7-Flash dimensions (first dense)")
      ->transform(between(int64_t(2), int64_t(47)));
  cmd->add_option("--contexts", ro->contexts, "cuda: prompt lengths")->default_str("1024 8192")
      ->transform(between(int64_t(1), int64_t(131072)));
  cmd->add_option("--modes", ro->modes,
                  "cuda: decode modes, as columns, separated by spaces: expanded (the eager engine), absorbed "
                  "(rollout.absorbed_decode), graphs (+ rollout.cuda_graphs), kernel / graphs-kernel (absorbed, "
                  "eager / graphed, + rollout.mla_decode_kernel), graphs-sampling / graphs-experts / graphs-all "
                  "(graphs-kernel + rollout.sampling_kernel / rollout.moe_decode_kernel / both), graphs-overlap "
                  "/ graphs-overlap-all (graphs-sampling / graphs-all + rollout.overlap_schedule); the rollout.* "
                  "keys a mode does not name are off")
      ->default_str("expanded absorbed graphs")
      ->check(CLI::IsMember({"expanded", "absorbed", "graphs", "kernel", "graphs-kernel", "graphs-sampling",
                             "graphs-experts", "graphs-all", "graphs-overlap", "graphs-overlap-all"}));
  cmd->add_flag("--split", ro->split, "cuda: where a graphed decode step's time goes (step, replay, sampling, copies)");
  cmd->add_flag("--split-profile", ro->split_profile,
                "cuda, with --split: one replay per shape inside cudaProfilerStart/Stop, for ncu");
  commands.push_back({cmd, [cmd, ro] {
                        if (refuse_other_device_options(*cmd, *ro)) return 2;
                        if (ro->device == "cuda" && cmd->get_option("--batch-sizes")->count() == 0)
                          ro->batch_sizes = {1, 32, 128, 256};
                        return kiln::experiments::run_rollout_bench(*ro);
                      }});
}

void add_bench_serve(CLI::App& bench, std::vector<Command>& commands) {
  auto so = std::make_shared<kiln::experiments::ServeBenchOptions>();
  auto* cmd = bench.add_subcommand("serve", "kiln serve's requests/s and tokens/s vs the in-process engine");
  cmd->add_option("--clients", so->clients, "Concurrent clients")->default_str("1 16 64")
      ->transform(between(int64_t(1), int64_t(1024)));
  cmd->add_option("--requests", so->requests, "Requests per measurement")->transform(between(int64_t(1), int64_t(100000)));
  cmd->add_option("--prompt-tokens", so->prompt_tokens, "Prompt length")->transform(between(int64_t(1), int64_t(4096)));
  cmd->add_option("--new-tokens", so->new_tokens, "Tokens generated per request")->transform(between(int64_t(1), int64_t(4096)));
  cmd->add_option("--flavor", so->flavor, "glm4_moe_lite flavor (cpu)");
  commands.push_back({cmd, [so] { return kiln::experiments::run_serve_bench(*so); }});
}

void add_bench_gpu(CLI::App& bench, std::vector<Command>& commands) {
  auto go = std::make_shared<kiln::experiments::GpuBenchOptions>();
  auto* cmd = bench.add_subcommand("gpu", "bf16 training, log-probs, rollout and weight sync on one CUDA GPU vs its limits");
  cmd->add_option("--layers", go->layers, "Decoder layers at GLM-4.7-Flash dimensions (first dense)")
      ->transform(between(int64_t(2), int64_t(47)));
  cmd->add_option("--tokens", go->tokens, "Tokens of the packed micro-batch")->transform(between(int64_t(16), int64_t(1) << 20));
  cmd->add_option("--docs", go->docs, "Documents in the micro-batch")->transform(between(int64_t(1), int64_t(4096)));
  cmd->add_option("--steps", go->steps, "Timed repetitions (median shown)")->transform(between(1, 100));
  cmd->add_option("--bucket-mib", go->bucket_mib, "Weight-sync bucket size")->transform(between(1.0, 65536.0));
  cmd->add_option("--rollout-prompts", go->rollout_prompts, "Rollout requests")->transform(between(int64_t(1), int64_t(4096)));
  cmd->add_option("--rollout-prompt-tokens", go->rollout_prompt_tokens, "Prompt length")
      ->transform(between(int64_t(1), int64_t(65536)));
  cmd->add_option("--rollout-new-tokens", go->rollout_new_tokens, "Tokens generated per request")
      ->transform(between(int64_t(1), int64_t(65536)));
  cmd->add_option("--json", go->json_path, "Write every number as JSON here");
  cmd->add_flag("--absorbed-decode", go->absorbed_decode, "Rollout decode in latent space (rollout.absorbed_decode)");
  cmd->add_flag("--activation-checkpointing", go->activation_checkpointing,
                "Also time forward+backward with activation checkpointing per layer");
  cmd->add_option("--activation-checkpointing-layers", go->checkpoint_layers,
                  "With --activation-checkpointing: checkpoint only the first N decoder layers "
                  "(algorithm.activation_checkpointing_layers; 0: all)")
      ->transform(between(int64_t(0), int64_t(47)));
  cmd->add_option("--keep-logits-gib", go->keep_logits_gib,
                  "GiB of bf16 logits the log-prob head keeps for its backward (algorithm.keep_logits_gib; the "
                  "rest recomputed)")
      ->transform(between(0.0, 1048576.0));
  cmd->add_option("--trainer-microbatch-tokens", go->trainer_microbatch_tokens,
                  "The trainer step's algorithm.max_tokens_per_microbatch (0: --tokens, one micro-batch)")
      ->transform(between(int64_t(0), int64_t(1) << 20));
  cmd->add_flag("--true-on-policy", go->true_on_policy,
                "Also time training and rollout with batch-invariant kernels (algorithm.true_on_policy) and report "
                "that mode's train/rollout diff");
  auto* trace = cmd->add_option("--trace", go->trace_path,
                                "Time forward+backward, then write the Chrome trace (Kineto: CPU ops, CUDA kernels) of one "
                                "more (--trace-steps: N more) to this file and stop (with --activation-checkpointing: "
                                "checkpointed ones)")
                     ->check(CLI::Validator(
                         [](std::string& path) {
                           if (path.empty()) return std::string("give a file name");
                           if (path[0] == '-') return "give a file name, not the option '" + path + "' (a file named so: ./" + path + ")";
                           return std::string();
                         },
                         "FILE"));
  cmd->add_option("--trace-steps", go->trace_steps,
                  "Forward+backwards in the --trace, each with the device synchronize the timing does, inside a host "
                  "op \"kiln bench gpu: step I\" (tests/bench/trace_gaps.py reports each: host time before the GPU's "
                  "first work, GPU span, busy, tail); the first carries the profiler's start-up")
      ->transform(between(1, 100))
      ->needs(trace);
  cmd->add_flag("--profile", go->profile,
                "Time forward+backward, then run one more inside cudaProfilerStart/Stop (ncu --profile-from-start "
                "off) and stop")
      ->excludes(trace);
  cmd->add_flag("--forward-backward-only", go->forward_backward_only,
                "Stop after timing forward+backward (the limits, tokens/s, MFU, peak memory, expert loads; the checkpointed timing with --activation-checkpointing; --json too)");
  cmd->add_option("--balance-routing", go->balance_routing,
                  "Rounds of the auxiliary-loss-free router-bias update (rate 1e-3) on the pack before timing, "
                  "so that the experts' loads are even as in a trained model (0: the random model's routing)")
      ->transform(between(0, 100000));
  cmd->add_flag("--batch-on-device", go->batch_on_device,
                "Put the pack's token ids and positions on the GPU before the forward+backward timings (also with "
                "--activation-checkpointing, --trace, --profile), as torchtitan's benchmark "
                "(tests/bench/bench_torchtitan_ac.py) holds its tokens (default: each timed forward uploads them "
                "from the host, as the trainer's steps do)");
  cmd->add_option("--config-dir", go->config_dir, "Write the benchmarked model's HF config.json here");
  commands.push_back({cmd, [go] { return kiln::experiments::run_gpu_bench(*go); }});
}

void add_bench_glm5(CLI::App& bench, std::vector<Command>& commands) {
  auto g5 = std::make_shared<kiln::experiments::Glm5BenchOptions>();
  auto* cmd = bench.add_subcommand(
      "glm5", "GLM-5.3-Flash (glm5_next) forward+backward with the MTP loss, bf16, one CUDA GPU: tokens/s, peak memory");
  cmd->add_option("--flavor", g5->flavor, "glm5_next flavor (glm53_flash_5l: 5 layers + MTP, ~25B parameters)");
  cmd->add_option("--tokens", g5->tokens, "Tokens of the packed micro-batch")->transform(between(int64_t(16), int64_t(1) << 20));
  cmd->add_option("--docs", g5->docs, "Documents in the micro-batch")->transform(between(int64_t(1), int64_t(4096)));
  cmd->add_option("--steps", g5->steps, "Timed repetitions (median shown)")->transform(between(1, 100));
  cmd->add_option("--mtp-depths", g5->mtp_depths, "MTP depths (algorithm.mtp_depths)")->transform(between(int64_t(1), int64_t(16)));
  cmd->add_option("--mtp-loss-weight", g5->mtp_loss_weight, "MTP loss weight (algorithm.mtp_loss_weight)")
      ->transform(between(0.0, 100.0));
  cmd->add_option("--json", g5->json_path, "Write every number as JSON here");
  commands.push_back({cmd, [g5] { return kiln::experiments::run_glm5_bench(*g5); }});
}

void add_bench_parallel(CLI::App& bench, std::vector<Command>& commands) {
  auto po = std::make_shared<kiln::experiments::ParallelBenchOptions>();
  auto* cmd = bench.add_subcommand(
      "parallel", "Data-parallel trainer step on CUDA GPUs (NCCL) vs one GPU; one process per GPU (torchrun)");
  cmd->add_option("--layers", po->layers, "Decoder layers at GLM-4.7-Flash dimensions (first dense)")
      ->transform(between(int64_t(2), int64_t(47)));
  cmd->add_option("--tokens", po->tokens, "Tokens trained per GPU per step")->transform(between(int64_t(16), int64_t(1) << 20));
  cmd->add_option("--docs", po->docs, "Samples per GPU per step")->transform(between(int64_t(1), int64_t(4096)));
  cmd->add_option("--steps", po->steps, "Timed steps (median shown)")->transform(between(1, 100));
  cmd->add_option("--ep", po->ep, "Expert-parallel ranks of the EP measurement (0: all; 1: none)")
      ->transform(between(int64_t(0), int64_t(64)));
  cmd->add_flag("--fsdp", po->fsdp, "Fully shard the decoder layers of the dp and ep trainers (parallel.fsdp)");
  cmd->add_flag_callback(
      "--no-reshard-after-forward", [po] { po->reshard_after_forward = false; },
      "With --fsdp: keep the layers whole through the step (parallel.reshard_after_forward = false)");
  cmd->add_option("--reduce-dtype", po->reduce_dtype, "Gradient reduction dtype of the dp and ep trainers (parallel.reduce_dtype)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--bucket-mib", po->bucket_mib, "Collective weight-sync bucket size")->transform(between(1.0, 65536.0));
  cmd->add_option("--json", po->json_path, "Write every number as JSON here");
  commands.push_back({cmd, [po] { return kiln::experiments::run_parallel_bench(*po); }});
}

// `kiln model logits --docs`: ids separated by ',' and documents by ';' ("1,2,3;4,5"; spaces
// around an id allowed). Throws std::invalid_argument naming the first entry that is empty or
// not a decimal integer in int64.
std::vector<std::vector<int64_t>> parse_docs(const std::string& spec) {
  std::vector<std::vector<int64_t>> docs;
  std::size_t doc_start = 0;
  for (int64_t d = 1;; ++d) {
    const auto doc_end = std::min(spec.find(';', doc_start), spec.size());
    docs.emplace_back();
    std::size_t id_start = doc_start;
    for (int64_t i = 1;; ++i) {
      const auto id_end = std::min(spec.find(',', id_start), doc_end);
      std::string text = spec.substr(id_start, id_end - id_start);
      text.erase(0, std::min(text.size(), text.find_first_not_of(' ')));
      text.erase(text.find_last_not_of(' ') + 1);  // npos + 1 = 0: all spaces
      const bool empty = text.empty();
      int64_t v = 0;
      const char* first = text.data() + (!text.empty() && text[0] == '+' ? 1 : 0);
      const auto r = std::from_chars(first, text.data() + text.size(), v);
      if (empty || r.ec != std::errc() || r.ptr != text.data() + text.size())
        throw std::invalid_argument("id " + std::to_string(i) + " of document " + std::to_string(d) +
                                    (empty ? " is empty" : " ('" + text + "') is not a decimal integer"));
      docs.back().push_back(v);
      if (id_end == doc_end) break;
      id_start = id_end + 1;
    }
    if (doc_end == spec.size()) break;
    doc_start = doc_end + 1;
  }
  return docs;
}

void add_model(CLI::App& app, std::vector<Command>& commands) {
  struct Args {
    std::string plugin_dir, package = "glm4_moe_lite", from, to, docs_spec, logits_out;
    int shard_mib = 5120;
    int64_t crop_layers = 0;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("model", "Model packages and checkpoints");
  cmd->require_subcommand(1);
  cmd->add_option("--plugins", a->plugin_dir, "Directory of model package plugins (default: $KILN_MODEL_PLUGINS)");
  auto* list = cmd->add_subcommand("list", "List model packages and flavors");
  commands.push_back({list, [a] { return kiln::experiments::run_model_list(a->plugin_dir); }});
  auto* resave = cmd->add_subcommand("resave", "Load an HF checkpoint and write it back through kiln");
  resave->add_option("--package", a->package, "Model package")->default_val("glm4_moe_lite");
  resave->add_option("--from", a->from, "HF checkpoint directory")->required();
  resave->add_option("--to", a->to, "Output directory")->required();
  resave->add_option("--shard-mib", a->shard_mib, "Largest shard, MiB")->default_val(5120)->transform(between(1, 1 << 20));
  commands.push_back({resave, [a] {
                        return kiln::experiments::run_model_resave(a->package, a->from, a->to, a->shard_mib,
                                                                   a->plugin_dir);
                      }});
  auto* crop = cmd->add_subcommand(
      "crop", "Cut a GLM-5.3-Flash checkpoint to its first N layers plus its MTP layer, FP8 weights as bf16");
  crop->add_option("--from", a->from, "HF checkpoint directory (glm5_next)")->required();
  crop->add_option("--to", a->to, "Output directory")->required();
  crop->add_option("--layers", a->crop_layers, "Main layers to keep")->required()->transform(between(int64_t(1), int64_t(1024)));
  crop->add_option("--shard-mib", a->shard_mib, "Largest shard, MiB")->default_val(5120)->transform(between(1, 1 << 20));
  commands.push_back({crop, [a] { return kiln::experiments::run_model_crop(a->from, a->to, a->crop_layers, a->shard_mib); }});
  auto* logits = cmd->add_subcommand("logits", "Packed forward of an HF checkpoint; logits to safetensors");
  logits->add_option("--package", a->package, "Model package")->default_val("glm4_moe_lite");
  logits->add_option("--from", a->from, "HF checkpoint directory")->required();
  logits->add_option("--docs", a->docs_spec, "Documents: ids separated by ',' and documents by ';'")->required();
  logits->add_option("--out", a->logits_out, "Output .safetensors")->required();
  commands.push_back({logits, [a] {
                        std::vector<std::vector<int64_t>> docs;
                        try {
                          docs = parse_docs(a->docs_spec);
                        } catch (const std::exception& e) {
                          std::fprintf(stderr, "kiln model logits: --docs '%s': %s (a list like '1,2,3;4,5')\n",
                                       a->docs_spec.c_str(), e.what());
                          return 2;
                        }
                        return kiln::experiments::run_model_logits(a->package, a->from, docs, a->logits_out,
                                                                   a->plugin_dir);
                      }});
}

void add_serve(CLI::App& app, std::vector<Command>& commands) {
  auto sv = std::make_shared<kiln::experiments::ServeCommand>();
  auto* cmd = app.add_subcommand("serve", "Serve an experiment's rollout engine over HTTP (SGLang's native API)");
  cmd->add_option("experiment", sv->experiment, "Experiment file (TOML; its [model], [rollout], [task] keys); none: the default");
  cmd->add_option("--set", sv->overrides, "Override a key: section.key=value (repeatable)");
  cmd->add_option("--host", sv->listen.host, "Address to listen on")->default_val("127.0.0.1");
  cmd->add_option("--port", sv->listen.port, "Port (0: a free one)")->default_val(30000)->transform(between(0, 65535));
  cmd->add_option("--port-file", sv->listen.port_file, "Write the bound port here once listening");
  cmd->add_option("--threads", sv->listen.threads, "HTTP worker threads (requests handled at once)")
      ->default_val(128)->transform(between(1, 4096));
  commands.push_back({cmd, [sv] { return kiln::experiments::run_serve(*sv); }});
}
#endif

void add_run(CLI::App& app, std::vector<Command>& commands, int argc, char** argv) {
  struct Args {
    std::string experiment;
    std::vector<std::string> overrides;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("run", "Run an experiment (the RL loop)");
  cmd->add_option("experiment", a->experiment, "Experiment file (TOML); none: the built-in default");
  cmd->add_option("--set", a->overrides, "Override a key: section.key=value (repeatable)");
  cmd->footer("Every key, its default and its range: docs/experiments.md. Experiment files: experiments/*.toml.");
  commands.push_back({cmd, [cmd, a, argc, argv] {
                        if (cmd->get_option("experiment")->count() > 0 && a->experiment.empty()) {
                          std::fprintf(stderr, "kiln run: the experiment file's path is empty (leave it out to run "
                                               "the built-in default)\n");
                          return 2;
                        }
#ifdef KILN_WITH_TORCH
                        try {
                          auto config = a->experiment.empty()
                                            ? kiln::experiments::ExperimentConfig{}
                                            : kiln::experiments::ExperimentConfig::from_file(a->experiment);
                          for (const auto& o : a->overrides) config.set(o);
                          return kiln::experiments::run_ranks(config, config.to_toml(),
                                                              std::vector<std::string>(argv, argv + argc));
                        } catch (const std::exception& e) {
                          std::fprintf(stderr, "kiln run: %s\n", e.what());
                          return 2;
                        }
#else
                        (void)argc;
                        (void)argv;
                        std::fprintf(stderr, "kiln run: this build has no LibTorch (KILN_WITH_TORCH=OFF)\n");
                        return 2;
#endif
                      }});
}

}  // namespace

int main(int argc, char** argv) {
  // A write past a file-size limit (ulimit -f) fails with EFBIG, and the writer names the file and
  // removes its partial copy, instead of SIGXFSZ ending kiln without a word.
  std::signal(SIGXFSZ, SIG_IGN);
  kiln::actors::register_diag_actor_kind();      // kiln node --actor diag/N
#ifdef KILN_WITH_TORCH
  kiln::rollout::register_rollout_actor_kind();  // kiln node --actor rollout/N
  kiln::reference::register_ref_actor_kind();    // kiln node --actor ref/N
  kiln::trainer::register_trainer_actor_kind();  // kiln node --actor trainer/N
#endif
  CLI::App app{"kiln: asynchronous RL post-training for GLM-family MoE models"};
  app.require_subcommand(1);
  std::vector<Command> commands;
  add_node(app, commands);
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  add_bench_messaging(*bench, commands);
#ifdef KILN_WITH_TORCH
  add_bench_model(*bench, commands);
  add_bench_rollout(*bench, commands);
  add_bench_serve(*bench, commands);
  add_bench_gpu(*bench, commands);
  add_bench_glm5(*bench, commands);
  add_bench_parallel(*bench, commands);
  add_model(app, commands);
  add_serve(app, commands);
#endif
  add_run(app, commands, argc, argv);

  if (refuse_unknown_command(app, argc, argv)) return 2;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; a refused command line exits 2, as kiln's own checks do
    // (CLI11's own codes, 105-114, say which of its checks refused it, which no caller reads).
    return app.exit(e) == 0 ? 0 : 2;
  }
  for (const auto& c : commands)
    if (c.app->parsed()) {
      // What a command does not catch itself (a benchmark's model refused, say): named, with the
      // exit code of kiln's other refusals for bad input (2), else 1; never std::terminate.
      std::string name = c.app->get_name();
      for (auto* p = c.app->get_parent(); p && p->get_parent(); p = p->get_parent()) name = p->get_name() + " " + name;
      try {
#ifdef KILN_WITH_TORCH
        kiln::kernels::check_grouped_gemm_environment();  // KILN_GROUPED_GEMM_TILES, before any work
#endif
        return c.run();
      } catch (const std::invalid_argument& e) {
        std::fprintf(stderr, "kiln %s: %s\n", name.c_str(), e.what());
        return 2;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "kiln %s: error: %s\n", name.c_str(), e.what());
        return 1;
      }
    }
  return 0;
}
