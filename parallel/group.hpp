#pragma once
// One process group (c10d backend: ProcessGroupNCCL on CUDA, ProcessGroupGloo on CPU) and the
// collectives the trainer calls on it. Every call blocks the calling thread until the
// collective completed on this rank, within the group's timeout (ProcessGroupNCCL waits on the
// host when given a timeout, polling every 1 ms; the current stream also waits for it). The
// start_* calls return at once instead, so that a pipeline can queue the next collective (and
// the work around it) before it waits for the previous one.
//
// Shapes: dim 0 is the one collectives split or concatenate; `...` are trailing dims that must
// agree between input and output. W = the group's size.
// Dtypes: any c10d supports (tested: float32, int64); input and output dtypes must be equal.
// Tensors must be contiguous and on the group's device.
// Errors: bad arguments (shape, dtype, device, counts, root) -> std::invalid_argument naming
// the group and the values. A failed or timed-out collective (a lost peer, a closed
// connection) -> CollectiveError naming the operation, the group, this rank, the timeout and c10d's message
// (which names the peer's address where Gloo reports it).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace kiln::parallel {

/// A collective failed or timed out: the group can no longer be used (on CUDA its NCCL
/// communicators are aborted before this is thrown).
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The reductions every backend supports.
enum class ReduceOp { sum, max, min };

/// A process group over `world_ranks` (this rank is world_ranks[rank()]).
class Group {
 public:
  /// `timeout` bounds every collective's wait (milliseconds).
  Group(std::string name, std::vector<int> world_ranks, int rank, torch::Device device,
        c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout);

  /// "world", or a mesh dimension and its world ranks: "ep[2,3]".
  const std::string& name() const { return name_; }
  /// This process's rank in the group, 0 <= rank() < size().
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(world_ranks_.size()); }
  /// The world rank of every group rank.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  torch::Device device() const { return device_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  /// In place: `tensor` [...] becomes the elementwise `op` over every rank's `tensor`.
  void all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::sum);

  /// `input` [W*N, ...] is reduced (sum) over ranks; rank r receives rows [r*N, (r+1)*N) in
  /// `output` [N, ...].
  void reduce_scatter(torch::Tensor& output, const torch::Tensor& input);

  /// `output` [W*N, ...] receives every rank's `input` [N, ...], rank r at rows [r*N, (r+1)*N).
  void all_gather_into_tensor(torch::Tensor& output, const torch::Tensor& input);

  /// Variable-count all-to-all along dim 0: this rank sends rows [off_p, off_p+input_rows[p])
  /// of `input` [sum(input_rows), ...] to rank p and receives `output_rows[p]` rows from rank
  /// p into `output` [sum(output_rows), ...], in rank order. Counts may be zero (a rank may
  /// send or receive nothing); output_rows[p] must equal what p sends here (not checkable
  /// locally: a mismatch is c10d's error or a hang until the timeout).
  void all_to_all(torch::Tensor& output, const torch::Tensor& input, const std::vector<int64_t>& output_rows,
                  const std::vector<int64_t>& input_rows);

  /// In place: every rank's `tensor` [...] becomes group rank `root`'s.
  void broadcast(torch::Tensor& tensor, int root);

  /// Starts broadcast(tensor, root) and returns without waiting: the collective runs in the
  /// backend (NCCL: on its stream, after the work queued on the current stream so far). Neither
  /// read, write nor free `tensor` before finish() returned for the result. Same arguments and
  /// errors as broadcast() (bad arguments are thrown here, failures by finish()).
  c10::intrusive_ptr<c10d::Work> start_broadcast(torch::Tensor& tensor, int root);
  /// Starts reduce_scatter(output, input), as start_broadcast does: touch neither tensor before
  /// finish() returned for the result.
  c10::intrusive_ptr<c10d::Work> start_reduce_scatter(torch::Tensor& output, const torch::Tensor& input);
  /// Starts all_gather_into_tensor(output, input), as start_broadcast does.
  c10::intrusive_ptr<c10d::Work> start_all_gather_into_tensor(torch::Tensor& output, const torch::Tensor& input);
  /// Waits for a started collective `op` ("broadcast", ...) as the blocking calls do: returns
  /// once it completed on this rank; throws CollectiveError when it failed or the group's
  /// timeout passed.
  void finish(const c10::intrusive_ptr<c10d::Work>& work, const char* op) const { wait(work, op); }

  /// Returns once every rank of the group reached it.
  void barrier();

  /// True once a collective of this group failed or abort() was called: the group cannot be
  /// used again (its ranks disagree on what ran), and every later collective throws.
  bool failed() const { return failed_.load(); }
  /// Marks the group failed and frees a collective waiting in it on another thread: NCCL's
  /// communicators are aborted, so that the wait throws CollectiveError at once. Gloo: c10d
  /// cannot interrupt a running Gloo collective; it ends when a peer's connection closes (a
  /// process that exits) or at the timeout. Every later collective throws CollectiveError
  /// naming `why`. Callable from any thread, more than once (the first reason is kept).
  void abort(const std::string& why);

 private:
  void check_tensor(const torch::Tensor& t, const char* op, const char* arg) const;
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op) const;
  /// Gloo: waits for `work`'s future up to the timeout or until abort(); true when it completed
  /// (its result or error is then work->wait()'s). An unfinished collective stays with Gloo's
  /// worker thread, which holds its tensors.
  bool wait_abortable(const c10::intrusive_ptr<c10d::Work>& work) const;
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  /// start(), its c10::Error (a backend that refuses to queue) as a CollectiveError naming `op`;
  /// CollectiveError without starting when the group failed before (ensure_usable).
  c10::intrusive_ptr<c10d::Work> started(const char* op,
                                         const std::function<c10::intrusive_ptr<c10d::Work>()>& start) const;
  std::string where() const;
  /// Throws CollectiveError naming `op` and the reason when the group failed before.
  void ensure_usable(const char* op) const;
  /// The timeout given to the backend with each collective: twice the group's, so that the
  /// wait above fails first, with an error naming the group (ProcessGroupNCCL's watchdog aborts
  /// the process when a collective outlives the backend's timeout).
  std::chrono::milliseconds backend_timeout() const { return 2 * timeout_; }

  std::string name_;
  std::vector<int> world_ranks_;
  int rank_;
  torch::Device device_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::chrono::milliseconds timeout_;
  mutable std::atomic<bool> failed_{false};
  mutable std::mutex why_mu_;
  mutable std::string why_;  ///< why the group failed (the first failure or abort)
  mutable std::shared_ptr<Waiter> waiting_;  ///< the Gloo wait in progress (why_mu_), for abort()
};

}  // namespace kiln::parallel
