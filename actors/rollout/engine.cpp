#include "actors/rollout/engine.hpp"

#include "parallel/group.hpp"

#include <thread>

#include "kernels/moe_decode.hpp"

#include <algorithm>
#include <optional>
#include <stdexcept>

namespace kiln::rollout {

namespace {
using Clock = std::chrono::steady_clock;

std::optional<FinishReason> finish_reason(const std::vector<int64_t>& tokens, const SamplingParams& p) {
  if (tokens.empty()) return std::nullopt;
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), tokens.back()) != p.stop_token_ids.end())
    return FinishReason::stop;
  for (const auto& seq : p.stop_sequences)
    if (seq.size() <= tokens.size() && std::equal(seq.rbegin(), seq.rend(), tokens.rbegin())) return FinishReason::stop;
  if (int64_t(tokens.size()) >= p.max_new_tokens) return FinishReason::length;
  return std::nullopt;
}

void record(Completion& c, const SampledToken& t, int64_t version) {
  c.tokens.push_back(t.token);
  c.logprobs.push_back(t.logprob);
  c.entropies.push_back(t.entropy);
  c.policy_versions.push_back(version);
}

void check_request(const GenerationRequest& r, int64_t vocab) {
  if (r.prompt.empty()) throw std::invalid_argument("request " + std::to_string(r.id) + ": empty prompt");
  for (auto t : r.prompt)
    if (t < 0 || t >= vocab)
      throw std::invalid_argument("request " + std::to_string(r.id) + ": prompt token " + std::to_string(t) +
                                  " outside the vocabulary [0, " + std::to_string(vocab) + ")");
  r.sampling.validate();
}
}  // namespace

int64_t decode_slots(const EngineOptions& o) { return std::min(o.max_batch, o.cache_blocks); }

const char* to_string(FinishReason r) { return r == FinishReason::stop ? "stop" : "length"; }

int64_t cache_bytes(const EngineOptions& o, const model::CausalLM& m, torch::Dtype dtype) {
  return m.decode_cache_bytes({o.cache_blocks + (o.cuda_graphs ? 1 : 0), o.block_size, decode_slots(o)}, dtype);
}

Engine::Engine(std::shared_ptr<model::CausalLM> model, EngineOptions options)
    : model_(std::move(model)), o_(options), vocab_size_(model_->vocab_size()) {
  if (o_.cache_blocks < 1 || o_.block_size < 1 || o_.max_batch < 1 || o_.max_prefill_tokens < 1 || o_.step_delay_ms < 0)
    throw std::invalid_argument("engine: cache_blocks, block_size, max_batch and max_prefill_tokens must be >= 1, "
                                "step_delay_ms >= 0");
  o_.max_batch = decode_slots(o_);
  if (o_.true_on_policy && (o_.absorbed_decode || o_.cuda_graphs))
    throw std::invalid_argument(std::string("engine: true_on_policy (algorithm.true_on_policy) contradicts rollout.") +
                                (o_.absorbed_decode ? "absorbed_decode" : "cuda_graphs") +
                                " = true: the mode decodes with the expanded attention, the trainer's formula (the "
                                "latent-space decode is another one)");
  if (o_.true_on_policy && !model_->supports_batch_invariant())
    throw std::invalid_argument("engine: true_on_policy (algorithm.true_on_policy) needs a model with a batch-invariant "
                                "forward; this model's package does not implement it (glm4_moe_lite does, glm5_next "
                                "does not)");
  model_->set_batch_invariant(o_.true_on_policy);
  model_->set_absorbed_decode(o_.absorbed_decode);
  model_->set_decode_kernel(o_.mla_decode_kernel);
  if (o_.cuda_graphs && !o_.absorbed_decode)
    throw std::invalid_argument("engine: rollout.cuda_graphs needs rollout.absorbed_decode = true (the captured decode "
                                "step attends in latent space)");
  if (o_.cuda_graphs && model_->expert_parallel())
    throw std::invalid_argument("engine: rollout.cuda_graphs with an expert-parallel model (ep group '" +
                                model_->expert_parallel()->name() +
                                "'): its MoE layers read the other ranks' row counts on the host, which a graph cannot "
                                "capture");
  // With graphs, one page more than the engine hands out: the padding rows' scratch page.
  cache_ = model_->make_decode_cache({o_.cache_blocks + (o_.cuda_graphs ? 1 : 0), o_.block_size, o_.max_batch},
                                     model_->lm_head_weight().options());
  if (o_.cuda_graphs)
    graphs_ = std::make_unique<DecodeGraphs>(*model_, *cache_, o_.block_size, /*scratch_page=*/o_.cache_blocks,
                                             /*max_pages=*/o_.cache_blocks, /*sample=*/o_.sampling_kernel);
  for (int64_t b = o_.cache_blocks - 1; b >= 0; --b) free_.push_back(b);
  for (int64_t b = o_.max_batch - 1; b >= 0; --b) free_slots_.push_back(b);
  refs_.assign(std::size_t(o_.cache_blocks), 0);
}

Engine::Sequence* Engine::prompt_holder(const Sequence& s, const std::vector<std::unique_ptr<Sequence>>& admitted) const {
  if (!o_.share_prompts) return nullptr;
  for (const auto* list : {&admitted, &running_})
    for (const auto& h : *list) {
      // A slot's state advances past the prompt at the next step: only a prompt prefilled in
      // this step can be shared from it then.
      const bool through = list == &admitted ? h->cached == 0 || (h->prompt_version == version_ && !cache_->has_slot_state())
                                             : h->prompt_version == version_ && !cache_->has_slot_state();
      if (through && h->request.prompt == s.request.prompt) return h.get();
    }
  return nullptr;
}

void Engine::HostRows::append(const torch::Tensor& t, int64_t start, int64_t count) {
  if (rows == 0) {
    a = t.size(1);
    w = t.size(2);
  } else if (t.size(1) != a || t.size(2) != w) {
    throw std::logic_error("engine: routing rows of [" + std::to_string(t.size(1)) + ", " + std::to_string(t.size(2)) +
                           "] after rows of [" + std::to_string(a) + ", " + std::to_string(w) + "]");
  }
  const int64_t* p = t.data_ptr<int64_t>() + start * a * w;
  values.insert(values.end(), p, p + count * a * w);
  rows += count;
}

torch::Tensor Engine::HostRows::after(const torch::Tensor& prompt) const {
  if (rows == 0) return prompt.clone();
  auto t = torch::empty({rows, a, w}, torch::kInt64);
  std::copy(values.begin(), values.end(), t.data_ptr<int64_t>());
  return torch::cat({prompt, t}, 0);
}

void Engine::release(Sequence& s) {
  if (in_flight_)  // the queued step still writes this sequence's next position; its token is dropped
    for (auto& row : in_flight_->rows)
      if (row == &s) row = nullptr;
  if (s.slot >= 0) free_slots_.push_back(s.slot);
  s.slot = -1;
  for (auto b : s.blocks)
    if (--refs_[std::size_t(b)] == 0) free_.push_back(b);
  s.blocks.clear();
}

void Engine::check(const GenerationRequest& request) const {
  check_request(request, vocab_size_);
  // P + max_new_tokens tokens fit the cache's cache_blocks pages of block_size tokens; compared
  // without forming the sum, which overflows for a max_new_tokens near 2^63.
  const int64_t P = int64_t(request.prompt.size()), capacity = o_.cache_blocks * o_.block_size;
  if (request.sampling.max_new_tokens > capacity - P)
    throw std::invalid_argument("request " + std::to_string(request.id) + ": prompt " + std::to_string(P) +
                                " + max_new_tokens " + std::to_string(request.sampling.max_new_tokens) +
                                " tokens do not fit the whole cache (" + std::to_string(o_.cache_blocks) + " pages of " +
                                std::to_string(o_.block_size) + " tokens)");
}

void Engine::submit(GenerationRequest request) {
  check(request);
  auto s = std::make_unique<Sequence>(Sequence{std::move(request), {}, {}, {}, {}, 0, Clock::now()});
  s->out.id = s->request.id;
  s->out.prompt = s->request.prompt;
  waiting_.push_back(std::move(s));
}

bool Engine::finished(Sequence& s) const {
  auto r = finish_reason(s.out.tokens, s.request.sampling);
  if (r) s.out.finish_reason = *r;
  return r.has_value();
}

void Engine::admit(std::vector<std::unique_ptr<Sequence>>& admitted,
                   std::vector<std::pair<Sequence*, Sequence*>>& sharing) {
  int64_t prefill_budget = o_.max_prefill_tokens;
  while (!waiting_.empty() && int64_t(running_.size() + admitted.size()) < o_.max_batch) {
    auto& s = *waiting_.front();
    const int64_t P = int64_t(s.request.prompt.size());
    const int64_t need = (P + s.request.sampling.max_new_tokens + o_.block_size - 1) / o_.block_size;
    Sequence* holder = prompt_holder(s, admitted);
    const int64_t shared = holder ? P / o_.block_size : 0;  // full prompt pages taken by reference
    if (need - shared > int64_t(free_.size())) break;         // waits for pages
    if (!holder && P > prefill_budget && !admitted.empty()) break;  // next step
    for (int64_t i = 0; i < shared; ++i) {
      s.blocks.push_back(holder->blocks[std::size_t(i)]);
      ++refs_[std::size_t(s.blocks.back())];
    }
    for (int64_t i = shared; i < need; ++i) {
      s.blocks.push_back(free_.back());
      refs_[std::size_t(free_.back())] = 1;
      free_.pop_back();
    }
    s.slot = free_slots_.back();  // max_batch slots: one for each sequence that may run
    free_slots_.pop_back();
    if (holder) sharing.emplace_back(&s, holder);
    else prefill_budget -= P;
    admitted.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

void Engine::take_shared_prompt(Sequence& s, const Sequence& holder) {
  const int64_t P = int64_t(s.request.prompt.size()), page = P / o_.block_size;
  if (P % o_.block_size != 0) cache_->copy_page(holder.blocks[std::size_t(page)], s.blocks[std::size_t(page)]);
  cache_->copy_slot(holder.slot, s.slot);  // the holder was prefilled in this step if slots hold state
  s.prompt_version = version_;
  s.prompt_hidden = holder.prompt_hidden;
  s.prompt_experts = holder.prompt_experts;
  s.prompt_topk = holder.prompt_topk;
  s.cached = P;
  ++shared_prompts_;
}

std::vector<Completion> Engine::step() {
  if (paused_) return {};
  // Few-row MoE steps (decode) take the decode experts kernels, graphs captured here included.
  const kernels::DecodeExpertsGuard experts_kernel(o_.moe_decode_kernel);
  if (in_flight_) return advance();  // a decode step queued by the last call: read it (and queue the next)
  std::vector<std::unique_ptr<Sequence>> admitted;
  std::vector<std::pair<Sequence*, Sequence*>> sharing;  // (sequence, the holder of its prompt)
  admit(admitted, sharing);
  std::vector<Sequence*> batch;  // through the model this step
  for (auto& s : running_) batch.push_back(s.get());
  for (auto& s : admitted)
    if (std::none_of(sharing.begin(), sharing.end(), [&](const auto& p) { return p.first == s.get(); }))
      batch.push_back(s.get());
  if (batch.empty() && sharing.empty()) return {};

  // One forward for all: running sequences feed their last token, admitted ones their prompt.
  std::vector<int64_t> ids, pos;
  std::vector<model::CachedSlice> slices;
  for (auto* s : batch) {
    const int64_t start = int64_t(ids.size());
    if (s->cached == 0) {
      for (std::size_t i = 0; i < s->request.prompt.size(); ++i) {
        ids.push_back(s->request.prompt[i]);
        pos.push_back(int64_t(i));
      }
    } else {
      ids.push_back(s->out.tokens.back());
      pos.push_back(s->cached);
    }
    slices.push_back({start, int64_t(ids.size()) - start, s->cached, &s->blocks, s->slot});
  }
  auto device = model_->lm_head_weight().device();
  torch::NoGradGuard no_grad;
  const auto& head = model_->lm_head_weight();  // [V, D]
  torch::Tensor h = torch::empty({0, head.size(1)}, head.options()), experts, topk;  // [B, D], [rows, L, K], [rows, Ls, W]
  torch::Tensor logits;   // [B, V] fp32, on the device
  torch::Tensor sampled;  // [B, 3] fp64 on the device, when the graph sampled
  // A pure decode step (every sequence feeds one token, none shares a prompt) replays a graph.
  const bool graphed = graphs_ && !batch.empty() && sharing.empty() &&
                       std::all_of(batch.begin(), batch.end(), [](const Sequence* s) { return s->cached > 0; });
  if (graphed && o_.sampling_kernel && o_.overlap_schedule) return launch_and_advance(batch);
  if (graphed) {
    std::vector<const std::vector<int64_t>*> pages;
    std::vector<const SamplingParams*> params;
    std::vector<int64_t> steps;
    for (auto* s : batch) {
      pages.push_back(&s->blocks);
      if (o_.sampling_kernel) {
        params.push_back(&s->request.sampling);
        steps.push_back(int64_t(s->out.tokens.size()));
      }
    }
    auto g = graphs_->run(ids, pos, pages, params, steps);
    ++forwards_;
    logits = g.logits;
    sampled = g.sampled;
    experts = g.routed_experts.to(torch::kCPU).contiguous();
  } else if (!batch.empty()) {
    auto out = model_->forward_cached(torch::tensor(ids, torch::kInt64).to(device),
                                      torch::tensor(pos, torch::kInt64).to(device), slices, *cache_,
                                      /*want_routing=*/true);
    ++forwards_;
    std::vector<int64_t> last;
    for (const auto& sl : slices) last.push_back(sl.start + sl.count - 1);
    h = out.hidden.index_select(0, torch::tensor(last, torch::kInt64).to(device));
    experts = out.routed_experts.to(torch::kCPU).contiguous();
    if (out.topk_indices.defined()) topk = out.topk_indices.to(torch::kCPU).contiguous();
  }
  for (std::size_t i = 0; i < batch.size(); ++i) {
    auto* s = batch[i];
    if (s->cached == 0) {  // its prompt went through the model: what sharers of it reuse
      prefilled_tokens_ += slices[i].count;
      s->prompt_version = version_;
      s->prompt_hidden = h[int64_t(i)];
      s->prompt_experts = experts.narrow(0, slices[i].start, slices[i].count);
      if (topk.defined()) s->prompt_topk = topk.narrow(0, slices[i].start, slices[i].count);
    } else {
      s->decode_experts.append(experts, slices[i].start, slices[i].count);
      if (topk.defined()) s->decode_topk.append(topk, slices[i].start, slices[i].count);
    }
    s->cached += slices[i].count;
  }
  // Sharers: the holder's prompt (prefilled above or before), their rows after the batch's.
  std::vector<torch::Tensor> rows{h};
  for (auto [sharer, holder] : sharing) {
    take_shared_prompt(*sharer, *holder);
    rows.push_back(sharer->prompt_hidden.unsqueeze(0));
    batch.push_back(sharer);
  }
  // [B, V] fp32, as the trainer's; stays on the device
  if (!graphed) logits = model_->fp32_logits(sharing.empty() ? h : torch::cat(rows, 0));

  std::vector<SampledToken> tokens;
  if (sampled.defined()) {
    tokens = sampled_tokens(sampled);  // sampled in the graph: the step's one read of its tokens
  } else {
    std::vector<const SamplingParams*> params;
    std::vector<int64_t> steps;  // each row's token index in its completion: its draw's Philox counter
    for (auto* s : batch) {
      params.push_back(&s->request.sampling);
      steps.push_back(int64_t(s->out.tokens.size()));
    }
    tokens = sample_tokens(logits, params, steps, o_.sampling_kernel,
                           model_->batch_invariant());  // the whole batch where the logits are
  }
  for (std::size_t i = 0; i < batch.size(); ++i) {
    auto* s = batch[i];
    record(s->out, tokens[i], version_);
    if (s->out.tokens.size() == 1)
      s->out.time_to_first_token_s = std::chrono::duration<double>(Clock::now() - s->submitted).count();
  }
  for (auto& s : admitted) running_.push_back(std::move(s));
  auto done = take_finished();
  if (o_.step_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o_.step_delay_ms));
  return done;
}

std::vector<Completion> Engine::take_finished() {
  std::vector<Completion> done;
  for (auto it = running_.begin(); it != running_.end();) {
    auto& s = **it;
    if (!finished(s)) {
      ++it;
      continue;
    }
    s.out.routed_experts = s.decode_experts.after(s.prompt_experts);  // [P + n - 1, L, K]
    if (s.prompt_topk.defined()) s.out.topk_indices = s.decode_topk.after(s.prompt_topk);  // [P + n - 1, Ls, W]
    release(s);
    done.push_back(std::move(s.out));
    it = running_.erase(it);
  }
  return done;
}

std::vector<Completion> Engine::launch_and_advance(const std::vector<Sequence*>& batch) {
  std::vector<int64_t> ids, pos, steps;
  std::vector<const std::vector<int64_t>*> pages;
  std::vector<const SamplingParams*> params;
  for (auto* s : batch) {
    ids.push_back(s->out.tokens.back());
    pos.push_back(s->cached);
    pages.push_back(&s->blocks);
    params.push_back(&s->request.sampling);
    steps.push_back(int64_t(s->out.tokens.size()));
  }
  in_flight_ = InFlight{graphs_->launch(ids, pos, pages, params, steps), batch};
  ++forwards_;
  return advance();
}

std::vector<Completion> Engine::advance() {
  InFlight cur = std::move(*in_flight_);
  in_flight_.reset();
  // The next step, queued before this one's tokens are read, when it is a pure decode step: no
  // request waits (it would be admitted, a prefill), and a row goes on (one that this step does
  // not bring to max_new_tokens; a stop token it may draw is seen only at the read, and that
  // row's next token dropped). Row b feeds what this step samples for it, at the next position.
  std::optional<InFlight> next;
  if (waiting_.empty()) {
    DecodeGraphs::SampledIds ids{&cur.step, {}};
    std::vector<Sequence*> rows;
    std::vector<int64_t> pos, steps;
    std::vector<const std::vector<int64_t>*> pages;
    std::vector<const SamplingParams*> params;
    for (int64_t b = 0; b < int64_t(cur.rows.size()); ++b) {
      Sequence* s = cur.rows[std::size_t(b)];
      if (!s || int64_t(s->out.tokens.size()) + 1 >= s->request.sampling.max_new_tokens) continue;
      ids.rows.push_back(b);
      rows.push_back(s);
      pos.push_back(s->cached + 1);
      pages.push_back(&s->blocks);
      params.push_back(&s->request.sampling);
      steps.push_back(int64_t(s->out.tokens.size()) + 1);
    }
    if (!rows.empty()) {
      try {
        next = InFlight{graphs_->launch(ids, pos, pages, params, steps), std::move(rows)};
        ++forwards_;
        ++overlapped_steps_;
      } catch (...) {
        in_flight_ = std::move(cur);  // still queued, still to be read
        throw;
      }
    }
  }
  const auto read = DecodeGraphs::read(cur.step);  // waits for cur; the GPU goes on with next
  for (std::size_t b = 0; b < cur.rows.size(); ++b) {
    Sequence* s = cur.rows[b];
    if (!s) continue;
    s->decode_experts.append(read.routed_experts, int64_t(b), 1);
    s->cached += 1;
    record(s->out, read.tokens[b], version_);
  }
  in_flight_ = std::move(next);
  auto done = take_finished();
  if (in_flight_ && std::none_of(in_flight_->rows.begin(), in_flight_->rows.end(), [](Sequence* s) { return s; }))
    in_flight_.reset();  // every row finished: nothing of it to read
  if (o_.step_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o_.step_delay_ms));
  return done;
}

void Engine::pause() {
  if (in_flight_) {
    in_flight_->step.ready->synchronize();  // done before weights are written under it
    in_flight_.reset();
  }
  paused_ = true;
}

std::vector<Completion> Engine::generate(std::vector<GenerationRequest> requests) {
  if (paused_) throw std::logic_error("engine: generate() on a paused engine would never finish; resume() first");
  for (auto& r : requests) submit(std::move(r));
  std::vector<Completion> all;
  while (has_work())
    for (auto& c : step()) all.push_back(std::move(c));
  return all;
}

void Engine::update_weights(const std::vector<messaging::Tensor>& hf_tensors, int64_t version) {
  if (!paused_) throw std::logic_error("engine: update_weights() between decode steps only: pause() first");
  model_->load_hf_tensors(hf_tensors);
  version_ = version;
}

void Engine::weights_written(int64_t version) {
  if (!paused_) throw std::logic_error("engine: weights_written() between decode steps only: pause() first");
  version_ = version;
}

const Completion* Engine::progress(uint64_t id) const {
  for (const auto& s : running_)
    if (s->request.id == id) return &s->out;
  return nullptr;
}

bool Engine::cancel(uint64_t id) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it)
    if ((*it)->request.id == id) {
      waiting_.erase(it);  // holds no pages yet
      return true;
    }
  for (auto it = running_.begin(); it != running_.end(); ++it)
    if ((*it)->request.id == id) {
      release(**it);  // pages others share stay theirs
      running_.erase(it);
      return true;
    }
  return false;
}

std::vector<Completion> generate_without_cache(model::CausalLM& model, const std::vector<GenerationRequest>& requests,
                                               int64_t version) {
  torch::NoGradGuard no_grad;
  auto t0 = Clock::now();
  std::vector<Completion> out(requests.size());
  std::vector<std::vector<int64_t>> seqs;
  std::vector<bool> done(requests.size(), false);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    check_request(requests[i], model.vocab_size());
    seqs.push_back(requests[i].prompt);
    out[i].id = requests[i].id;
    out[i].prompt = requests[i].prompt;
  }
  model::ForwardOptions opts;
  opts.return_routed_experts = true;
  opts.return_topk_indices = true;
  auto device = model.lm_head_weight().device();
  for (;;) {
    std::vector<std::size_t> live;
    std::vector<std::vector<int64_t>> docs;
    for (std::size_t i = 0; i < requests.size(); ++i)
      if (!done[i]) {
        live.push_back(i);
        docs.push_back(seqs[i]);
      }
    if (live.empty()) return out;
    auto b = model::PackedBatch::from_documents(docs);
    b = model::PackedBatch{b.input_ids.to(device), b.position_ids.to(device), b.cu_seqlens};
    auto fwd = model.forward(b, opts);
    auto cu = b.cu_seqlens;
    for (std::size_t j = 0; j < live.size(); ++j) {
      const std::size_t i = live[j];
      const int64_t s = cu[int64_t(j)].item<int64_t>(), e = cu[int64_t(j) + 1].item<int64_t>();
      auto logits = model.fp32_logits(fwd.hidden.narrow(0, e - 1, 1));  // [1, V]
      record(out[i],
             sample_tokens(logits, {&requests[i].sampling}, {int64_t(out[i].tokens.size())}, true,
                           model.batch_invariant())[0],
             version);
      if (out[i].tokens.size() == 1) out[i].time_to_first_token_s = std::chrono::duration<double>(Clock::now() - t0).count();
      seqs[i].push_back(out[i].tokens.back());
      if (auto r = finish_reason(out[i].tokens, requests[i].sampling)) {
        out[i].finish_reason = *r;
        out[i].routed_experts = fwd.routed_experts.narrow(0, s, e - s).to(torch::kCPU);  // P + n - 1 rows
        if (fwd.topk_indices.defined()) out[i].topk_indices = fwd.topk_indices.narrow(0, s, e - s).to(torch::kCPU);
        done[i] = true;
      }
    }
  }
}

}  // namespace kiln::rollout
