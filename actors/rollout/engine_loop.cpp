#include "actors/rollout/engine_loop.hpp"

namespace kiln::rollout {

bool Ticket::wait_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  return cv_.wait_for(l, timeout, [&] { return done_; });
}

std::optional<Completion> Ticket::completion() {
  std::lock_guard<std::mutex> l(mu_);
  return completion_;
}

std::string Ticket::error() {
  std::lock_guard<std::mutex> l(mu_);
  return error_;
}

std::vector<int64_t> Ticket::tokens_from(std::size_t from, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  auto have = [&] { return completion_ ? completion_->tokens.size() : tokens_.size(); };
  cv_.wait_for(l, timeout, [&] { return done_ || have() > from; });
  const auto& all = completion_ ? completion_->tokens : tokens_;
  return from < all.size() ? std::vector<int64_t>(all.begin() + std::ptrdiff_t(from), all.end()) : std::vector<int64_t>{};
}

void Ticket::progress(const std::vector<int64_t>& tokens) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (tokens.size() == tokens_.size()) return;
    tokens_ = tokens;
  }
  cv_.notify_all();
}

void Ticket::finish(std::optional<Completion> c, std::string error) {
  {
    std::lock_guard<std::mutex> l(mu_);
    completion_ = std::move(c);
    error_ = std::move(error);
    done_ = true;
  }
  cv_.notify_all();
}

EngineLoop::EngineLoop(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (auto& [id, t] : tickets_) t->finish(std::nullopt, "the server is stopping");
}

void EngineLoop::post(std::function<void()> command) {
  {
    std::lock_guard<std::mutex> l(mu_);
    commands_.push_back(std::move(command));
  }
  cv_.notify_all();
}

std::vector<std::shared_ptr<Ticket>> EngineLoop::submit(std::vector<GenerationRequest> requests,
                                                        std::vector<uint64_t>& ticket_ids, bool stream) {
  for (const auto& r : requests) engine_->check(r);  // the fault reaches the caller now, not through a ticket
  std::vector<std::shared_ptr<Ticket>> tickets;
  std::vector<std::pair<uint64_t, std::shared_ptr<Ticket>>> queued;
  for (auto& r : requests) {
    r.id = next_id_++;
    ticket_ids.push_back(r.id);
    tickets.push_back(std::make_shared<Ticket>());
    tickets.back()->stream_ = stream;
    queued.emplace_back(r.id, tickets.back());
  }
  post([this, queued, rs = std::move(requests)]() mutable {
    for (std::size_t i = 0; i < rs.size(); ++i) try {
        engine_->submit(std::move(rs[i]));
        tickets_[queued[i].first] = queued[i].second;
      } catch (const std::exception& e) {  // checked above: only a bug gets here
        queued[i].second->finish(std::nullopt, e.what());
      }
  });
  return tickets;
}

void EngineLoop::cancel(uint64_t ticket_id) {
  post([this, ticket_id] {
    auto it = tickets_.find(ticket_id);
    if (it == tickets_.end()) return;
    engine_->cancel(ticket_id);
    it->second->finish(std::nullopt, "cancelled");
    tickets_.erase(it);
  });
}

int64_t EngineLoop::abort_all(const std::string& why) {
  return call([this, why](Engine&) {
    const auto n = int64_t(tickets_.size());
    for (auto& [id, t] : tickets_) {
      engine_->cancel(id);
      t->finish(std::nullopt, why);
    }
    tickets_.clear();
    return n;
  });
}

EngineStatus EngineLoop::status() {
  return call([](Engine& e) {
    return EngineStatus{int64_t(e.running()), int64_t(e.waiting()), e.free_blocks(), e.policy_version(), e.paused()};
  });
}

void EngineLoop::run() {
  bool busy = false;  // the engine has work it may step on
  for (;;) {
    std::deque<std::function<void()>> commands;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || busy || !commands_.empty(); });
      if (stop_) return;
      commands.swap(commands_);
    }
    for (auto& c : commands) c();
    if (engine_->has_work() && !engine_->paused()) {
      try {
        for (auto& c : engine_->step()) {
          auto it = tickets_.find(c.id);
          if (it == tickets_.end()) continue;  // cancelled meanwhile
          it->second->finish(std::move(c), "");
          tickets_.erase(it);
        }
        for (auto& [id, t] : tickets_)  // streamed requests still running: their tokens so far
          if (t->stream_)
            if (const auto* p = engine_->progress(id)) t->progress(p->tokens);
      } catch (const std::exception& e) {
        // A step that failed (an allocation, a kernel): every request in it ends with the error,
        // and the engine is emptied so that the server keeps serving new ones.
        for (auto& [id, t] : tickets_) {
          engine_->cancel(id);
          t->finish(std::nullopt, std::string("the engine step failed: ") + e.what());
        }
        tickets_.clear();
      }
    }
    busy = engine_->has_work() && !engine_->paused();
  }
}

}  // namespace kiln::rollout
