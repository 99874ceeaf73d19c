#include "actors/controller/run_dir.hpp"

#include "actors/trainer/checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace kiln::controller {

namespace fs = std::filesystem;

namespace {
// An aside of a replaced run's checkpoints (set_aside_checkpoints): "checkpoints.replaced" or
// "checkpoints.replaced.N", a directory or a symbolic link (not followed).
bool is_replaced_checkpoints(const fs::path& p) {
  const auto name = p.filename().string();
  const std::string base = "checkpoints.replaced";
  const bool named = name == base || (name.size() > base.size() + 1 && name.compare(0, base.size() + 1, base + ".") == 0 &&
                                      name.find_first_not_of("0123456789", base.size() + 1) == std::string::npos);
  std::error_code ec;
  const auto st = fs::symlink_status(p, ec);
  return named && !ec && (fs::is_directory(st) || fs::is_symlink(st));
}

// RUN's asides (is_replaced_checkpoints), sorted.
std::vector<fs::path> replaced_checkpoints(const fs::path& run) {
  std::error_code ec;
  std::vector<fs::path> asides;
  for (const auto& e : fs::directory_iterator(run, ec))
    if (is_replaced_checkpoints(e.path())) asides.push_back(e.path());
  std::sort(asides.begin(), asides.end());
  return asides;
}

// PATH + suffix, or PATH + suffix + ".2", ".3", ...: the first name nothing (not even a
// dangling link) holds.
fs::path first_free_name(const fs::path& path, const std::string& suffix) {
  std::error_code ec;
  auto to = fs::path(path.string() + suffix);
  for (int i = 2; fs::exists(fs::symlink_status(to, ec)); ++i) to = fs::path(path.string() + suffix + "." + std::to_string(i));
  return to;
}
}  // namespace

bool lies_within(const fs::path& inner, const fs::path& outer) {
  std::error_code ec;
  const auto i = fs::weakly_canonical(fs::absolute(inner, ec), ec), o = fs::weakly_canonical(fs::absolute(outer, ec), ec);
  return !ec && std::mismatch(o.begin(), o.end(), i.begin(), i.end()).first == o.end();
}

void replace_file(const fs::path& file, const std::string& text) {
  auto tmp = file;
  tmp += ".tmp";
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) {
      out.close();
      fs::remove(tmp, ec);
      throw std::runtime_error("writing '" + tmp.string() + "' failed (disk full, or a file-size limit?); '" +
                               file.string() + "' is left as it was");
    }
  }
  fs::rename(tmp, file, ec);
  if (ec) {
    const auto why = ec.message();
    fs::remove(tmp, ec);
    throw std::runtime_error("cannot replace '" + file.string() + "': " + why);
  }
}

fs::path without_trailing_separator(const fs::path& path) {
  auto p = path.lexically_normal();
  if (!p.has_filename() && p.has_relative_path()) p = p.parent_path();
  return p;
}

std::string inside_kiln_checkpoint(const fs::path& path) {
  std::error_code ec;
  const auto full = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec) return {};
  for (auto p = full; !p.empty(); p = p.parent_path()) {  // the path and every ancestor
    if (fs::is_regular_file(p / "state.json", ec) && fs::is_regular_file(p / "config.json", ec))  // a kiln checkpoint
      return "lies inside the checkpoint '" + p.string() + "' (state.json, config.json)";
    if (p.filename() == "checkpoints" && fs::exists(p.parent_path() / "metrics.jsonl", ec))
      return "lies in '" + p.string() + "', the checkpoints directory of the run in '" + p.parent_path().string() + "'";
    if (p == p.root_path()) break;
  }
  return {};
}

std::string dangling_link(const fs::path& path) {
  std::error_code ec;
  const auto p = without_trailing_separator(path);
  if (fs::symlink_status(p, ec).type() != fs::file_type::symlink || fs::exists(p, ec)) return {};
  return "is a symbolic link ('" + p.string() + "' -> '" + fs::read_symlink(p, ec).string() + "') that leads to nothing";
}

void check_run_dir(const fs::path& dir, const std::string& resume_from, bool overwrite,
                   const std::string& model_checkpoint) {
  std::error_code ec;
  const std::string where = "run.output_dir '" + dir.string() + "'";
  if (const auto why = dangling_link(dir); !why.empty())
    throw std::invalid_argument(where + " " + why + ": give a directory, or a path where one can be made");
  const auto full = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  if (!ec && full == full.root_path())
    throw std::invalid_argument(where + " is the filesystem root: give a directory of its own for the run's files");
  if (const auto why = inside_kiln_checkpoint(dir); !why.empty())
    throw std::invalid_argument(where + " " + why + ": the run's files would change it; give a directory outside");
  if (fs::exists(dir / "checkpoints", ec) && !fs::is_directory(dir / "checkpoints", ec))
    throw std::invalid_argument(where + ": '" + (dir / "checkpoints").string() +
                                "' is not a directory, so no checkpoint could be written there");
  if (fs::exists(dir / "config.toml", ec) && !fs::is_regular_file(dir / "config.toml", ec))
    throw std::invalid_argument(where + ": '" + (dir / "config.toml").string() +
                                "' is not a file, so the run's settings could not be written there");
  if (overwrite && resume_from.empty() && !model_checkpoint.empty()) {
    // What the overwrite deletes (delete_replaced_checkpoints): RUN/checkpoints and the asides
    // of earlier overwrites killed in their delete.
    std::vector<fs::path> deleted = replaced_checkpoints(dir);
    deleted.insert(deleted.begin(), dir / "checkpoints");
    for (const auto& d : deleted)
      if (lies_within(model_checkpoint, d))
        throw std::invalid_argument("model.checkpoint '" + model_checkpoint + "' lies in '" + d.string() +
                                    "', which run.overwrite deletes: copy it elsewhere first, or choose another "
                                    "run.output_dir");
  }
}

std::vector<std::string> changed_settings(const std::string& before_toml, const std::string& after_toml,
                                          const std::vector<std::string>& ignored) {
  auto settings = [](const std::string& text) {
    std::map<std::string, std::string> out;
    std::istringstream in(text);
    std::string section;
    for (std::string line; std::getline(in, line);) {
      if (line.size() > 2 && line.front() == '[' && line.back() == ']') section = line.substr(1, line.size() - 2) + ".";
      else if (const auto eq = line.find(" = "); eq != std::string::npos) out[section + line.substr(0, eq)] = line.substr(eq + 3);
    }
    return out;
  };
  const auto a = settings(before_toml), b = settings(after_toml);
  std::set<std::string> keys;
  for (const auto* m : {&a, &b})
    for (const auto& [k, v] : *m) keys.insert(k);
  std::vector<std::string> changed;
  for (const auto& k : keys) {
    if (std::find(ignored.begin(), ignored.end(), k) != ignored.end()) continue;
    const auto x = a.find(k), y = b.find(k);
    const std::string old_value = x == a.end() ? "(none)" : x->second, new_value = y == b.end() ? "(none)" : y->second;
    if (old_value != new_value) changed.push_back(k + ": " + old_value + " -> " + new_value);
  }
  return changed;
}

std::string node_pid_file(const std::string& node, int64_t index) {
  return index == 0 ? node + "_node.pid" : node + "_node_" + std::to_string(index) + ".pid";
}

namespace {
// What a run leaves in its directory before its first step: the lock and its nodes' pid files
// (node_pid_file: "*_node.pid", "*_node_<i>.pid").
bool left_by_start_up(const std::string& name) {
  return name == ".lock" || (name.size() > 4 && name.compare(name.size() - 4, 4, ".pid") == 0 &&
                             name.find("_node") != std::string::npos);
}

// For the signal handler below (async-signal-safe: fixed buffers, unlink and rmdir only): the
// directories a RunLock made, innermost first, and the start-up files that may be in the first.
constexpr int kMaxCreated = 64, kMaxStartupFiles = 200, kPathBytes = 4096;  // PATH_MAX
char g_created[kMaxCreated][kPathBytes];
volatile std::sig_atomic_t g_created_count = 0;
char g_startup_files[kMaxStartupFiles][kPathBytes];
volatile std::sig_atomic_t g_startup_file_count = 0;
volatile std::sig_atomic_t g_engines = 1;  // RunSignals': the rollout_node_<i>.pid names

void forget_created_dirs() { g_created_count = 0; }

void remember_created_dirs(const fs::path& dir, const std::vector<fs::path>& parents) {
  g_created_count = 0;
  int files = 0;
  auto put = [](char* out, const fs::path& path) {
    return path.native().size() < std::size_t(kPathBytes) && std::snprintf(out, kPathBytes, "%s", path.c_str()) > 0;
  };
  // With the files written between the start's last step and step 1 (config.toml, the metrics
  // files): in a directory this run made they are its own.
  std::vector<std::string> names = {".lock", node_pid_file("trainer"), node_pid_file("ref"), "config.toml",
                                    "metrics.jsonl", "metrics.tsv"};
  for (int i = 0; i < g_engines; ++i) names.push_back(node_pid_file("rollout", i));
  for (const auto& name : names)
    for (const char* suffix : {"", ".tmp"})
      if (files < kMaxStartupFiles && put(g_startup_files[files], dir / (name + suffix))) ++files;
  g_startup_file_count = files;
  int n = 0;
  if (put(g_created[n], dir)) ++n;
  for (const auto& p : parents) {  // up to the first that does not fit
    if (n == 0 || n >= kMaxCreated || !put(g_created[n], p)) break;
    ++n;
  }
  g_created_count = n;
}
}  // namespace

RunLock::RunLock(const fs::path& dir, const std::string& resume_from, bool overwrite) {
  std::error_code ec;
  // The directories this lock makes: the run directory and the missing ones above it, by the
  // physical paths the kernel made them at (a symbolic link in the path resolved). A path with a
  // "." or ".." component is not followed ("x/../run" makes x, and "link/.." is not link's
  // parent): nothing is removed for it.
  std::vector<fs::path> missing;  // outermost first; the run directory last
  bool plain = true;
  {
    fs::path prefix;
    for (const auto& part : fs::absolute(dir, ec)) {
      if (part.empty()) continue;  // the trailing "" of "a/b/"
      if (part == "." || part == "..") plain = false;
      prefix /= part;
      if (!fs::exists(prefix, ec)) missing.push_back(prefix);
    }
  }
  fs::create_directories(dir, ec);
  if (ec) {
    const auto why = ec.message();
    if (plain)  // the parents it did make, innermost first, each only if empty
      for (auto m = missing.rbegin(); m != missing.rend(); ++m) {
        if (!fs::exists(*m, ec)) continue;  // not made (where it failed)
        if (!fs::remove(*m, ec)) break;
      }
    throw std::runtime_error("cannot create the run directory '" + dir.string() + "': " + why);
  }
  if (plain && !missing.empty()) {
    created_ = fs::canonical(dir, ec);
    if (ec) created_.clear();
    for (std::size_t i = missing.size() - 1; !created_.empty() && i-- > 0;) {
      auto physical = fs::canonical(missing[i], ec);
      if (ec) break;
      created_parents_.push_back(std::move(physical));  // innermost first
    }
  }
  const auto lock = dir / ".lock";
  fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error("cannot open '" + lock.string() + "': " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    std::string holder;
    std::ifstream(lock) >> holder;
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error("the run directory '" + dir.string() + "' is in use by another kiln run (pid " +
                             (holder.empty() ? std::string("unknown") : holder) +
                             "): wait for it, stop it, or choose another run.output_dir");
  }
  int64_t rows = 0;
  std::ifstream metrics(dir / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) rows += !line.empty();
  // Resuming continues this directory's run only from one of its own checkpoints.
  const bool own = !resume_from.empty() &&
                   fs::weakly_canonical(fs::path(resume_from), ec).parent_path() == fs::weakly_canonical(dir / "checkpoints", ec);
  if (rows > 0 && !own && !overwrite) {
    ::close(fd_);
    fd_ = -1;
    const auto newest = newest_checkpoint(dir);
    throw std::runtime_error("the run directory '" + dir.string() + "' already holds a run (" + std::to_string(rows) +
                             " rows in metrics.jsonl" + (resume_from.empty() ? "" : "; '" + resume_from + "' is not one of its checkpoints") +
                             "): choose another run.output_dir, " +
                             (newest.empty() ? std::string("")
                                             : "resume it with --set run.resume_from=" + shell_word(newest.string()) + " (it goes on " +
                                                   "from that checkpoint's step up to run.steps, so a finished run needs a " +
                                                   "larger run.steps), ") +
                             "or replace it with --set run.overwrite=true");
  }
  // Ours now: the pid for whoever is refused next (a refused run leaves the file as it was).
  const auto pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::write(fd_, pid.data(), pid.size()) != ssize_t(pid.size())) {
    // the lock holds all the same; the pid only helps whoever is refused
  }
  if (!created_.empty()) remember_created_dirs(created_, created_parents_);  // a signal before step 1
}

RunLock::~RunLock() {
  forget_created_dirs();  // the signal handler's copy: this destructor decides now
  std::error_code ec;
  // Ours, and nothing in it but the lock, the pids of the nodes the run started and the weights
  // written for HTTP rollout servers (a run refused at start-up, or that failed before its first
  // step was logged): gone again, with the parents it made.
  if (fd_ >= 0 && !created_.empty()) {
    bool nothing_else = true;
    std::vector<fs::path> start_up;
    for (const auto& e : fs::directory_iterator(created_, ec)) {
      const auto name = e.path().filename().string();
      if (left_by_start_up(name) && e.is_regular_file(ec)) start_up.push_back(e.path());
      else if (name == kRolloutWeightsDir && !e.is_symlink(ec) && e.is_directory(ec)) start_up.push_back(e.path());
      else nothing_else = false;
    }
    if (!ec && nothing_else) {
      for (const auto& f : start_up)
        if (f.filename() != ".lock") fs::remove_all(f, ec);
      fs::remove(created_ / ".lock", ec);  // last, while the flock is held
    } else {
      created_.clear();
    }
  }
  if (fd_ >= 0) ::close(fd_);  // releases the flock
  if (created_.empty()) return;
  // Each only if empty (another run may have begun there since), innermost first.
  if (!fs::remove(created_, ec)) return;
  for (const auto& d : created_parents_)
    if (!fs::remove(d, ec)) break;
}

fs::path checkpoint_dir(const fs::path& run, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%06lld", (long long)step);
  return run / "checkpoints" / name;
}

fs::path newest_checkpoint(const fs::path& run) { return trainer::newest_checkpoint_in(run / "checkpoints"); }

std::vector<fs::path> supersede_checkpoints(const fs::path& run, int64_t first_step) {
  std::vector<fs::path> found, moved;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run / "checkpoints", ec)) {
    const auto step = trainer::checkpoint_name_step(e.path().filename().string());
    if (step && *step >= first_step && e.is_directory(ec)) found.push_back(e.path());
  }
  std::sort(found.begin(), found.end());
  for (const auto& ck : found) {
    const auto to = first_free_name(ck, ".superseded");
    fs::rename(ck, to, ec);
    if (ec) throw std::runtime_error("cannot set aside the checkpoint '" + ck.string() + "' of a step the resume trains again: " + ec.message());
    moved.push_back(to);
  }
  return moved;
}

fs::path set_aside_checkpoints(const fs::path& run) {
  std::error_code ec;
  const fs::path live = run / "checkpoints";
  if (!fs::exists(fs::symlink_status(live, ec))) return {};
  const auto aside = first_free_name(live, ".replaced");
  fs::rename(live, aside, ec);
  if (ec) throw std::runtime_error("cannot set aside '" + live.string() + "', the checkpoints of the run this one replaces: " + ec.message());
  // An empty one in its place: this run's, and a run directory given through it ("RUN/checkpoints/..") still resolves.
  fs::create_directory(live, ec);
  if (ec) {
    const auto why = ec.message();
    fs::rename(aside, live, ec);
    throw std::runtime_error("cannot make '" + live.string() + "' anew after setting the replaced run's checkpoints aside: " + why +
                             (ec ? " (they stay in '" + aside.string() + "')" : ""));
  }
  return aside;
}

bool put_back_checkpoints(const fs::path& run, const fs::path& aside) {
  std::error_code ec;
  fs::remove(run / "checkpoints", ec);  // the empty one set_aside_checkpoints made
  if (ec) return false;
  fs::rename(aside, run / "checkpoints", ec);
  return !ec;
}

std::vector<std::string> delete_replaced_checkpoints(const fs::path& run, const fs::path& aside) {
  std::error_code ec;
  std::vector<std::string> lines;
  for (const auto& a : replaced_checkpoints(run)) {
    fs::remove_all(a, ec);
    if (ec)
      lines.push_back("could not delete '" + a.string() + "', the checkpoints of a replaced run (" + ec.message() +
                      "): delete it by hand");
    else if (a != aside)
      lines.push_back("deleted '" + a.string() + "', the checkpoints an earlier overwrite left when it was stopped");
  }
  return lines;
}

std::string shell_word(const std::string& word) {
  const bool plain = !word.empty() && word.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                             "0123456789_./:=@%+,-") == std::string::npos;
  if (plain) return word;
  std::string q = "'";
  for (char ch : word) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

std::string as_argument(const fs::path& path) {
  const auto text = path.string();
  return !text.empty() && text[0] == '-' ? "./" + text : text;
}

std::string continue_hint(const fs::path& run, const fs::path& last_checkpoint) {
  std::error_code ec;
  const auto newest = !last_checkpoint.empty() && fs::exists(last_checkpoint / "state.json", ec) ? last_checkpoint
                                                                                                 : newest_checkpoint(run);
  if (newest.empty())
    return "kiln run: this run has no checkpoint (none due yet, run.checkpoint_every = 0, or its save was refused "
           "above): start again with --set run.overwrite=true\n";
  return "kiln run: continue with --set run.resume_from=" + shell_word(newest.string()) +
         " (the steps trained after that checkpoint are lost)\n";
}

namespace {
// What the signal handler needs, in fixed buffers (async-signal-safe: unlink, write, raise).
constexpr int kMaxSockets = 80;
char g_sockets[kMaxSockets][108];
volatile std::sig_atomic_t g_socket_count = 0;
volatile std::sig_atomic_t g_interrupted = 0;
char g_stop_message[1024];
volatile std::sig_atomic_t g_stop_message_size = 0;
char g_no_checkpoint_message[160];
volatile std::sig_atomic_t g_no_checkpoint_message_size = 0;
char g_checkpoints[4096];  // RUN/checkpoints, checked with access(2) (async-signal-safe)
volatile std::sig_atomic_t g_steps_begun = 0;

extern "C" void on_stop_signal(int sig) {
  if (g_interrupted == 0 && g_steps_begun) {  // the first: let the loop finish the step and checkpoint
    g_interrupted = sig;
    static const char msg[] =
        "\nkiln run: interrupted: finishing the step in flight, then a checkpoint (again to stop at once)\n";
    [[maybe_unused]] auto n = ::write(2, msg, sizeof msg - 1);
    return;
  }
  for (int i = 0; i < g_socket_count; ++i) ::unlink(g_sockets[i]);
  if (!g_steps_begun && g_created_count > 0) {  // before step 1: the directories this run made go again
    for (int i = 0; i < g_startup_file_count; ++i) ::unlink(g_startup_files[i]);
    for (int i = 0; i < g_created_count; ++i)
      if (::rmdir(g_created[i]) != 0) break;  // one that holds anything else stays, and so do those above
  }
  const bool any = g_steps_begun && ::access(g_checkpoints, F_OK) == 0;
  [[maybe_unused]] auto n = any ? ::write(2, g_stop_message, std::size_t(g_stop_message_size))
                                : ::write(2, g_no_checkpoint_message, std::size_t(g_no_checkpoint_message_size));
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
}  // namespace

RunSignals::RunSignals(const std::string& tag, int64_t engines, const std::filesystem::path& dir) {
  const int size = std::snprintf(g_stop_message, sizeof g_stop_message,
                                 "kiln run: stopped at once; the checkpoints written so far are in %s\n",
                                 (dir / "checkpoints").c_str());
  g_stop_message_size = size < int(sizeof g_stop_message) ? size : int(sizeof g_stop_message) - 1;
  const int none = std::snprintf(g_no_checkpoint_message, sizeof g_no_checkpoint_message,
                                 "\nkiln run: stopped at once; no checkpoint was written by this run\n");
  g_no_checkpoint_message_size = none < int(sizeof g_no_checkpoint_message) ? none : int(sizeof g_no_checkpoint_message) - 1;
  std::snprintf(g_checkpoints, sizeof g_checkpoints, "%s", (dir / "checkpoints").c_str());
  g_steps_begun = 0;
  g_engines = std::sig_atomic_t(std::min<int64_t>(std::max<int64_t>(engines, 1), kMaxStartupFiles));
  paths_ = {tag + "-controller", tag + "-rollout", tag + "-ref", tag + "-trainer"};
  for (int64_t i = 1; i < engines; ++i) paths_.push_back(tag + "-rollout-" + std::to_string(i));
  int n = 0;
  for (const auto& p : paths_)
    if (n < kMaxSockets && p.size() < sizeof g_sockets[0]) std::snprintf(g_sockets[n++], sizeof g_sockets[0], "%s", p.c_str());
  g_socket_count = n;
  g_interrupted = 0;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, on_stop_signal);
}

RunSignals::~RunSignals() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, SIG_DFL);
  g_socket_count = 0;
  for (const auto& p : paths_) std::remove(p.c_str());
}

int RunSignals::interrupted() { return g_interrupted; }
void RunSignals::begin_steps() { g_steps_begun = 1; }

}  // namespace kiln::controller
