// at::Tensor <-> wire: every dtype (fp8 included), empty and non-contiguous tensors, and
// zero-copy in one process (the receiver's at::Tensor aliases the sender's storage).
#include <doctest/doctest.h>
#include <torch/torch.h>

#include "messaging/gateway.hpp"
#include "messaging/torch_tensor.hpp"

using namespace kiln::messaging;
using namespace std::chrono_literals;

namespace {
at::Tensor sample(c10::ScalarType type, at::IntArrayRef shape) {
  auto x = torch::randn(shape, torch::kFloat64) * 4;
  if (type == c10::ScalarType::Bool) return x > 0;
  return x.to(type);
}

// Through the codec and back, as the receiving side would see it.
at::Tensor round_trip(const at::Tensor& x) {
  auto env = make_envelope(DiagEcho{}, Kind::request, "a", "b");
  env.tensors.push_back(from_torch("x", x));
  std::string header = encode_header(env);
  std::vector<Frame> frames{{reinterpret_cast<const std::byte*>(header.data()), header.size(), nullptr},
                            {env.tensors[0].data, env.tensors[0].nbytes, env.tensors[0].owner}};
  auto r = decode(frames);
  REQUIRE(r.has_value());
  return to_torch(r->tensors.at(0));
}
}  // namespace

TEST_CASE("every torch dtype kiln sends round-trips bit-exactly") {
  for (auto type : {c10::ScalarType::Bool, c10::ScalarType::Byte, c10::ScalarType::Char, c10::ScalarType::Int,
                    c10::ScalarType::Long, c10::ScalarType::Half, c10::ScalarType::BFloat16, c10::ScalarType::Float,
                    c10::ScalarType::Double, c10::ScalarType::Float8_e4m3fn, c10::ScalarType::Float8_e5m2}) {
    CAPTURE(c10::toString(type));
    auto x = sample(type, {4, 3, 5});
    auto y = round_trip(x);
    CHECK((y.scalar_type() == type));
    CHECK((y.sizes() == x.sizes()));
    // Compare bits, so that NaN payloads and -0.0 count too.
    CHECK(std::memcmp(y.data_ptr(), x.data_ptr(), x.nbytes()) == 0);
  }
}

TEST_CASE("empty and scalar torch tensors round-trip") {
  auto e = round_trip(torch::empty({0, 5}, torch::kBFloat16));
  CHECK((e.sizes() == at::IntArrayRef({0, 5})));
  CHECK((e.scalar_type() == c10::ScalarType::BFloat16));
  auto s = round_trip(torch::tensor(3.5, torch::kFloat32));
  CHECK(s.dim() == 0);
  CHECK(s.item<float>() == 3.5f);
}

TEST_CASE("a non-contiguous tensor is sent contiguous with the same values") {
  auto base = torch::arange(24, torch::kFloat32).reshape({4, 6});
  auto t = base.t();  // [6, 4] view, strides (1, 6)
  REQUIRE_FALSE(t.is_contiguous());
  auto y = round_trip(t);
  CHECK(y.is_contiguous());
  CHECK((y.sizes() == t.sizes()));
  CHECK(torch::equal(y, t));
  auto sliced = base.index({torch::indexing::Slice(), torch::indexing::Slice(0, 6, 2)});  // [4, 3], stride 2
  CHECK(torch::equal(round_trip(sliced), sliced));
}

TEST_CASE("a contiguous tensor is wrapped without a copy, and the bytes outlive the sender's handle") {
  auto x = torch::randn({1024, 1024});
  auto w = from_torch("x", x);
  CHECK(w.data == static_cast<const std::byte*>(x.data_ptr()));
  auto expected = x.clone();
  x = at::Tensor();  // drop the sender's handle: the wire tensor keeps the storage alive
  auto y = to_torch(w);
  CHECK(torch::equal(y, expected));
}

TEST_CASE("inproc: the receiving actor's at::Tensor aliases the sender's storage") {
  Gateway b({"b", "inproc://torch-zero-copy"});
  Gateway a({"a", ""});
  std::promise<at::Tensor> got;
  b.serve("sink", [&](Envelope env) { got.set_value(to_torch(env.tensors.at(0))); });
  a.add_route("sink", b.endpoint());
  auto x = torch::randn({256, 256}, torch::kBFloat16);
  auto env = make_envelope(BenchChunk{0}, Kind::tell, "a", "sink");
  env.tensors.push_back(from_torch("x", x));
  a.tell(std::move(env));
  auto y = got.get_future().get();
  CHECK(y.data_ptr() == x.data_ptr());
  CHECK(torch::equal(y, x));
}

TEST_CASE("unsupported torch dtypes are refused by name") {
  CHECK_THROWS_WITH_AS(from_torch("c", torch::zeros({2}, torch::kComplexFloat)), doctest::Contains("ComplexFloat"),
                       std::invalid_argument);
}
