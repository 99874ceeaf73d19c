#include "actors/controller/rollout_stream.hpp"

#include <algorithm>
#include <stdexcept>

namespace kiln::controller {

RolloutStream::RolloutStream(Generate generate, Load load, int64_t first, int64_t last, int64_t staleness,
                             std::vector<Batch> restored)
    : generate_(std::move(generate)), load_(std::move(load)), k_(staleness), consumed_(first - 1), last_(last) {
  for (auto& b : restored) {
    if (b.step != first + int64_t(ready_.size())) throw std::logic_error("restored rollout batches out of order");
    ready_.push_back(std::move(b));
  }
  const int64_t next = first + int64_t(ready_.size());
  if (k_ > 0) thread_ = std::thread([this, next, last] { run(next, last); });
}

RolloutStream::~RolloutStream() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

Batch RolloutStream::take(int64_t step) {
  std::unique_lock<std::mutex> l(mu_);
  if (k_ == 0) {
    if (ready_.empty() || ready_.front().step != step) {
      l.unlock();
      return generate_(step, [] {});
    }
    Batch b = std::move(ready_.front());  // restored from the checkpoint
    ready_.pop_front();
    return b;
  }
  cv_.wait(l, [&] { return !ready_.empty() || !error_.empty(); });
  if (ready_.empty()) throw std::runtime_error("rollout thread: " + error_);
  Batch b = std::move(ready_.front());
  ready_.pop_front();
  if (b.step != step) throw std::logic_error("rollout batches out of order");  // FIFO by construction
  return b;
}

void RolloutStream::consumed(int64_t step, std::optional<PolicyWeights> weights) {
  if (k_ == 0) {
    if (weights) load_(*weights);
    return;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    if (weights) pending_ = std::move(weights);
    consumed_ = step;
  }
  cv_.notify_all();
}

std::vector<Batch> RolloutStream::in_flight(int64_t step, bool wait) {
  std::unique_lock<std::mutex> l(mu_);
  const int64_t through = std::min(step + k_, last_);
  if (wait && k_ > 0)
    cv_.wait(l, [&] { return done_ || !error_.empty() || (!ready_.empty() && ready_.back().step >= through); });
  if (ready_.empty() || ready_.front().step != step + 1) return {};
  return {ready_.begin(), ready_.end()};
}

void RolloutStream::load_pending() {
  std::optional<PolicyWeights> w;
  {
    std::lock_guard<std::mutex> l(mu_);
    w.swap(pending_);
  }
  if (w) load_(*w);
}

void RolloutStream::run(int64_t first, int64_t last) {
  try {
    for (int64_t s = first; s <= last; ++s) {
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || consumed_ >= s - 1 - k_; });
        if (stop_) return;
      }
      load_pending();
      Batch b = generate_(s, [this] { load_pending(); });
      {
        std::lock_guard<std::mutex> l(mu_);
        ready_.push_back(std::move(b));
      }
      cv_.notify_all();
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> l(mu_);
    error_ = e.what();
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    done_ = true;
  }
  cv_.notify_all();
}

}  // namespace kiln::controller
