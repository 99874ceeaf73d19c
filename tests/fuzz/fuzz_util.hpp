#pragma once
// Shared by the fuzz harnesses (tests/fuzz/fuzz_*.cpp): scratch files for the readers that
// take a path, and the check that turns a broken property into a crash that libFuzzer (or
// the replay test) reports.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

/// A property every accepted input must have (a bug in kiln if not): prints and aborts.
#define KILN_FUZZ_CHECK(cond, what)                                                           \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "fuzz property failed: %s (%s:%d)\n", what, __FILE__, __LINE__); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

namespace kiln::fuzz {

/// A directory of this process's own under $TMPDIR (or /tmp), made on first use and removed
/// with its files at exit.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/kiln-fuzz-XXXXXX";
    if (!::mkdtemp(templ.data())) throw std::runtime_error("kiln fuzz: cannot make a scratch directory " + templ);
    static std::string removed_at_exit = templ;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(removed_at_exit, ec);
    });
    return templ;
  }();
  return dir;
}

/// Writes `size` bytes to scratch_dir()/name, replacing it; returns the path.
inline std::string write_scratch(const std::string& name, const void* data, std::size_t size) {
  std::string path = scratch_dir() + "/" + name;
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error("kiln fuzz: cannot write " + path);
  const char* p = static_cast<const char*>(data);
  for (std::size_t left = size; left > 0;) {
    ssize_t n = ::write(fd, p, left);
    if (n <= 0) {
      ::close(fd);
      throw std::runtime_error("kiln fuzz: short write to " + path);
    }
    p += n;
    left -= std::size_t(n);
  }
  ::close(fd);
  return path;
}

}  // namespace kiln::fuzz
