#include "experiments/serve.hpp"

#include <signal.h>

#include <cstdio>
#include <filesystem>

#include "actors/rollout/engine_loop.hpp"
#include "actors/rollout/hf_tokenizer.hpp"
#include "actors/rollout/http_server.hpp"
#include "experiments/experiment.hpp"
#include "model/registry.hpp"

namespace kiln::experiments {

int run_serve(const ServeCommand& command) {
  // SIGINT and SIGTERM reach serve_http's sigwait only: blocked before any thread starts.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client gone mid-answer is a failed write, not a dead server
  std::shared_ptr<model::CausalLM> model;
  std::unique_ptr<rollout::Tokenizer> tokenizer;
  const rollout::HfTokenizer* hf = nullptr;  // the tokenizer when it is a tokenizer.json (chats need one)
  std::unique_ptr<rollout::EngineLoop> loop;
  ExperimentConfig c;
  // What the command line names, checked before the model is built.
  if (command.listen.host.empty()) {
    std::fprintf(stderr, "kiln serve: --host must name an address (127.0.0.1, 0.0.0.0, ::1, a host name)\n");
    return 2;
  }
  if (!command.listen.port_file.empty()) {
    const std::filesystem::path f(command.listen.port_file);
    const auto dir = f.has_parent_path() ? f.parent_path() : std::filesystem::path(".");
    std::error_code ec;
    if (std::filesystem::is_directory(f, ec) || !std::filesystem::is_directory(dir, ec)) {
      std::fprintf(stderr, "kiln serve: --port-file '%s' %s\n", command.listen.port_file.c_str(),
                   std::filesystem::is_directory(f, ec) ? "is a directory (give a file's path)"
                                                        : ("is in a directory that does not exist ('" +
                                                           dir.string() + "')").c_str());
      return 2;
    }
  }
  try {
    if (!command.experiment.empty()) c = ExperimentConfig::from_file(command.experiment);
    for (const auto& o : command.overrides) c.set(o);
    c.validate();
    torch::manual_seed(uint64_t(c.run.seed));  // the flavor's initial weights equal kiln run's initial policy
    model = model::Registry::with_plugins().build(c.model);
    if (c.task.tokenizer.empty()) {
      tokenizer = std::make_unique<rollout::CharTokenizer>();
    } else {
      try {
        auto t = std::make_unique<rollout::HfTokenizer>(rollout::BpeTokenizer::from_file(c.task.tokenizer),
                                                        rollout::chat_format_from_string(c.task.chat_template));
        hf = t.get();
        tokenizer = std::move(t);
      } catch (const std::exception& e) {
        throw std::invalid_argument("task.tokenizer '" + c.task.tokenizer + "': " + e.what());
      }
    }
    if (tokenizer->vocab_size() > model->vocab_size())
      throw std::invalid_argument("the tokenizer's vocabulary (" + std::to_string(tokenizer->vocab_size()) +
                                  " ids) does not fit the model's (" + std::to_string(model->vocab_size()) + ")");
    loop = std::make_unique<rollout::EngineLoop>(std::make_unique<rollout::Engine>(model, c.engine_for_run()));
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "kiln serve: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln serve: %s\n", e.what());
    return 2;
  }
  rollout::ServeOptions o;
  o.listen = command.listen;
  o.model_path = c.model.checkpoint.empty() ? c.model.package + ":" + c.model.flavor : c.model.checkpoint;
  o.weight_update_timeout = std::chrono::seconds(c.rollout.weight_update_timeout_s);
  o.tokenizer_path = c.task.tokenizer.empty() ? "kiln:character" : c.task.tokenizer;
  if (hf && c.task.chat_template != "none") {
    const rollout::ChatOptions chat{*rollout::chat_format_from_string(c.task.chat_template)};
    o.chat = [hf, chat](std::span<const rollout::ChatMessage> m) { return rollout::encode_chat(hf->bpe(), m, chat); };
  }
  return rollout::serve_http(*loop, model, tokenizer.get(), o);
}

}  // namespace kiln::experiments
