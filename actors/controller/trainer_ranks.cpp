#include "actors/controller/trainer_ranks.hpp"

#include <algorithm>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "actors/reference/ref_messages.hpp"
#include "actors/rollout/generate_messages.hpp"

#include "actors/trainer/messages.hpp"
#include "actors/trainer/trainer_service.hpp"
#include "model/registry.hpp"

namespace kiln::controller {

using namespace kiln::messaging;

namespace {
constexpr auto kRequestTimeout = std::chrono::seconds(600);
constexpr auto kTrainTimeout = std::chrono::seconds(3600);
}  // namespace

DataParallelTrainer::DataParallelTrainer(const Config& c, parallel::ProcessGroups& groups, Gateway& gateway)
    : gw_(gateway),
      groups_(groups),
      collective_timeout_(std::chrono::seconds(c.parallel.collective_timeout_s)),
      expert_parallel_(groups.along("ep").size() > 1) {
  auto& store = groups.store();
  const int world = groups.world().size();
  for (int r = 1; r < world; ++r) {
    const std::string key = kTrainerRankEndpointKey + std::to_string(r);
    try {
      store.wait({key}, std::chrono::seconds(c.parallel.store_timeout_s));
      endpoints_.push_back(store.get_to_str(key));
    } catch (const std::exception& e) {
      throw std::runtime_error("trainer rank " + std::to_string(r) + " published no endpoint within " +
                               std::to_string(c.parallel.store_timeout_s) + " s (parallel.store_timeout_s): " + e.what());
    }
    actors_.push_back("trainer/" + std::to_string(r));
    gw_.add_route(actors_.back(), endpoints_.back());
  }
  const bool reference = c.placement.reference == "colocated";
  const TrainerInit init{c.model, c.run.seed, c.trainer_for_run(), c.weight_sync.bucket_mib, reference};
  on_all_ranks(
      "trainer.init", [&](const std::string& to) { return make_envelope(init, Kind::request, "controller", to); },
      [&] {
        // As a one-rank run builds its policy (place_actors seeded it); ranks 1.. do the same.
        local_ = std::make_unique<LocalTrainer>(model::Registry::with_plugins().build(c.model, trainer::expert_slice_of(&groups),
                                                                                     trainer::ranks_on_this_host(&groups)), c.trainer_for_run(),
                                                gateway, uint64_t(c.weight_sync.bucket_mib * (1 << 20)), &groups);
        if (reference) local_->hold_reference(c.model);
      },
      kRequestTimeout);
}

namespace {

using Answers = std::vector<std::shared_future<Expected<Envelope>>>;

// An answer that says the rank is gone or can no longer take part in collectives.
bool rank_lost(const Expected<Envelope>& answer) {
  return !answer && answer.error().code != ErrorCode::remote_error && answer.error().code != ErrorCode::bad_message;
}

// Runs `here` (rethrowing what it throws) while watching `answers`: one that says its rank is
// lost (its process gone, or its collectives failed and it exits) aborts `groups`, so that a
// collective `here` waits in on that rank ends now instead of at parallel.collective_timeout_s.
void run_watching(const std::function<void()>& here, const Answers& answers, parallel::ProcessGroups& groups,
                  const std::function<std::string(std::size_t)>& who) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watcher([&] {
    std::unique_lock<std::mutex> l(mu);
    while (!cv.wait_for(l, std::chrono::milliseconds(20), [&] { return done; }))
      for (std::size_t i = 0; i < answers.size(); ++i)
        if (answers[i].wait_for(std::chrono::seconds(0)) == std::future_status::ready && rank_lost(answers[i].get())) {
          groups.abort(who(i) + ": " + answers[i].get().error().what());
          return;
        }
  });
  auto stop = [&] {
    {
      std::lock_guard<std::mutex> l(mu);
      done = true;
    }
    cv.notify_all();
    watcher.join();
  };
  try {
    here();
  } catch (...) {
    stop();
    throw;
  }
  stop();
}

// Waits for `answers` until `deadline`; once one says its rank is lost, the others get
// `grace` more (they can only fail then). Returns which answers arrived.
std::vector<bool> await_answers(const Answers& answers, std::chrono::steady_clock::time_point deadline,
                                std::chrono::seconds grace) {
  std::vector<bool> seen(answers.size(), false);
  std::size_t pending = answers.size();
  while (pending > 0 && std::chrono::steady_clock::now() < deadline) {
    std::size_t next = answers.size();  // the first still pending: waited on (10 ms at most)
    for (std::size_t i = 0; i < answers.size(); ++i) {
      if (seen[i]) continue;
      if (answers[i].wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        if (next == answers.size()) next = i;
        continue;
      }
      seen[i] = true;
      --pending;
      if (rank_lost(answers[i].get())) deadline = std::min(deadline, std::chrono::steady_clock::now() + grace);
    }
    if (next < answers.size()) answers[next].wait_for(std::chrono::milliseconds(10));
  }
  for (std::size_t i = 0; i < answers.size(); ++i)
    seen[i] = seen[i] || answers[i].wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  return seen;
}

}  // namespace

std::vector<Envelope> DataParallelTrainer::on_all_ranks(const std::string& what, const std::function<Envelope(const std::string&)>& request,
                                       const std::function<void()>& here, std::chrono::seconds timeout) {
  Answers answers;
  for (const auto& to : actors_) answers.push_back(gw_.request(request(to), timeout).share());
  auto who = [&](std::size_t i) {
    return "trainer rank " + std::to_string(i + 1) + " (" + actors_[i] + " at " + endpoints_[i] + ")";
  };
  std::exception_ptr local_error;
  bool collective_failed = false;
  try {
    run_watching(here, answers, groups_, who);
  } catch (const parallel::CollectiveError&) {
    local_error = std::current_exception();
    collective_failed = true;
  } catch (...) {
    local_error = std::current_exception();
  }
  // A rank that is alive answers within the collective timeout once rank 0's part is over
  // (its collectives fail too when another rank is gone); a dead one at once (peer lost).
  // Once a rank is lost or rank 0's collectives failed, the others can only fail: they get
  // kLostGrace to say why (a rank whose collectives failed answers and exits, which ends the
  // collectives of those waiting on it), then they count as lost.
  constexpr auto kLostGrace = std::chrono::seconds(3);
  const auto now = std::chrono::steady_clock::now();
  const auto seen = await_answers(answers, collective_failed ? now + kLostGrace : now + collective_timeout_ + std::chrono::seconds(30),
                                  kLostGrace);
  // Named in the order that explains the failure: ranks gone, ranks whose collectives failed
  // then, ranks that did not answer (waiting in a collective on one of those).
  std::string gone, broken, silent, failed;
  auto add = [](std::string& list, const std::string& item) { list += (list.empty() ? "" : "; ") + item; };
  std::vector<Envelope> replies;
  for (std::size_t i = 0; i < answers.size(); ++i) {
    if (!seen[i]) {
      add(silent, who(i) + ": no answer to " + what);
      continue;
    }
    const auto& r = answers[i].get();
    if (r) replies.push_back(*r);
    else if (!rank_lost(r)) add(failed, who(i) + ": " + r.error().message);
    else if (r.error().code == ErrorCode::collective_failed) add(broken, who(i) + ": its collectives failed, it exits: " + r.error().message);
    else add(gone, who(i) + " lost: " + r.error().what());
  }
  std::string lost = gone;
  for (const auto* more : {&broken, &silent})
    if (!more->empty()) add(lost, *more);
  auto local_message = [&]() -> std::string {
    try {
      std::rethrow_exception(local_error);
    } catch (const std::exception& e) {
      return e.what();
    }
  };
  if (!lost.empty())
    throw PolicyLost(what + ": " + lost + (local_error ? " (rank 0: " + local_message() + ")" : ""));
  if (collective_failed)  // every rank answered, yet rank 0's collective failed: the group is broken
    throw PolicyLost(what + ": rank 0: " + local_message() + (failed.empty() ? "" : "; " + failed));
  if (local_error) std::rethrow_exception(local_error);  // a refused batch: every rank refused it
  if (!failed.empty())  // rank 0's part went through and another's did not: the ranks disagree now
    throw PolicyLost(what + ": " + failed);
  return replies;
}

trainer::StepMetrics DataParallelTrainer::train(std::vector<trainer::Sample> samples) {
  trainer::StepMetrics m;
  const auto replies = on_all_ranks(
      TrainerTrain::kType.data(), [&](const std::string& to) { return trainer::train_request(samples, "controller", to); },
      [&] { m = local_->train(samples); }, kTrainTimeout);
  for (const auto& reply : replies) {  // each rank's own peak memory, in rank order after rank 0's
    auto r = payload_as<TrainerStepResult>(reply);
    m.peak_memory_gib.push_back(r && r->metrics.peak_memory_gib.size() == 1 ? r->metrics.peak_memory_gib[0] : -1.0);
  }
  return m;
}

PolicyWeights DataParallelTrainer::weights(bool copy) {
  if (!expert_parallel_) return local_->weights(copy);
  PolicyWeights w;
  const TrainerGatherWeights q{local_->version()};
  on_all_ranks(
      TrainerGatherWeights::kType.data(),
      [&](const std::string& to) { return make_envelope(q, Kind::request, "controller", to); },
      [&] { w = local_->weights(copy); }, kRequestTimeout);
  return w;
}

void DataParallelTrainer::send_collective(weight_sync::CollectiveSender& sender) {
  if (!expert_parallel_) return local_->send_collective(sender);
  const TrainerSyncExperts q{local_->version()};
  on_all_ranks(
      TrainerSyncExperts::kType.data(),
      [&](const std::string& to) { return make_envelope(q, Kind::request, "controller", to); },
      [&] { local_->send_collective(sender); }, kRequestTimeout);
}

void DataParallelTrainer::save(const std::filesystem::path& dir, const trainer::CheckpointState& state) {
  on_all_ranks(
      TrainerSave::kType.data(),
      [&](const std::string& to) {  // rank 0 alone writes the loop state and the rollouts in flight
        return make_envelope(TrainerSave{dir.string(), state.step, state.prompt_rng}, Kind::request, "controller", to);
      },
      [&] { local_->save(dir, state); }, kRequestTimeout);
}

trainer::CheckpointState DataParallelTrainer::load(const std::filesystem::path& dir) {
  trainer::CheckpointState state;
  on_all_ranks(
      TrainerLoad::kType.data(),
      [&](const std::string& to) { return make_envelope(TrainerLoad{dir.string()}, Kind::request, "controller", to); },
      [&] { state = local_->load(dir); }, kRequestTimeout);
  return state;
}

std::size_t DataParallelTrainer::rank_of(const std::string& actor) const {
  return std::size_t(std::find(actors_.begin(), actors_.end(), actor) - actors_.begin()) + 1;
}

std::vector<rollout::Completion> DataParallelTrainer::generate_colocated(std::vector<rollout::GenerationRequest> requests,
                                                                         const rollout::EngineOptions& engine,
                                                                         int64_t group_size,
                                                                         const std::function<void()>& between_steps) {
  const auto bounds = prompt_group_shares(requests.size(), group_size, actors_.size() + 1);
  std::vector<std::vector<rollout::GenerationRequest>> shares(bounds.size());
  for (std::size_t r = 0; r < bounds.size(); ++r)
    for (std::size_t k = bounds[r].first; k < bounds[r].second; ++k) shares[r].push_back(std::move(requests[k]));
  TrainerGenerate q{local_->version(), engine, {}};
  std::vector<rollout::Completion> out;
  const auto replies = on_all_ranks(
      TrainerGenerate::kType.data(),
      [&](const std::string& to) {
        q.requests.clear();
        for (const auto& g : shares[rank_of(to)]) q.requests.push_back(rollout::to_spec(g));
        return make_envelope(q, Kind::request, "controller", to);
      },
      [&] { out = local_->generate_colocated(shares[0], engine, group_size, between_steps); }, kTrainTimeout);
  for (std::size_t i = 0; i < replies.size(); ++i)
    for (auto& c : rollout::read_result(replies[i], shares[i + 1], "trainer rank " + std::to_string(i + 1)))
      out.push_back(std::move(c));
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
  return out;
}

std::vector<std::vector<float>> DataParallelTrainer::reference_logprobs(const std::vector<rollout::Completion>& completions) {
  if (!local_->holds_reference()) return TrainerHandle::reference_logprobs(completions);  // throws: none held
  const std::size_t W = actors_.size() + 1, N = completions.size();
  std::vector<std::vector<rollout::Completion>> shares(W);
  for (std::size_t r = 0; r < W; ++r)
    shares[r].assign(completions.begin() + std::ptrdiff_t(N * r / W), completions.begin() + std::ptrdiff_t(N * (r + 1) / W));
  std::vector<std::vector<float>> out;
  const auto replies = on_all_ranks(
      RefLogprobs::kType.data(),
      [&](const std::string& to) {
        return reference::logprobs_request(shares[rank_of(to)], /*routing_replay=*/true, "controller", to);
      },
      [&] { out = local_->reference_logprobs(shares[0]); }, kTrainTimeout);
  for (std::size_t i = 0; i < replies.size(); ++i)
    for (auto& v : reference::read_logprobs(replies[i], shares[i + 1], "trainer rank " + std::to_string(i + 1)))
      out.push_back(std::move(v));
  return out;
}

}  // namespace kiln::controller
