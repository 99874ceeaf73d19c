#include "experiments/bench_messaging.hpp"
#include "messaging/stopwatch.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <zmq.hpp>

#include "messaging/gateway.hpp"

namespace kiln::experiments {

namespace {
using messaging::Envelope;
using messaging::Gateway;


struct Counter {
  std::mutex mu;
  std::condition_variable cv;
  std::size_t n = 0;
  void add() {
    std::lock_guard<std::mutex> l(mu);
    ++n;
    cv.notify_all();
  }
  void wait_for(std::size_t target) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return n >= target; });
  }
};

std::string ipc_path(int cell) { return "/tmp/kiln-bench-" + std::to_string(::getpid()) + "-" + std::to_string(cell); }

std::string endpoint_for(const std::string& transport, int cell) {
  if (transport == "inproc") return "inproc://kiln-bench-" + std::to_string(cell);
  if (transport == "ipc") return "ipc://" + ipc_path(cell);
  return "tcp://127.0.0.1:0";
}

// kiln: gateway A tells actor "sink" on gateway B; the clock stops when B's handler has
// decoded the last envelope.
double bench_kiln(const std::string& transport, int cell, const messaging::Tensor& t, std::size_t count) {
  Gateway b({"bench-b", endpoint_for(transport, cell)});
  Gateway a({"bench-a", ""});
  Counter got;
  b.serve("sink", [&](Envelope env) {
    if (env.tensors.size() == 1 && env.tensors[0].nbytes == t.nbytes) got.add();
  });
  a.add_route("sink", b.endpoint());
  auto send = [&](uint64_t seq) {
    auto env = messaging::make_envelope(messaging::BenchChunk{seq}, messaging::Kind::tell, "bench", "sink");
    env.tensors.push_back(t);
    a.tell(std::move(env));
  };
  send(0);  // warm-up: connection set up
  got.wait_for(1);
  const messaging::Stopwatch t0;
  for (std::size_t i = 0; i < count; ++i) send(i + 1);
  got.wait_for(count + 1);
  return double(t.nbytes) * count / t0.seconds() / 1e9;
}

// Raw ZeroMQ: the same DEALER -> ROUTER pattern, one zero-copy frame of the same bytes.
double bench_raw(const std::string& transport, int cell, const messaging::Tensor& t, std::size_t count) {
  static zmq::context_t ctx(2);
  zmq::socket_t router(ctx, zmq::socket_type::router), dealer(ctx, zmq::socket_type::dealer);
  for (auto* s : {&router, &dealer}) {
    s->set(zmq::sockopt::sndhwm, 0);
    s->set(zmq::sockopt::rcvhwm, 0);
    s->set(zmq::sockopt::linger, 0);
  }
  router.bind(endpoint_for(transport, 1000 + cell));
  dealer.connect(router.get(zmq::sockopt::last_endpoint));
  auto send = [&] {
    zmq::message_t m(const_cast<std::byte*>(t.data), t.nbytes, [](void*, void*) {}, nullptr);
    dealer.send(m, zmq::send_flags::none);
  };
  auto recv = [&] {
    zmq::message_t id, body;
    (void)router.recv(id);
    (void)router.recv(body);
  };
  send();
  recv();
  const messaging::Stopwatch t0;
  std::thread rx([&] {
    for (std::size_t i = 0; i < count; ++i) recv();
  });
  for (std::size_t i = 0; i < count; ++i) send();
  rx.join();
  return double(t.nbytes) * count / t0.seconds() / 1e9;
}

double bench_memcpy(const messaging::Tensor& t, std::size_t count) {
  auto dst = messaging::Tensor::zeros("dst", t.dtype, t.shape);
  const messaging::Stopwatch t0;
  for (std::size_t i = 0; i < count; ++i) {
    std::memcpy(dst.mutable_data(), t.data, t.nbytes);
    asm volatile("" ::"r"(dst.data) : "memory");  // keep the copy
  }
  return double(t.nbytes) * count / t0.seconds() / 1e9;
}
}  // namespace

int run_messaging_bench(const MessagingBenchOptions& options) {
  std::printf("kiln bench messaging: one-way throughput, best of %d, %.1f GiB per measurement\n",
              options.repeats, double(options.bytes_per_cell) / (1 << 30));
  std::printf("%-9s %9s %12s %14s %9s %13s\n", "transport", "size_MiB", "kiln_GB/s", "raw_zmq_GB/s", "kiln/raw",
              "memcpy_GB/s");
  int cell = 0;
  for (std::string transport : {"inproc", "ipc", "tcp"}) {
    for (auto mib : options.sizes_mib) {
      std::size_t bytes = mib << 20;
      auto t = messaging::Tensor::zeros("x", messaging::DType::bfloat16, {int64_t(bytes / 2)});
      for (std::size_t i = 0; i < bytes; i += 4096) t.mutable_data()[i] = std::byte(i >> 12);
      std::size_t count = std::clamp<std::size_t>(options.bytes_per_cell / bytes, 4, 256);
      double kiln = 0, raw = 0, mem = 0;
      for (int r = 0; r < options.repeats; ++r) {
        kiln = std::max(kiln, bench_kiln(transport, cell, t, count));
        raw = std::max(raw, bench_raw(transport, cell, t, count));
        if (transport == "ipc")  // socket files of this cell's two endpoints
          for (int c2 : {cell, 1000 + cell}) std::remove(ipc_path(c2).c_str());
        ++cell;
        mem = std::max(mem, bench_memcpy(t, count));
      }
      std::printf("%-9s %9zu %12.2f %14.2f %8.0f%% %13.2f\n", transport.c_str(), mib, kiln, raw, 100 * kiln / raw, mem);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace kiln::experiments
