#include "experiments/model_cmd.hpp"

#include <cstdio>
#include <exception>
#include <filesystem>
#include <torch/torch.h>

#include "messaging/torch_tensor.hpp"
#include "actors/controller/run_dir.hpp"
#include "model/checkpoint/safetensors.hpp"
#include "model/glm5_next/crop.hpp"
#include "model/registry.hpp"

namespace kiln::experiments {

namespace {
namespace fs = std::filesystem;

model::Registry registry(const std::string& plugin_dir) {
  return model::Registry::with_plugins(plugin_dir.empty() ? model::Registry::plugin_dir_from_env() : plugin_dir);
}
// Refuses a `to` that is `from` itself, a training checkpoint (its optimizer state would no
// longer match the weights written over it) or any other directory that is not empty.
void check_output_dir(const std::string& from, const std::string& to) {
  if (to.empty()) throw std::invalid_argument("--to is empty: give a new or empty directory");
  std::error_code ec;
  if (!std::filesystem::is_directory(from, ec))  // before --to is made
    throw std::invalid_argument("--from '" + from + "' is not a directory (an HF checkpoint: config.json + "
                                "safetensors)");
  if (fs::exists(to) && fs::equivalent(from, to, ec))
    throw std::invalid_argument("--to '" + to + "' is the --from checkpoint itself; write to another directory");
  // Inside the checkpoint read: the output would become part of the source directory.
  if (controller::lies_within(to, from))
    throw std::invalid_argument("--to '" + to + "' lies inside the --from checkpoint '" + from +
                                "'; write outside it, so that the source directory is left as it was");
  if (const auto why = controller::dangling_link(to); !why.empty())
    throw std::invalid_argument("--to '" + to + "' " + why + ": give a new or empty directory");
  // The nearest existing ancestor must be a directory for --to to be made under it.
  for (auto p = fs::absolute(to, ec).parent_path(); !p.empty(); p = p.parent_path()) {
    if (fs::exists(p, ec)) {
      if (!fs::is_directory(p, ec))
        throw std::invalid_argument("--to '" + to + "': '" + p.string() +
                                    "' is not a directory, so no directory can be made under it");
      break;
    }
    if (p == p.root_path()) break;
  }
  for (const char* f : {"state.json", "optimizer.pt"})
    if (std::filesystem::exists(std::filesystem::path(to) / f, ec))
      throw std::invalid_argument("--to '" + to + "' holds a training checkpoint (" + f +
                                  "): writing there would replace its weights and keep its optimizer state; write to "
                                  "another directory");
  // Inside a training checkpoint (or a run's checkpoints/): a later save would replace it, or it
  // would change the checkpoint.
  if (const auto why = controller::inside_kiln_checkpoint(to); !why.empty())
    throw std::invalid_argument("--to '" + to + "' " + why + "; write outside it");
  // Any other non-empty directory: its files would outlive the new ones beside them (an old
  // shard, generation_config.json), or be replaced without being asked.
  if (std::filesystem::exists(to, ec) && !std::filesystem::is_directory(to, ec))
    throw std::invalid_argument("--to '" + to + "' exists and is not a directory: give a new or empty directory");
  if (std::filesystem::is_directory(to, ec)) {
    std::filesystem::directory_iterator it(to, ec), end;
    if (ec)
      throw std::invalid_argument("--to '" + to + "' cannot be listed (" + ec.message() + "): give a new or empty directory");
    if (it != end)
      throw std::invalid_argument("--to '" + to + "' is not empty (it holds '" + it->path().filename().string() +
                                  "'): give a new or empty directory, so that no earlier file is replaced or left "
                                  "beside the new ones");
  }
}
// --to of resave and crop, checked new or empty (check_output_dir): a command that fails leaves
// it as it found it, the files it wrote removed and the directory too when the command made it
// (a resave that ran out of disk left its shards behind, and a second try was refused as "not
// empty").
class OutputDir {
 public:
  explicit OutputDir(const std::string& to) : to_(to) {
    std::error_code ec;
    existed_ = fs::exists(to_, ec);
  }
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;
  void keep() { keep_ = true; }
  ~OutputDir() {
    if (keep_) return;
    std::error_code ec;
    if (!existed_) {
      fs::remove_all(to_, ec);
      return;
    }
    for (fs::directory_iterator it(to_, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code rm;
      fs::remove_all(it->path(), rm);
    }
  }

 private:
  fs::path to_;
  bool existed_ = false, keep_ = false;
};

// A filesystem error as a sentence: what failed, on which path, and why (the library's text is
// "filesystem error: cannot create directories: Invalid argument []").
std::string filesystem_failure(const std::filesystem::filesystem_error& e) {
  return "cannot write '" + e.path1().string() + "': " + e.code().message();
}
}  // namespace

int run_model_list(const std::string& plugin_dir) {
  try {
    auto r = registry(plugin_dir);
    for (const auto& name : r.names()) {
      const auto& p = r.find(name);
      std::string flavors;
      for (const auto& f : p.flavors) flavors += (flavors.empty() ? "" : ", ") + f;
      std::printf("%s  [%s]\n  %s\n  flavors: %s\n", name.c_str(), r.origin(name).c_str(), p.description.c_str(),
                  flavors.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln model list: %s\n", e.what());
    return 2;
  }
}

int run_model_resave(const std::string& package, const std::string& from, const std::string& to, int shard_mib,
                     const std::string& plugin_dir) {
  try {
    check_output_dir(from, to);
    auto r = registry(plugin_dir);
    auto model = r.build(package, "", from);
    OutputDir out(to);
    model->save_hf_checkpoint(to, uint64_t(shard_mib) << 20);
    out.keep();
    std::printf("kiln model resave: %s -> %s (%s)\n", from.c_str(), to.c_str(), package.c_str());
    return 0;
  } catch (const std::filesystem::filesystem_error& e) {
    std::fprintf(stderr, "kiln model resave: %s\n", filesystem_failure(e).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln model resave: %s\n", e.what());
    return 2;
  }
}

int run_model_crop(const std::string& from, const std::string& to, int64_t layers, int shard_mib) {
  try {
    check_output_dir(from, to);  // made by the crop's write, once every tensor was read and checked
    OutputDir out(to);
    auto r = model::glm5_next::crop_checkpoint(from, to, layers, uint64_t(shard_mib) << 20);
    out.keep();
    std::printf("kiln model crop: %s -> %s (%lld layers kept, MTP layers after them; %lld tensors, %lld FP8 weights written as bf16)\n",
                from.c_str(), to.c_str(), static_cast<long long>(layers), static_cast<long long>(r.tensors_written),
                static_cast<long long>(r.fp8_dequantised));
    return 0;
  } catch (const std::filesystem::filesystem_error& e) {
    std::fprintf(stderr, "kiln model crop: %s\n", filesystem_failure(e).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln model crop: %s\n", e.what());
    return 2;
  }
}

int run_model_logits(const std::string& package, const std::string& from, const std::vector<std::vector<int64_t>>& docs,
                     const std::string& out, const std::string& plugin_dir) {
  try {
    const std::filesystem::path o(out);
    std::error_code ec;
    if (out.empty() || std::filesystem::is_directory(o, ec) ||
        (o.has_parent_path() && !std::filesystem::is_directory(o.parent_path(), ec)))
      throw std::invalid_argument("--out '" + out + "' must be a file's path in a directory that exists");
    // Never over a file (it could be one of the checkpoint's own shards): a new path each time.
    if (std::filesystem::symlink_status(o, ec).type() != std::filesystem::file_type::not_found)
      throw std::invalid_argument("--out '" + out + "' already exists: kiln model logits writes a new file (remove it "
                                  "or choose another path)");
    if (const auto partial = checkpoint::partial_path(out);
        std::filesystem::symlink_status(partial, ec).type() != std::filesystem::file_type::not_found)
      throw std::invalid_argument("--out '" + out + "': '" + partial + "' exists, which the write goes through " +
                                  "(a file of an earlier write that was stopped?): remove it or choose another path");
    auto model = registry(plugin_dir).build(package, "", from);
    for (const auto& d : docs)
      for (auto id : d)
        if (id < 0 || id >= model->vocab_size())
          throw std::invalid_argument("--docs: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                      std::to_string(model->vocab_size()) + ")");
    torch::NoGradGuard no_grad;
    model::ForwardOptions opts;
    opts.return_routed_experts = true;
    auto fwd = model->forward(model::PackedBatch::from_documents(docs), opts);
    auto logits = model->logits(fwd).to(torch::kFloat32).contiguous();
    checkpoint::write_safetensors(out, {messaging::from_torch("logits", logits),
                                        messaging::from_torch("routed_experts", fwd.routed_experts.contiguous())});
    std::printf("kiln model logits: %s -> %s (%lld tokens)\n", from.c_str(), out.c_str(), (long long)logits.size(0));
    return 0;
  } catch (const c10::Error& e) {  // LibTorch's: without its C++ backtrace
    std::fprintf(stderr, "kiln model logits: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln model logits: %s\n", e.what());
    return 2;
  }
}

}  // namespace kiln::experiments
