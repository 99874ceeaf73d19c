#include "experiments/bench_serve.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "actors/controller/config.hpp"
#include "actors/rollout/engine.hpp"
#include "messaging/stopwatch.hpp"
#include "model/registry.hpp"

extern char** environ;

namespace kiln::experiments {

namespace {
using nlohmann::json;

struct Sample {
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
};

// The in-process engine with at most `clients` requests in flight: a finished one is replaced by
// the next before the following step (clients that ask again at once). Seconds.
double in_process(const std::shared_ptr<model::CausalLM>& model, const rollout::EngineOptions& eo,
                  const std::vector<rollout::GenerationRequest>& requests, int64_t clients, std::vector<Sample>& out) {
  rollout::Engine engine(model, eo);
  std::size_t next = 0;
  const messaging::Stopwatch t;
  for (; next < requests.size() && int64_t(next) < clients; ++next) engine.submit(requests[next]);
  while (engine.has_work())
    for (auto& c : engine.step()) {
      out[c.id] = {std::move(c.tokens), std::move(c.logprobs)};
      if (next < requests.size()) engine.submit(requests[next++]);
    }
  return t.seconds();
}

// `clients` threads, each sending the next request to `url`'s /generate until none is left.
// Seconds, or -1 (with `error` set) when a request fails.
double over_http(const std::string& url, const std::vector<rollout::GenerationRequest>& requests, int64_t clients,
                 std::vector<Sample>& out, std::string& error) {
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  const messaging::Stopwatch t;
  std::vector<std::thread> threads;
  for (int64_t k = 0; k < clients; ++k)
    threads.emplace_back([&] {
      httplib::Client cli(url);
      cli.set_read_timeout(600);
      for (std::size_t i; (i = next++) < requests.size();) {
        const auto& q = requests[i];
        const json body = {{"input_ids", q.prompt}, {"return_logprob", true},
                           {"sampling_params", {{"max_new_tokens", q.sampling.max_new_tokens},
                                                {"temperature", q.sampling.temperature},
                                                {"sampling_seed", q.sampling.seed},
                                                {"ignore_eos", true}}}};  // as the engine: no stop token
        auto r = cli.Post("/generate", body.dump(), "application/json");
        std::lock_guard<std::mutex> l(mu);
        if (!r || r->status != 200) {
          error = r ? "HTTP " + std::to_string(r->status) + ": " + r->body : httplib::to_string(r.error());
          return;
        }
        const auto j = json::parse(r->body);
        Sample s{j["output_ids"].get<std::vector<int64_t>>(), {}};
        for (const auto& lp : j["meta_info"]["output_token_logprobs"]) s.logprobs.push_back(lp[0].get<float>());
        out[i] = std::move(s);
      }
    });
  for (auto& th : threads) th.join();
  return error.empty() ? t.seconds() : -1;
}

// `kiln serve` as a child process on a free loopback port; stopped on destruction.
struct ServerProcess {
  pid_t pid = -1;
  std::string url;
  ServerProcess(const std::string& flavor, const std::filesystem::path& port_file) {
    std::filesystem::remove(port_file);
    std::vector<std::string> argv = {"kiln", "serve", "--port", "0", "--port-file", port_file.string(),
                                     "--set", "model.flavor=" + flavor, "--set", "run.seed=1"};
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args.data(), environ) != 0)
      throw std::runtime_error("cannot start kiln serve");
    for (int waited_ms = 0; !std::filesystem::exists(port_file); waited_ms += 50) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid || waited_ms > 120000) {
        pid = -1;
        throw std::runtime_error("kiln serve did not start (its stderr above)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    int port = 0;
    std::ifstream(port_file) >> port;
    url = "http://127.0.0.1:" + std::to_string(port);
  }
  ~ServerProcess() {
    if (pid <= 0) return;
    ::kill(pid, SIGTERM);
    int status = 0;
    ::waitpid(pid, &status, 0);
  }
};
}  // namespace

int run_serve_bench(const ServeBenchOptions& o) {
  torch::manual_seed(1);  // as kiln serve --set run.seed=1 builds the same flavor: equal weights
  const auto registry = model::Registry::with_plugins();
  // Two fp32 copies on this host at once: this process's (the in-process engine) and its kiln
  // serve child's; refused here before either is built.
  registry.check_fits_host("glm4_moe_lite", o.flavor, "", 8.0,
                           "in fp32, twice on this host (the in-process engine's copy and its kiln serve child's)");
  auto model = registry.build(model::ModelSpec{"glm4_moe_lite", o.flavor});
  const auto eo = controller::Config{}.rollout.engine;  // kiln serve's engine for the default experiment
  auto ids = torch::randint(3, model->vocab_size(), {o.requests, o.prompt_tokens}, torch::kInt64);
  std::vector<rollout::GenerationRequest> requests(std::size_t(o.requests));
  for (int64_t i = 0; i < o.requests; ++i) {
    auto& r = requests[std::size_t(i)];
    r.id = uint64_t(i);
    r.prompt.assign(ids[i].data_ptr<int64_t>(), ids[i].data_ptr<int64_t>() + o.prompt_tokens);
    r.sampling.max_new_tokens = o.new_tokens;  // no stop token: every request generates new_tokens
    r.sampling.seed = uint64_t(1000 + i);
  }
  const auto port_file = std::filesystem::temp_directory_path() / ("kiln-bench-serve-" + std::to_string(::getpid()) + ".port");
  std::unique_ptr<ServerProcess> server;
  try {
    server = std::make_unique<ServerProcess>(o.flavor, port_file);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln bench serve: %s\n", e.what());
    return 1;
  }
  std::printf("kiln bench serve: %s, %lld requests of %lld prompt + %lld new tokens, CPU, OMP threads %d; kiln serve at %s\n",
              o.flavor.c_str(), (long long)o.requests, (long long)o.prompt_tokens, (long long)o.new_tokens,
              torch::get_num_threads(), server->url.c_str());
  std::printf("%8s | %14s %14s | %14s %14s | %10s\n", "clients", "in-proc req/s", "in-proc tok/s", "serve req/s",
              "serve tok/s", "serve/in-proc");
  const double tokens = double(o.requests * o.new_tokens);
  int rc = 0;
  for (const int64_t clients : o.clients) {
    std::vector<Sample> local(requests.size()), remote(requests.size());
    const double t_local = in_process(model, eo, requests, clients, local);
    std::string error;
    const double t_remote = over_http(server->url, requests, clients, remote, error);
    if (t_remote < 0) {
      std::fprintf(stderr, "kiln bench serve: %lld clients: %s\n", (long long)clients, error.c_str());
      return 1;
    }
    std::size_t differ = 0;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      bool same = local[i].tokens == remote[i].tokens && local[i].logprobs.size() == remote[i].logprobs.size();
      for (std::size_t k = 0; same && k < local[i].logprobs.size(); ++k)
        same = std::abs(local[i].logprobs[k] - remote[i].logprobs[k]) < 1e-4f;
      differ += !same;
    }
    std::printf("%8lld | %14.1f %14.0f | %14.1f %14.0f | %10.2f%s\n", (long long)clients, double(o.requests) / t_local,
                tokens / t_local, double(o.requests) / t_remote, tokens / t_remote, t_local / t_remote,
                differ ? "  COMPLETIONS DIFFER" : "");
    if (differ) {
      std::fprintf(stderr, "kiln bench serve: %zu of %lld completions over HTTP differ from the in-process engine's\n",
                   differ, (long long)o.requests);
      rc = 1;
    }
  }
  return rc;
}

}  // namespace kiln::experiments
