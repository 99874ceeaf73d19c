#pragma once
// One scratch directory per test process, /tmp/kiln-tests-<pid>, removed when the process
// exits: every test file, checkpoint copy and ipc:// socket goes below it.
#include <ftw.h>
#include <unistd.h>

#include <cstdio>

#include <filesystem>
#include <string>

namespace kiln::test {

inline const std::filesystem::path& scratch_root() {
  struct Root {
    std::filesystem::path path = std::filesystem::temp_directory_path() / ("kiln-tests-" + std::to_string(::getpid()));
    Root() { std::filesystem::create_directories(path); }
    // POSIX nftw, not std::filesystem::remove_all: at exit that symbol may resolve to a copy
    // inside libtorch.so whose state is already torn down.
    ~Root() {
      ::nftw(
          path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
          FTW_DEPTH | FTW_PHYS);
    }
  };
  static Root root;
  return root.path;
}

/// A path below the scratch root (not created).
inline std::string scratch_path(const std::string& name) { return (scratch_root() / name).string(); }

/// "ipc://<scratch root>/<tag>".
inline std::string scratch_ipc(const std::string& tag) { return "ipc://" + scratch_path(tag); }

}  // namespace kiln::test
