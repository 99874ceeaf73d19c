#pragma once
// Model packages by name. Lookup order: user packages (shared libraries loaded from a plugin
// directory) before built-in ones; a miss names every place it looked.
//
// A plugin is a shared library exporting
//     extern "C" void kiln_register_model_packages(kiln::model::Registry& registry);
// which calls registry.add(...) for each package it brings (added as user packages).
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/causal_lm.hpp"
#include "model/model_spec.hpp"

namespace kiln::model {

struct ModelPackage {
  std::string name;           ///< registry name, e.g. "glm4_moe_lite"
  std::string hf_model_type;  ///< config.json "model_type" it reads
  std::string description;
  std::vector<std::string> flavors;
  /// Builds a randomly initialised model of a named flavor; throws std::invalid_argument
  /// naming the flavors for an unknown one.
  std::function<std::shared_ptr<CausalLM>(const std::string& flavor)> build_flavor;
  /// Builds a model from an HF checkpoint directory (config.json + safetensors).
  std::function<std::shared_ptr<CausalLM>(const std::string& dir)> from_hf_dir;
  /// Optional: from an HF checkpoint directory, holding (and reading) only `experts`' routed
  /// experts: an expert-parallel rank's share, so that no rank holds the whole model. Null: the
  /// package loads the whole model and set_expert_parallel slices it.
  std::function<std::shared_ptr<CausalLM>(const std::string& dir, ExpertSlice experts)> from_hf_dir_experts;
  /// Optional: the parameters a model of `flavor` (checkpoint_dir empty) or of checkpoint_dir's
  /// config.json holds, with `experts`' share of the routed experts, from the config alone (nothing
  /// built or read). With it Registry::build(spec) refuses a model whose fp32 build on the host
  /// would not fit the memory available (check_fits_host_memory) instead of being killed by the
  /// kernel's out-of-memory killer part way; null: no such check.
  std::function<int64_t(const std::string& flavor, const std::string& checkpoint_dir, ExpertSlice experts)>
      parameter_count;
};

/// Where host_memory_available_bytes reads (tests point it at a made-up tree).
struct HostMemorySources {
  std::string meminfo = "/proc/meminfo";
  std::string self_cgroup = "/proc/self/cgroup";  ///< "0::/path" (v2) and "N:...memory...:/path" (v1) lines
  std::string cgroup_root = "/sys/fs/cgroup";     ///< v2 there (or in unified/), v1's memory controller in memory/
};

/// Bytes of host memory a new allocation can take now: /proc/meminfo's MemAvailable plus SwapFree
/// (SwapFree lowered to the smallest swap headroom of cgroup v2's memory.swap.max - memory.swap.current
/// up the tree: a group with memory.swap.max 0 lets the process swap nothing), then lowered to the
/// smallest headroom (limit - usage) of the memory limits on this process's cgroup
/// and every cgroup above it up to the root: cgroup v2 (memory.max - memory.current), else v1's
/// memory controller (memory.limit_in_bytes - memory.usage_in_bytes; its "no limit", a page-rounded
/// 2^63, ignored), the usage less the group's inactive file pages (memory.stat inactive_file /
/// total_inactive_file: page cache the kernel reclaims first, as docker's and the kubelet's
/// working set count it), and with v1 also to the smallest headroom of its memory+swap limits
/// (memory.memsw.limit_in_bytes - memory.memsw.usage_in_bytes). A cgroup directory the process
/// cannot see (outside its namespace) is skipped; a group above the namespace's root ("/../job")
/// reads the root. -1 when nothing can be read.
int64_t host_memory_available_bytes(const HostMemorySources& sources = {});

/// Refuses (std::invalid_argument) what needs `bytes_per_parameter` bytes for each of `parameters`
/// parameters of host memory when that exceeds `available_bytes`; `available_bytes` or
/// `parameters` < 0 (unknown) checks nothing. The message names `what` (e.g. "model package
/// glm4_moe_lite, flavor 'glm47_flash'"), the parameters, the bytes `for_what` (e.g. "in fp32"),
/// the bytes available, and what to do instead.
void check_fits_host_memory(int64_t parameters, double bytes_per_parameter, int64_t available_bytes,
                            const std::string& what, const std::string& for_what);

class Registry {
 public:
  /// A registry holding the built-in packages (glm4_moe_lite, glm5_next).
  static Registry with_builtins();
  /// Adds a built-in package (replaces one of the same name).
  void add_builtin(ModelPackage package);
  /// Adds a user package; during load_plugins, `origin` is the plugin's path.
  void add(ModelPackage package);
  /// dlopens every *.so in `dir` (sorted by name) and calls its
  /// kiln_register_model_packages. Returns how many plugins were loaded. Throws
  /// std::runtime_error naming the file for a library that does not load or lacks the entry
  /// point. An empty or missing `dir` loads nothing.
  int load_plugins(const std::string& dir);
  /// The plugin directory named by KILN_MODEL_PLUGINS, if set and non-empty, else "".
  static std::string plugin_dir_from_env();
  /// Built-ins plus the plugins of `plugin_dir` (default: KILN_MODEL_PLUGINS). Throws
  /// std::invalid_argument if an explicitly given directory does not exist, and what
  /// load_plugins throws.
  static Registry with_plugins(const std::string& plugin_dir = plugin_dir_from_env());
  /// Package `package` built from the HF checkpoint `checkpoint_dir` if non-empty, else from
  /// its flavor `flavor`. Throws as find(), build_flavor and from_hf_dir do, and, before building,
  /// std::invalid_argument for a model whose package counts more parameters than the host's
  /// available memory holds in fp32 (ModelPackage::parameter_count, check_fits_host_memory).
  std::shared_ptr<CausalLM> build(const std::string& package, const std::string& flavor,
                                  const std::string& checkpoint_dir) const;
  /// The parameters package `package`'s model of `flavor` / `checkpoint_dir` would hold with
  /// `experts`' routed experts (ModelPackage::parameter_count); -1 when the package does not
  /// count them or the flavor or config cannot be read (the build names that). Throws as find().
  int64_t parameter_count(const std::string& package, const std::string& flavor, const std::string& checkpoint_dir,
                          ExpertSlice experts = {}) const;
  /// check_fits_host_memory for that model (parameter_count) at `bytes_per_parameter` of host
  /// memory `for_what`, named by package and flavor or checkpoint (and share); nothing when the
  /// package does not count its parameters. Builds check 4 bytes "in fp32"; the controller checks
  /// a whole run on the CPU.
  void check_fits_host(const std::string& package, const std::string& flavor, const std::string& checkpoint_dir,
                       double bytes_per_parameter, const std::string& for_what, ExpertSlice experts = {}) const;
  /// spec's model (as above), moved to spec.device and cast to spec.dtype. `experts` (an
  /// expert-parallel rank's share, ranks > 1): from an HF checkpoint, only those routed experts
  /// are built and read when the package has from_hf_dir_experts (model.expert_slice() says
  /// what was built; otherwise the whole model, for set_expert_parallel to slice). Throws
  /// std::invalid_argument naming the field for a dtype other than fp32/bf16 or a CUDA device
  /// that is not visible, and what build() throws (an expert-parallel share read from a
  /// checkpoint is checked as that share). `builders_on_host` (>= 1): the processes of this host
  /// that build such a model at the same time (a launch's LOCAL_WORLD_SIZE trainer ranks): the
  /// memory check asks for that many fp32 builds, since each rank alone would see the whole host.
  std::shared_ptr<CausalLM> build(const ModelSpec& spec, ExpertSlice experts = {}, int builders_on_host = 1) const;

  /// The package called `name`: user packages first, then built-ins. Throws
  /// std::invalid_argument naming both places it looked and what each holds.
  const ModelPackage& find(const std::string& name) const;
  /// Where `name` came from: "built-in" or the plugin path. Throws like find().
  std::string origin(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  // build(package, flavor, checkpoint_dir) without its memory check (its caller made it).
  std::shared_ptr<CausalLM> build_unchecked(const std::string& package, const std::string& flavor,
                                            const std::string& checkpoint_dir) const;
  struct Entry {
    ModelPackage package;
    std::string origin;
  };
  std::map<std::string, Entry> user_, builtin_;

  std::string plugin_dir_;      // last directory searched for plugins
  std::string loading_origin_;  // plugin being loaded, for add()
};

}  // namespace kiln::model
