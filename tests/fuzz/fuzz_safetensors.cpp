// Fuzz harness: one safetensors file (model/checkpoint/safetensors.cpp), the whole input as
// the file. Properties: open never crashes and throws nothing but CheckpointError; every
// tensor of a file it accepts lies inside the file, and together they cover its data section
// exactly.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.hpp"
#include "model/checkpoint/safetensors.hpp"

using namespace kiln::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = kiln::fuzz::write_scratch("fuzz.safetensors", data, size);
  try {
    auto f = SafetensorsFile::open(path);
    uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = (header << 8) | data[i];
    uint64_t covered = 0;
    for (const auto& [name, info] : f.tensors()) {
      auto t = f.get(name);
      volatile std::byte sink{};
      for (std::size_t i = 0; i < t.nbytes; ++i) sink = t.data[i];
      (void)sink;
      covered += t.nbytes;
    }
    KILN_FUZZ_CHECK(covered == size - 8 - header, "an accepted file's tensors cover its data section exactly");
  } catch (const CheckpointError&) {
  }
  return 0;
}
