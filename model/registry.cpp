#include "model/registry.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "model/config_json.hpp"
#include "model/glm4_moe_lite/model.hpp"
#include "model/glm5_next/model.hpp"
#include "model/glm5_next/state_dict_adapter.hpp"

namespace kiln::model {

namespace fs = std::filesystem;

namespace {
// An integer file of a cgroup ("max": no limit, false).
bool read_cgroup_int(const fs::path& path, int64_t& out) {
  std::ifstream f(path);
  std::string text;
  if (!(f >> text) || text == "max") return false;
  try {
    out = std::stoll(text);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// A key's value in a cgroup's memory.stat ("inactive_file 123" lines); 0 when absent.
int64_t cgroup_stat(const fs::path& file, const std::string& key) {
  std::ifstream f(file);
  std::string k;
  int64_t v = 0;
  while (f >> k >> v)
    if (k == key) return v;
  return 0;
}

// The smallest limit - usage over `root`/`relative` and each directory above it up to `root`
// (-1: no limit found; v1 writes "no limit" as a page-rounded 2^63). For memory, the usage a
// limit is compared with is what the group holds less its inactive file pages (the page cache the
// kernel reclaims before it kills: docker's and the kubelet's "working set"); for swap
// (`inactive_file_key` null) the usage as it reads.
int64_t cgroup_headroom(const fs::path& root, const std::string& relative, const char* limit_file,
                        const char* usage_file, const char* inactive_file_key) {
  int64_t least = -1;
  auto top = root.lexically_normal();
  if (!top.has_filename() && top.has_relative_path()) top = top.parent_path();  // "/sys/fs/cgroup/"
  fs::path dir = (root / fs::path(relative).relative_path()).lexically_normal();
  // A group outside this namespace's root ("/../job"): only the root is visible.
  const auto [end, _] = std::mismatch(top.begin(), top.end(), dir.begin(), dir.end());
  if (end != top.end()) dir = top;
  for (int depth = 0; depth < 64; ++depth) {
    int64_t limit = 0, used = 0;
    if (read_cgroup_int(dir / limit_file, limit) && read_cgroup_int(dir / usage_file, used) &&
        limit < (int64_t(1) << 60)) {
      if (inactive_file_key)
        used -= std::min(used, std::max<int64_t>(0, cgroup_stat(dir / "memory.stat", inactive_file_key)));
      const int64_t headroom = std::max<int64_t>(0, limit - used);
      least = least < 0 ? headroom : std::min(least, headroom);
    }
    if (dir == top || !dir.has_parent_path() || dir.parent_path() == dir) break;
    dir = dir.parent_path();
    if (dir.native().size() < top.native().size()) break;  // never above the root
  }
  return least;
}
}  // namespace

int64_t host_memory_available_bytes(const HostMemorySources& sources) {
  int64_t available = -1, swap_free = 0;
  {
    std::ifstream meminfo(sources.meminfo);
    for (std::string line; std::getline(meminfo, line);) {  // "Key:   N kB" (some lines have no unit)
      std::istringstream fields(line);
      std::string key;
      int64_t kib = 0;
      if (!(fields >> key >> kib)) continue;
      if (key == "MemAvailable:") available = kib * 1024;
      if (key == "SwapFree:") swap_free = kib * 1024;
    }
  }
  // This process's cgroups: "0::/a/b" (v2), "4:memory:/a/b" or "4:memory,foo:/a/b" (v1). With a
  // cgroup namespace both read "/" and the root is the container's own group.
  std::string v2_path, v1_path;
  bool v2_seen = false, v1_seen = false;
  {
    std::ifstream self(sources.self_cgroup);
    for (std::string line; std::getline(self, line);) {
      const auto a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
      if (b == std::string::npos) continue;
      const auto id = line.substr(0, a), controllers = "," + line.substr(a + 1, b - a - 1) + ",";
      if (id == "0" && controllers == ",,") v2_path = line.substr(b + 1), v2_seen = true;
      if (controllers.find(",memory,") != std::string::npos) v1_path = line.substr(b + 1), v1_seen = true;
    }
  }
  const fs::path root(sources.cgroup_root);
  std::error_code ec;
  // v2 where the controllers file is (the root itself, or unified/ on a hybrid host); v1's
  // memory controller when v2 gives nothing (a hybrid host's unified tree has no memory files).
  // Swap counts (slow, but the build is not killed) as far as every group up the tree lets the
  // process swap: v2's memory.swap.max - memory.swap.current, v1's memory+swap limit
  // (memory.memsw.*, which bounds the memory and the swap together).
  int64_t headroom = -1, swap_headroom = -1, v1_memsw_headroom = -1;
  for (const auto& v2_root : {root, root / "unified"})
    if (headroom < 0 && fs::exists(v2_root / "cgroup.controllers", ec)) {
      const auto& group = v2_seen ? v2_path : "/";
      headroom = cgroup_headroom(v2_root, group, "memory.max", "memory.current", "inactive_file");
      swap_headroom = cgroup_headroom(v2_root, group, "memory.swap.max", "memory.swap.current", nullptr);
    }
  if (headroom < 0) {
    const auto& group = v1_seen ? v1_path : "/";
    headroom = cgroup_headroom(root / "memory", group, "memory.limit_in_bytes", "memory.usage_in_bytes",
                               "total_inactive_file");
    v1_memsw_headroom = cgroup_headroom(root / "memory", group, "memory.memsw.limit_in_bytes",
                                        "memory.memsw.usage_in_bytes", "total_inactive_file");
  }
  if (available >= 0) available += swap_headroom >= 0 ? std::min(swap_free, swap_headroom) : swap_free;
  for (const int64_t h : {headroom, v1_memsw_headroom})
    if (h >= 0) available = available < 0 ? h : std::min(available, h);
  return available;
}

namespace {
// 3 significant figures with a scaled unit: "29.9 billion", "126 million"; "120 GB", "406 kB",
// "7.7 TB" (whole numbers past the largest unit).
std::string scaled(double v, const char* const units[5], double step) {
  int k = 0;
  while (k < 4 && v >= step) v /= step, ++k;
  char text[64];
  std::snprintf(text, sizeof text, v < 1000 ? "%.3g%s" : "%.0f%s", v, units[k]);
  return text;
}
}  // namespace

void check_fits_host_memory(int64_t parameters, double bytes_per_parameter, int64_t available_bytes,
                            const std::string& what, const std::string& for_what) {
  if (available_bytes < 0 || parameters < 0) return;
  const double need = bytes_per_parameter * double(parameters);
  if (need <= double(available_bytes)) return;
  static const char* const counts[5] = {"", " thousand", " million", " billion", " trillion"};
  static const char* const bytes[5] = {" B", " kB", " MB", " GB", " TB"};
  throw std::invalid_argument(what + ": " + scaled(double(parameters), counts, 1000) + " parameters take " +
                              scaled(need, bytes, 1000) + " " + for_what + ", but this machine has " +
                              scaled(double(available_bytes), bytes, 1000) +
                              " of memory available (MemAvailable + SwapFree, or a cgroup limit's headroom), so it "
                              "would be killed for lack of memory part way. Use a smaller flavor or checkpoint, or "
                              "a machine with more memory");
}

Registry Registry::with_builtins() {
  Registry r;
  ModelPackage glm;
  glm.name = "glm4_moe_lite";
  glm.hf_model_type = "glm4_moe_lite";
  glm.description = "GLM-4.7-Flash: MLA + sigmoid top-k MoE (DeepSeek-V3 layer), transformers Glm4MoeLiteForCausalLM";
  glm.flavors = glm4_moe_lite::flavors::names();
  glm.build_flavor = [](const std::string& flavor) -> std::shared_ptr<CausalLM> {
    return std::make_shared<glm4_moe_lite::Glm4MoeLiteModel>(glm4_moe_lite::flavors::by_name(flavor));
  };
  glm.from_hf_dir = [](const std::string& dir) -> std::shared_ptr<CausalLM> { return glm4_moe_lite::from_hf_dir(dir); };
  glm.from_hf_dir_experts = [](const std::string& dir, ExpertSlice experts) -> std::shared_ptr<CausalLM> {
    return glm4_moe_lite::from_hf_dir(dir, experts);
  };
  glm.parameter_count = [](const std::string& flavor, const std::string& dir, ExpertSlice experts) {
    const auto c = dir.empty() ? glm4_moe_lite::flavors::by_name(flavor)
                               : glm4_moe_lite::Glm4MoeLiteConfig::from_hf_json(config_json::read_config_json(dir),
                                                                                (fs::path(dir) / "config.json").string());
    return glm4_moe_lite::parameter_count(c, experts);
  };
  r.add_builtin(std::move(glm));
  ModelPackage glm5;
  glm5.name = "glm5_next";
  glm5.hf_model_type = "glm5_next";
  glm5.description = "GLM-5.3-Flash (text): Kimi Delta Attention + NoPE sparse attention (KPool indexer), mHC, "
                     "clamped SwiGLU MoE, transformers Glm5NextForConditionalGeneration";
  glm5.flavors = glm5_next::flavors::names();
  glm5.build_flavor = [](const std::string& flavor) -> std::shared_ptr<CausalLM> {
    return std::make_shared<glm5_next::Glm5NextModelImpl>(glm5_next::flavors::by_name(flavor), /*random_init=*/true);
  };
  glm5.from_hf_dir = [](const std::string& dir) -> std::shared_ptr<CausalLM> { return glm5_next::from_hf_dir(dir); };
  glm5.parameter_count = [](const std::string& flavor, const std::string& dir, ExpertSlice) {
    const auto c = dir.empty() ? glm5_next::flavors::by_name(flavor)
                               : glm5_next::Glm5NextConfig::from_hf_json(config_json::read_config_json(dir),
                                                                         dir + "/config.json");
    return glm5_next::parameter_count(c);
  };
  r.add_builtin(std::move(glm5));
  return r;
}

void Registry::add_builtin(ModelPackage package) {
  auto name = package.name;
  builtin_[name] = Entry{std::move(package), "built-in"};
}

void Registry::add(ModelPackage package) {
  auto name = package.name;
  user_[name] = Entry{std::move(package), loading_origin_.empty() ? "user (added in process)" : loading_origin_};
}

std::string Registry::plugin_dir_from_env() {
  const char* d = std::getenv("KILN_MODEL_PLUGINS");
  return d ? std::string(d) : std::string();
}

Registry Registry::with_plugins(const std::string& plugin_dir) {
  std::error_code ec;
  if (!plugin_dir.empty() && !fs::is_directory(plugin_dir, ec))
    throw std::invalid_argument("plugin directory '" + plugin_dir + "' " +
                                (fs::exists(plugin_dir, ec) ? "is not a directory (give the directory that holds the "
                                                              "plugins' .so files)"
                                                            : "does not exist"));
  auto r = with_builtins();
  r.load_plugins(plugin_dir);
  return r;
}

int64_t Registry::parameter_count(const std::string& package, const std::string& flavor,
                                  const std::string& checkpoint_dir, ExpertSlice experts) const {
  const auto& p = find(package);
  if (!p.parameter_count) return -1;
  try {
    return p.parameter_count(flavor, checkpoint_dir, experts);
  } catch (const std::exception&) {
    return -1;  // an unknown flavor or an unreadable config: the build names it
  }
}

void Registry::check_fits_host(const std::string& package, const std::string& flavor, const std::string& checkpoint_dir,
                               double bytes_per_parameter, const std::string& for_what, ExpertSlice experts) const {
  check_fits_host_memory(parameter_count(package, flavor, checkpoint_dir, experts), bytes_per_parameter,
                         host_memory_available_bytes(),
                         "model package " + package +
                             (checkpoint_dir.empty() ? ", flavor '" + flavor + "'" : ", checkpoint '" + checkpoint_dir + "'") +
                             (experts.ranks > 1 ? " (expert-parallel rank " + std::to_string(experts.rank) + " of " +
                                                      std::to_string(experts.ranks) + "'s share)"
                                                : ""),
                         for_what);
}

namespace {
const char* const kBuildInFp32 = "in fp32 (models are built in fp32 on the host, then cast and moved)";
}

std::shared_ptr<CausalLM> Registry::build(const std::string& package, const std::string& flavor,
                                          const std::string& checkpoint_dir) const {
  check_fits_host(package, flavor, checkpoint_dir, 4.0, kBuildInFp32);  // names an unknown package (find)
  return build_unchecked(package, flavor, checkpoint_dir);
}

std::shared_ptr<CausalLM> Registry::build_unchecked(const std::string& package, const std::string& flavor,
                                                    const std::string& checkpoint_dir) const {
  const auto& p = find(package);
  if (checkpoint_dir.empty()) return p.build_flavor(flavor);
  // Another package's checkpoint: named with the package that reads it, before this package's
  // config reader refuses one of its fields. (An unreadable config.json is the reader's to name.)
  std::string type;
  try {
    const auto j = config_json::read_config_json(checkpoint_dir);
    if (j.is_object() && j.contains("model_type") && j["model_type"].is_string()) type = j["model_type"].get<std::string>();
  } catch (const std::exception&) {
  }
  // Only a type another package declares: a package's reader may take more than its own (a
  // flat "glm5_next_text" config), and names an unknown one itself.
  std::string readers;
  for (const auto& name : names())
    if (!type.empty() && type != p.hf_model_type && find(name).hf_model_type == type)
      readers += (readers.empty() ? "" : ", ") + name;
  if (!readers.empty())
    throw std::invalid_argument("'" + checkpoint_dir + "' is a \"" + type + "\" checkpoint (config.json model_type); " +
                                "model package " + package + " reads \"" + p.hf_model_type + "\" ones: use package " +
                                readers + " (--package, or model.package in an experiment)");
  return p.from_hf_dir(checkpoint_dir);
}

std::shared_ptr<CausalLM> Registry::build(const ModelSpec& spec, ExpertSlice experts, int builders_on_host) const {
  if (builders_on_host < 1)
    throw std::invalid_argument("builders_on_host must be >= 1, got " + std::to_string(builders_on_host));
  if (spec.dtype != "fp32" && spec.dtype != "bf16")
    throw std::invalid_argument("dtype must be fp32 or bf16, got '" + spec.dtype + "'");
  if (spec.device != "cpu" && !torch::cuda::is_available())
    throw std::invalid_argument("model device is \"" + spec.device + "\" but no CUDA device is visible" +
                                " (is this a CUDA build of LibTorch on a GPU machine?)");
  const torch::Device device(spec.device);  // throws on a malformed device string
  const auto& package = find(spec.package);
  const bool sliced = experts.ranks > 1 && !spec.checkpoint.empty() && package.from_hf_dir_experts;
  std::shared_ptr<CausalLM> m;
  // The whole model's fp32 build (an expert-parallel share read from a checkpoint: that share),
  // times the processes of this host building one at the same time.
  const std::string for_what =
      builders_on_host == 1 ? std::string(kBuildInFp32)
                            : std::string(kBuildInFp32) + " for the " + std::to_string(builders_on_host) +
                                  " trainer ranks that build it on this host at once (LOCAL_WORLD_SIZE), one copy each";
  check_fits_host(spec.package, spec.flavor, spec.checkpoint, 4.0 * builders_on_host, for_what,
                  sliced ? experts : ExpertSlice{});
  if (sliced) {
    m = package.from_hf_dir_experts(spec.checkpoint, experts);
  } else {
    m = build_unchecked(spec.package, spec.flavor, spec.checkpoint);
  }
  // Cast on the host, then move: moving first would hold the fp32 model on the device (4
  // bytes a parameter: 120 GB for GLM-4.7-Flash, more than a GPU that already holds a trainer
  // rank has free). The cast goes parameter by parameter, so the host holds one copy at a time.
  m->to_dtype(spec.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32);
  m->to(device);
  return m;
}

int Registry::load_plugins(const std::string& dir) {
  plugin_dir_ = dir;
  if (dir.empty() || !fs::is_directory(dir)) return 0;
  std::vector<fs::path> libs;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".so") libs.push_back(e.path());
  std::sort(libs.begin(), libs.end());
  using RegisterFn = void (*)(Registry&);
  for (const auto& lib : libs) {
    // Never dlclose'd: the packages' functions live in the library.
    void* h = ::dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) throw std::runtime_error("model plugin '" + lib.string() + "' does not load: " + ::dlerror());
    auto fn = reinterpret_cast<RegisterFn>(::dlsym(h, "kiln_register_model_packages"));
    if (!fn)
      throw std::runtime_error("model plugin '" + lib.string() +
                               "' has no extern \"C\" kiln_register_model_packages(kiln::model::Registry&)");
    loading_origin_ = lib.string();
    fn(*this);
    loading_origin_.clear();
  }
  return int(libs.size());
}

const ModelPackage& Registry::find(const std::string& name) const {
  if (auto it = user_.find(name); it != user_.end()) return it->second.package;
  if (auto it = builtin_.find(name); it != builtin_.end()) return it->second.package;
  auto list = [](const std::map<std::string, Entry>& m) {
    std::string s;
    for (const auto& [n, e] : m) s += (s.empty() ? "" : ", ") + n;
    return s.empty() ? std::string("none") : s;
  };
  throw std::invalid_argument("no model package '" + name + "': looked in user packages (plugin directory " +
                              (plugin_dir_.empty() ? std::string("not set; KILN_MODEL_PLUGINS") : "'" + plugin_dir_ + "'") +
                              ": " + list(user_) + ") and in built-in packages (" + list(builtin_) + ")");
}

std::string Registry::origin(const std::string& name) const {
  if (auto it = user_.find(name); it != user_.end()) return it->second.origin;
  if (auto it = builtin_.find(name); it != builtin_.end()) return it->second.origin;
  find(name);  // throws the full message
  return {};
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> n;
  for (const auto& [k, e] : user_) n.push_back(k);
  for (const auto& [k, e] : builtin_)
    if (!user_.count(k)) n.push_back(k);
  return n;
}

}  // namespace kiln::model
