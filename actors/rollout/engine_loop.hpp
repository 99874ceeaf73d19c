#pragma once
// The in-process Engine (engine.hpp) driven by a thread of its own, for callers on other
// threads (the HTTP handlers of `kiln serve`, actors/rollout/http_server.hpp): they submit
// requests and wait for their completions, cancel them, or run a command on the engine
// between two steps (pause, resume, a weight load, a status read). Requests submitted while
// others decode join them at the next step (continuous batching). Only the loop's thread
// touches the engine; callers never wait for a step to end to enqueue.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "actors/rollout/engine.hpp"

namespace kiln::rollout {

/// One submitted request: its completion (or the error that ended it) once it finished.
class Ticket {
 public:
  /// Waits up to `timeout`; true once the request finished (completion() or error() is set).
  bool wait_for(std::chrono::milliseconds timeout);
  /// The completion; std::nullopt before it finished or when it ended with an error.
  std::optional<Completion> completion();
  /// Why it ended without a completion ("" when it did not).
  std::string error();
  /// A streamed request (EngineLoop::submit with stream): the tokens generated so far, from
  /// index `from` on (waits up to `timeout` for one). Finished: the rest of the completion.
  std::vector<int64_t> tokens_from(std::size_t from, std::chrono::milliseconds timeout);

 private:
  friend class EngineLoop;
  void finish(std::optional<Completion> c, std::string error);
  std::mutex mu_;
  std::condition_variable cv_;
  void progress(const std::vector<int64_t>& tokens);
  bool done_ = false;
  bool stream_ = false;
  std::vector<int64_t> tokens_;  ///< stream: generated so far
  std::optional<Completion> completion_;
  std::string error_;
};

/// What a status read returns.
struct EngineStatus {
  int64_t running = 0;      ///< sequences decoding
  int64_t waiting = 0;      ///< admitted to the queue, waiting for cache pages or a batch slot
  int64_t free_blocks = 0;  ///< cache pages free
  int64_t policy_version = 0;
  bool paused = false;
};

class EngineLoop {
 public:
  /// Starts the loop's thread, which owns `engine` from now on.
  explicit EngineLoop(std::unique_ptr<Engine> engine);
  /// Stops the thread; requests not finished end with the error "the server is stopping".
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  /// Queues `requests` together (they join the engine at the same step); their ids are
  /// replaced by the loop's own, appended to `ticket_ids`. Throws std::invalid_argument as
  /// Engine::check does, before anything is queued. `stream`: the tickets follow the tokens as
  /// they are generated (Ticket::tokens_from).
  std::vector<std::shared_ptr<Ticket>> submit(std::vector<GenerationRequest> requests, std::vector<uint64_t>& ticket_ids,
                                              bool stream = false);
  /// Drops the request (a client that went away); its cache pages are free after the step
  /// in progress. Unknown or finished ids are ignored.
  void cancel(uint64_t ticket_id);
  /// Ends every request not finished with the error `why` (their cache pages free again);
  /// returns how many. SGLang's /pause_generation mode "abort".
  int64_t abort_all(const std::string& why);
  /// Runs `command` on the loop's thread between two steps and returns what it returns
  /// (rethrowing what it throws).
  template <class F>
  auto call(F command) -> decltype(command(std::declval<Engine&>())) {
    using R = decltype(command(std::declval<Engine&>()));
    auto task = std::make_shared<std::packaged_task<R()>>([this, c = std::move(command)]() mutable { return c(*engine_); });
    auto result = task->get_future();
    post([task] { (*task)(); });
    return result.get();
  }
  EngineStatus status();
  /// Settings fixed at construction (callable from any thread).
  const Engine& engine() const { return *engine_; }

 private:
  void post(std::function<void()> command);
  void run();
  std::unique_ptr<Engine> engine_;
  std::mutex mu_;  // guards commands_ and stop_; never held during a step
  std::condition_variable cv_;
  std::deque<std::function<void()>> commands_;
  bool stop_ = false;
  std::atomic<uint64_t> next_id_{1};
  std::map<uint64_t, std::shared_ptr<Ticket>> tickets_;  // the loop's thread only
  std::thread thread_;
};

}  // namespace kiln::rollout
