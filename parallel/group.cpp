#include "parallel/group.hpp"

#include <condition_variable>
#include <functional>
#include <numeric>

namespace kiln::parallel {

namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return c10d::ReduceOp::SUM;
    case ReduceOp::max: return c10d::ReduceOp::MAX;
    case ReduceOp::min: return c10d::ReduceOp::MIN;
  }
  throw std::invalid_argument("unknown ReduceOp " + std::to_string(static_cast<int>(op)));
}

std::string shape(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  return s + "]";
}

std::string list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

// The dims after dim 0, which must agree between the two tensors of a split/concat collective.
bool same_trailing(const torch::Tensor& a, const torch::Tensor& b) {
  return a.dim() == b.dim() && a.dim() >= 1 && a.sizes().slice(1) == b.sizes().slice(1);
}

}  // namespace

Group::Group(std::string name, std::vector<int> world_ranks, int rank, torch::Device device,
             c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout)
    : name_(std::move(name)), world_ranks_(std::move(world_ranks)), rank_(rank), device_(device),
      backend_(std::move(backend)), timeout_(timeout) {}

std::string Group::where() const {
  return "group '" + name_ + "' (rank " + std::to_string(rank_) + " of " + std::to_string(size()) + ", world rank " +
         std::to_string(world_ranks_[rank_]) + ")";
}

void Group::check_tensor(const torch::Tensor& t, const char* op, const char* arg) const {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(op) + " on " + where() + ": " + arg + " " + why);
  };
  if (!t.defined()) fail("is undefined");
  if (!t.is_contiguous()) fail(shape(t) + " is not contiguous");
  if (t.device() != device_) fail("is on " + t.device().str() + ", the group on " + device_.str());
}

void Group::ensure_usable(const char* op) const {
  if (!failed_.load()) return;
  std::lock_guard<std::mutex> l(why_mu_);
  throw CollectiveError(std::string(op) + " on " + where() + ": the group failed before (" + why_ +
                        "); its ranks no longer agree on what ran");
}

void Group::abort(const std::string& why) {
  std::shared_ptr<Waiter> waiting;
  {
    std::lock_guard<std::mutex> l(why_mu_);
    if (why_.empty()) why_ = "aborted: " + why;
    failed_ = true;
    waiting = waiting_;
  }
  if (waiting) {  // Gloo: the wait ends, leaving the collective to Gloo's worker thread
    std::lock_guard<std::mutex> l(waiting->mu);
    waiting->cv.notify_all();
  }
  if (device_.is_cuda()) {  // frees a wait on another thread (ProcessGroupNCCL::abort is for that)
    try {
      backend_->abort();
    } catch (...) {
    }
  }
}

bool Group::wait_abortable(const c10::intrusive_ptr<c10d::Work>& work) const {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const c10::Error&) {  // a work without a future: its own wait, which abort() cannot end
    return work->wait(timeout_);
  }
  auto waiter = std::make_shared<Waiter>();
  {
    std::lock_guard<std::mutex> l(why_mu_);
    waiting_ = waiter;
  }
  future->addCallback([waiter](c10::ivalue::Future&) {  // on Gloo's worker thread (or here, when done)
    {
      std::lock_guard<std::mutex> l(waiter->mu);
      waiter->done = true;
    }
    waiter->cv.notify_all();
  });
  bool done;
  {
    std::unique_lock<std::mutex> l(waiter->mu);
    done = waiter->cv.wait_for(l, timeout_, [&] { return waiter->done || failed_.load(); }) && waiter->done;
  }
  std::lock_guard<std::mutex> l(why_mu_);
  waiting_.reset();
  return done;
}

void Group::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op) const {
  const std::string what =
      std::string(op) + " on " + where() + " (timeout " + std::to_string(timeout_.count()) + " ms) failed: ";
  std::string failure;
  try {
    if (device_.is_cuda() || wait_abortable(work)) {  // done (Gloo): wait() returns or rethrows at once
      if (work->wait(timeout_)) return;
      failure = "not complete within the timeout";
    } else {
      failure = failed_.load() ? "left unfinished" : "not complete within the timeout";
    }
  } catch (const c10::Error& e) {
    failure = e.what_without_backtrace();  // c10d's message without the C++ stack of the throw site
  } catch (const std::exception& e) {
    failure = e.what();
  }
  {
    std::lock_guard<std::mutex> l(why_mu_);
    if (why_.empty()) why_ = what + failure;
    else if (why_.rfind("aborted: ", 0) == 0) failure += " (" + why_ + ")";
  }
  failed_ = true;
  // NCCL: a collective whose peer is gone never ends; aborting the communicators frees its
  // kernels, so that this process can report and exit instead of hanging in the teardown until
  // ProcessGroupNCCL's watchdog kills it (SIGABRT). The group is unusable either way.
  if (device_.is_cuda()) {
    try {
      backend_->abort();
    } catch (...) {
    }
  }
  throw CollectiveError(what + failure);
}

void Group::all_reduce(torch::Tensor& tensor, ReduceOp op) {
  check_tensor(tensor, "all_reduce", "tensor");
  std::vector<torch::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  opts.timeout = backend_timeout();
  wait(started("all_reduce", [&] { return backend_->allreduce(tensors, opts); }), "all_reduce");
}

void Group::reduce_scatter(torch::Tensor& output, const torch::Tensor& input) {
  wait(start_reduce_scatter(output, input), "reduce_scatter");
}

c10::intrusive_ptr<c10d::Work> Group::start_reduce_scatter(torch::Tensor& output, const torch::Tensor& input) {
  check_tensor(output, "reduce_scatter", "output");
  check_tensor(input, "reduce_scatter", "input");
  if (input.scalar_type() != output.scalar_type() || !same_trailing(input, output) ||
      input.size(0) != output.size(0) * size())
    throw std::invalid_argument("reduce_scatter on " + where() + ": input " + shape(input) + " " +
                                c10::toString(input.scalar_type()) + " must be [" + std::to_string(size()) +
                                "*N, ...] of output " + shape(output) + " " + c10::toString(output.scalar_type()));
  auto in = input;  // c10d takes a non-const reference; it does not write the input
  c10d::ReduceScatterOptions opts;
  opts.timeout = backend_timeout();
  return started("reduce_scatter", [&] { return backend_->_reduce_scatter_base(output, in, opts); });
}

void Group::all_gather_into_tensor(torch::Tensor& output, const torch::Tensor& input) {
  wait(start_all_gather_into_tensor(output, input), "all_gather_into_tensor");
}

c10::intrusive_ptr<c10d::Work> Group::start_all_gather_into_tensor(torch::Tensor& output, const torch::Tensor& input) {
  check_tensor(output, "all_gather_into_tensor", "output");
  check_tensor(input, "all_gather_into_tensor", "input");
  if (input.scalar_type() != output.scalar_type() || !same_trailing(input, output) ||
      output.size(0) != input.size(0) * size())
    throw std::invalid_argument("all_gather_into_tensor on " + where() + ": output " + shape(output) + " " +
                                c10::toString(output.scalar_type()) + " must be [" + std::to_string(size()) +
                                "*N, ...] of input " + shape(input) + " " + c10::toString(input.scalar_type()));
  auto in = input;
  c10d::AllgatherOptions opts;
  opts.timeout = backend_timeout();
  return started("all_gather_into_tensor", [&] { return backend_->_allgather_base(output, in, opts); });
}

void Group::all_to_all(torch::Tensor& output, const torch::Tensor& input, const std::vector<int64_t>& output_rows,
                       const std::vector<int64_t>& input_rows) {
  check_tensor(output, "all_to_all", "output");
  check_tensor(input, "all_to_all", "input");
  const auto bad = [&](const std::string& why) {
    throw std::invalid_argument("all_to_all on " + where() + ": " + why);
  };
  if (input.scalar_type() != output.scalar_type())
    bad(std::string("input dtype ") + c10::toString(input.scalar_type()) + " differs from output dtype " +
        c10::toString(output.scalar_type()));
  if (!same_trailing(input, output)) bad("input " + shape(input) + " and output " + shape(output) + " differ after dim 0");
  for (const auto* rows : {&output_rows, &input_rows}) {
    const char* name = rows == &output_rows ? "output_rows" : "input_rows";
    if (static_cast<int>(rows->size()) != size())
      bad(std::string(name) + " " + list(*rows) + " has " + std::to_string(rows->size()) + " entries, not " +
          std::to_string(size()));
    for (auto r : *rows)
      if (r < 0) bad(std::string(name) + " " + list(*rows) + " has a negative count");
  }
  if (std::accumulate(input_rows.begin(), input_rows.end(), int64_t{0}) != input.size(0))
    bad("input_rows " + list(input_rows) + " do not sum to input's " + std::to_string(input.size(0)) + " rows");
  if (std::accumulate(output_rows.begin(), output_rows.end(), int64_t{0}) != output.size(0))
    bad("output_rows " + list(output_rows) + " do not sum to output's " + std::to_string(output.size(0)) + " rows");
  auto in = input;
  auto out_rows = output_rows, in_rows = input_rows;  // c10d takes non-const references
  c10d::AllToAllOptions opts;
  opts.timeout = backend_timeout();
  wait(started("all_to_all", [&] { return backend_->alltoall_base(output, in, out_rows, in_rows, opts); }), "all_to_all");
}

void Group::broadcast(torch::Tensor& tensor, int root) { wait(start_broadcast(tensor, root), "broadcast"); }

c10::intrusive_ptr<c10d::Work> Group::start_broadcast(torch::Tensor& tensor, int root) {
  check_tensor(tensor, "broadcast", "tensor");
  if (root < 0 || root >= size())
    throw std::invalid_argument("broadcast on " + where() + ": root " + std::to_string(root) + " is not a rank of it");
  std::vector<torch::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = backend_timeout();
  return started("broadcast", [&] { return backend_->broadcast(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> Group::started(const char* op,
                                              const std::function<c10::intrusive_ptr<c10d::Work>()>& start) const {
  ensure_usable(op);
  try {
    return start();
  } catch (const c10::Error& e) {
    throw CollectiveError(std::string(op) + " on " + where() + " failed to start: " + e.what_without_backtrace());
  }
}

void Group::barrier() {
  c10d::BarrierOptions opts;
  opts.timeout = backend_timeout();
  if (device_.is_cuda()) opts.device_ids = {device_.index()};
  wait(started("barrier", [&] { return backend_->barrier(opts); }), "barrier");
}

}  // namespace kiln::parallel
