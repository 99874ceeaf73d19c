// Fuzz harness: model.safetensors.index.json of a sharded checkpoint (model/checkpoint), the
// whole input as the index, in a directory that holds two valid shards (tensors a, b in
// model-00001-of-00002.safetensors, c in model-00002-of-00002.safetensors). Properties: open
// and get never crash and throw nothing but CheckpointError; no file outside the directory
// is opened; a tensor it returns is the shard's.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "fuzz_util.hpp"
#include "model/checkpoint/safetensors.hpp"

using namespace kiln::checkpoint;

namespace {
Tensor filled(const std::string& name, DType dt, std::vector<int64_t> shape) {
  auto t = Tensor::zeros(name, dt, std::move(shape));
  for (std::size_t i = 0; i < t.nbytes; ++i) t.mutable_data()[i] = std::byte(uint8_t(i * 7 + name[0]));
  return t;
}

const std::string& checkpoint_dir() {
  static const std::string dir = [] {
    const std::string d = kiln::fuzz::scratch_dir();
    write_safetensors(d + "/model-00001-of-00002.safetensors",
                      {filled("a", DType::float32, {2, 3}), filled("b", DType::bfloat16, {4})});
    write_safetensors(d + "/model-00002-of-00002.safetensors", {filled("c", DType::int64, {2})});
    return d;
  }();
  return dir;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = checkpoint_dir();
  kiln::fuzz::write_scratch("model.safetensors.index.json", data, size);
  try {
    auto c = Checkpoint::open(dir);
    for (const auto& name : c.names()) {
      try {
        auto t = c.get(name);
        auto expected = filled(name, t.dtype, t.shape);
        KILN_FUZZ_CHECK(name.size() == 1 && t.nbytes == expected.nbytes &&
                            std::memcmp(t.data, expected.data, t.nbytes) == 0,
                        "a tensor read through the index is the shard's tensor of that name");
      } catch (const CheckpointError&) {
      }
    }
  } catch (const CheckpointError&) {
  }
  return 0;
}
