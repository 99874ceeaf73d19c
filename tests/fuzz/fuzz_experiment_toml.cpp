// Fuzz harness: experiment files and --set assignments (experiments/experiment.cpp), through
// the public API only (from_file, set, validate, to_toml). The whole input is the TOML file;
// then each of its lines (up to 32) is applied as `--set LINE`, to the defaults if the file
// was refused. Properties: nothing crashes or throws anything but std::invalid_argument; what
// to_toml() writes (the run directory's config.toml) reads back to the same config.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "experiments/experiment.hpp"
#include "fuzz_util.hpp"

using kiln::experiments::ExperimentConfig;

namespace {
void check_round_trip(const ExperimentConfig& c) {
  try {
    c.validate();
  } catch (const std::invalid_argument&) {
  }
  const std::string text = c.to_toml();
  const std::string path = kiln::fuzz::write_scratch("written.toml", text.data(), text.size());
  // Outside any try: a config.toml kiln wrote must read back.
  auto back = ExperimentConfig::from_file(path);
  KILN_FUZZ_CHECK(back.to_toml() == text, "to_toml() reads back to the same config");
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = kiln::fuzz::write_scratch("fuzz.toml", data, size);
  ExperimentConfig c;  // the defaults, when the file is refused
  try {
    c = ExperimentConfig::from_file(path);
  } catch (const std::invalid_argument&) {
  }
  const std::string text(reinterpret_cast<const char*>(data), size);
  int lines = 0;
  for (std::size_t begin = 0; begin <= text.size() && lines < 32; ++lines) {
    std::size_t end = std::min(text.find('\n', begin), text.size());
    try {
      c.set(text.substr(begin, end - begin));
    } catch (const std::invalid_argument&) {
    }
    begin = end + 1;
  }
  check_round_trip(c);
  return 0;
}
