#include "kernels/grouped_gemm.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/alignment.hpp"

#ifdef KILN_GROUPED_GEMM
#include <ATen/cuda/CUDAContext.h>

#include "kernels/grouped_gemm_cuda.hpp"
#include "kernels/stream_scratch.hpp"
#endif

// The tiles grouped_linear uses (kernels/CMakeLists.txt passes KILN_GG_TILE_*).
#ifndef KILN_GG_TILE_ROWCOL
#define KILN_GG_TILE_ROWCOL kCoop128x256
#endif
#ifndef KILN_GG_TILE_ROWROW
#define KILN_GG_TILE_ROWROW kCoop128x256
#endif
#ifndef KILN_GG_TILE_COLROW
#define KILN_GG_TILE_COLROW kPong128x128
#endif

namespace kiln::kernels {

const char* grouped_tile_name(GroupedTile t) {
  switch (t) {
    case GroupedTile::kCoop128x256: return "cooperative 128x256x64, cluster 2x1";
    case GroupedTile::kCoop128x128: return "cooperative 128x128x64, cluster 2x1";
    case GroupedTile::kPong64x128: return "pingpong 64x128x128, cluster 2x1";
    case GroupedTile::kPong128x128: return "pingpong 128x128x64, cluster 1x1";
    case GroupedTile::kPong64x256: return "pingpong 64x256x64, cluster 1x1";
    case GroupedTile::kCoop256x128N2: return "cooperative 256x128x64, cluster 1x2";
    case GroupedTile::kPong128x128N2: return "pingpong 128x128x64, cluster 1x2";
    case GroupedTile::kCoop128x256N2: return "cooperative 128x256x64, cluster 1x2";
  }
  return "?";
}

namespace {
constexpr const char* kTileKeys[kGroupedTileCount] = {"coop128x256", "coop128x128", "pong64x128",   "pong128x128",
                                                      "pong64x256",  "coop256x128n2", "pong128x128n2", "coop128x256n2"};

}  // namespace

const char* grouped_tile_key(GroupedTile t) { return kTileKeys[size_t(t)]; }

GroupedTileChoice parse_grouped_tiles(const char* env) {
  GroupedTileChoice c;
  c.tiles = {GroupedTile::KILN_GG_TILE_ROWCOL, GroupedTile::KILN_GG_TILE_ROWROW, GroupedTile::KILN_GG_TILE_COLROW};
  if (!env || !*env) return c;
  if (std::string(env) == "aten") {
    c.aten = true;
    return c;
  }
  c.chosen = true;
  if (std::string(env) == "cutlass") return c;
  std::string keys;
  for (auto* k : kTileKeys) keys += std::string(keys.empty() ? "" : ", ") + k;
  std::stringstream in(env);
  std::string item;
  for (size_t i = 0; i < 3; ++i) {
    TORCH_CHECK(std::getline(in, item, ','), "KILN_GROUPED_GEMM_TILES=\"", env,
                "\": needs \"aten\", \"cutlass\" or three tiles, forward,input-gradient,weight-gradient, each one of ", keys,
                " or aten");
    if (item == "aten") {
      c.form_aten[i] = true;
      continue;
    }
    auto* k = std::find_if(std::begin(kTileKeys), std::end(kTileKeys), [&](const char* s) { return item == s; });
    TORCH_CHECK(k != std::end(kTileKeys), "KILN_GROUPED_GEMM_TILES=\"", env, "\": unknown tile \"", item,
                "\"; one of ", keys, " or aten (or the whole value \"aten\" or \"cutlass\")");
    c.tiles[i] = GroupedTile(k - std::begin(kTileKeys));
  }
  TORCH_CHECK(!std::getline(in, item, ','), "KILN_GROUPED_GEMM_TILES=\"", env, "\": more than three tiles");
  const char* what[3] = {"forward", "input gradient", "weight gradient"};
  for (size_t i = 0; i < 3; ++i)
    TORCH_CHECK(c.form_aten[i] || grouped_gemm_compiled(GroupedLayout(i), c.tiles[i]), "KILN_GROUPED_GEMM_TILES=\"", env,
                "\": tile ", kTileKeys[size_t(c.tiles[i])], " (", what[i], ") is not compiled into this build: configure with ",
                "-DKILN_GROUPED_GEMM_SWEEP=ON for every tile, or -DKILN_GG_TILE_* to choose (a list compiles several)");
  return c;
}

namespace {
// The environment's choice, read once.
const GroupedTileChoice& tile_choice() {
  static const GroupedTileChoice c = parse_grouped_tiles(std::getenv("KILN_GROUPED_GEMM_TILES"));
  return c;
}

// A form given as "aten" among KILN_GROUPED_GEMM_TILES's three: grouped_linear runs
// at::_grouped_mm for it.
bool form_aten(GroupedLayout layout) { return tile_choice().form_aten[size_t(layout)]; }
}  // namespace

GroupedTile grouped_default_tile(GroupedLayout layout) { return tile_choice().tiles[size_t(layout)]; }

bool grouped_linear_chosen() { return tile_choice().chosen; }

void check_grouped_gemm_environment() {
  try {
    (void)tile_choice();
  } catch (const c10::Error& e) {
    throw std::invalid_argument(e.what_without_backtrace());
  }
}

bool grouped_linear_chosen_for(GroupedLayout layout) { return tile_choice().chosen && !form_aten(layout); }

bool grouped_gemm_compiled(GroupedLayout layout, GroupedTile tile) {
#ifdef KILN_GROUPED_GEMM
  return cuda::grouped_gemm_compiled(layout, tile);
#else
  (void)layout;
  (void)tile;
  return false;
#endif
}

#ifdef KILN_GROUPED_GEMM
namespace {
bool hopper(const at::Tensor& t) {
  return t.is_cuda() && at::cuda::getDeviceProperties(t.device().index())->major == 9;
}

void check_common(const char* what, const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && offs.is_cuda() && a.device() == b.device() && b.device() == offs.device(),
              what, ": a, b and offs must be on one CUDA device");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16, what, ": a and b must be bf16, got ",
              a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(offs.dim() == 1 && offs.scalar_type() == at::kInt && offs.is_contiguous(), what,
              ": offs must be [E] int32 contiguous, got ", offs.sizes(), " ", offs.scalar_type());
  TORCH_CHECK(hopper(a), what, ": kiln's grouped GEMM runs on Hopper (compute capability 9.x) only");
  TORCH_CHECK(aligned16(a) && aligned16(b), what, ": a and b must start on 16-byte boundaries");
}

// One call's arguments; mnk: the GEMM's M, N, K (the ragged one's total); groups: offs's length.
cuda::GroupedGemmArgs args(cuda::GroupedMode mode, const at::Tensor& offs, const at::Tensor& a, const at::Tensor& b,
                           at::Tensor& out, std::array<int64_t, 3> mnk, int64_t lda, int64_t ldb) {
  cuda::GroupedGemmArgs p;
  p.mode = mode;
  p.groups = int(offs.size(0));
  p.offs = offs.data_ptr<int32_t>();
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.d = out.data_ptr();
  p.M = mnk[0];
  p.N = mnk[1];
  p.K = mnk[2];
  p.lda = lda;
  p.ldb = ldb;
  return p;
}

void run(GroupedLayout layout, std::optional<GroupedTile> tile, cuda::GroupedGemmArgs& p, const at::Tensor& like) {
  const GroupedTile t = tile.value_or(grouped_default_tile(layout));
  StreamScratch keep(like.device());
  p.sm_count = at::cuda::getDeviceProperties(like.device().index())->multiProcessorCount;
  p.stream = at::cuda::getCurrentCUDAStream(like.device().index()).stream();
  TORCH_CHECK(cuda::grouped_gemm_run(layout, t, p, &StreamScratch::alloc, &keep), "grouped GEMM: tile ", grouped_tile_name(t),
              " is not compiled for this layout (kernels/CMakeLists.txt, KILN_GROUPED_GEMM_SWEEP)");
}
}  // namespace
#endif

at::Tensor grouped_mm_ragged_m(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                               std::optional<GroupedTile> tile) {
#ifdef KILN_GROUPED_GEMM
  check_common("grouped_mm_ragged_m", a, b, offs);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && b.size(1) == a.size(1) && offs.size(0) == b.size(0),
              "grouped_mm_ragged_m: a must be [M, K], b [E, K, N], offs [E]; got ", a.sizes(), ", ", b.sizes(), ", ",
              offs.sizes());
  TORCH_CHECK(a.stride(1) == 1 && a.stride(0) % 8 == 0 && a.size(1) % 8 == 0, "grouped_mm_ragged_m: a must be ",
              "row-major with K and its row stride multiples of 8, got strides ", a.strides());
  const bool b_rows = b.stride(2) == 1, b_cols = b.stride(1) == 1;
  TORCH_CHECK(b_rows || b_cols, "grouped_mm_ragged_m: each b[e] must be row- or column-major, got strides ",
              b.strides());
  const int64_t ldb = b_rows ? b.stride(1) : b.stride(2);
  TORCH_CHECK(ldb % 8 == 0 && b.stride(0) % 8 == 0 && b.size(2) % 8 == 0, "grouped_mm_ragged_m: b's N and strides ",
              "must be multiples of 8, got ", b.sizes(), " strides ", b.strides());
  auto out = at::empty({a.size(0), b.size(2)}, a.options());
  if (out.numel() == 0 || b.size(0) == 0) return out.zero_();
  auto p = args(cuda::GroupedMode::kRaggedM, offs, a, b, out, {a.size(0), b.size(2), a.size(1)}, a.stride(0), ldb);
  p.b_group_stride = b.stride(0);
  run(b_rows ? GroupedLayout::kRowRow : GroupedLayout::kRowCol, tile, p, a);
  return out;
#else
  (void)a, (void)b, (void)offs, (void)tile;
  TORCH_CHECK(false, "grouped_mm_ragged_m: this build has no grouped GEMM (needs CUDA and CUTLASS's headers)");
#endif
}

at::Tensor grouped_mm_ragged_k(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                               std::optional<GroupedTile> tile) {
#ifdef KILN_GROUPED_GEMM
  check_common("grouped_mm_ragged_k", a, b, offs);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "grouped_mm_ragged_k: a must be [M, Ktot], ",
              "b [Ktot, N]; got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.stride(0) == 1 && a.stride(1) % 8 == 0 && a.size(0) % 8 == 0, "grouped_mm_ragged_k: a must be ",
              "column-major with M and its column stride multiples of 8, got ", a.sizes(), " strides ", a.strides());
  TORCH_CHECK(b.stride(1) == 1 && b.stride(0) % 8 == 0 && b.size(1) % 8 == 0, "grouped_mm_ragged_k: b must be ",
              "row-major with N and its row stride multiples of 8, got ", b.sizes(), " strides ", b.strides());
  const int64_t E = offs.size(0);
  auto out = at::empty({E, a.size(0), b.size(1)}, a.options());
  if (out.numel() == 0) return out;
  auto p = args(cuda::GroupedMode::kRaggedK, offs, a, b, out, {a.size(0), b.size(1), a.size(1)}, a.stride(1),
                b.stride(0));
  run(GroupedLayout::kColRow, tile, p, a);
  cuda::grouped_zero_empty(p.offs, p.groups, p.d, p.M * p.N, p.stream);
  return out;
#else
  (void)a, (void)b, (void)offs, (void)tile;
  TORCH_CHECK(false, "grouped_mm_ragged_k: this build has no grouped GEMM (needs CUDA and CUTLASS's headers)");
#endif
}

bool grouped_linear_available(const at::Tensor& x, const at::Tensor& w) {
#ifdef KILN_GROUPED_GEMM
  // The chosen tiles are compiled: the build instantiates its KILN_GG_TILE_*, and
  // read_tile_choice refuses an environment choice it did not.
  return !tile_choice().aten && x.is_cuda() && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
         w.dim() == 3 && x.size(1) % 8 == 0 && w.size(1) % 8 == 0 && w.size(2) == x.size(1) && hopper(x);
#else
  (void)x, (void)w;
  return false;
#endif
}

#ifdef KILN_GROUPED_GEMM
namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GroupedLinearFn : public torch::autograd::Function<GroupedLinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& offs) {
    ctx->save_for_backward({x, w, offs});
    if (form_aten(GroupedLayout::kRowCol)) return at::_grouped_mm(x, w.transpose(-2, -1), offs);
    return grouped_mm_ragged_m(x, w.transpose(-2, -1), offs);  // each w[e]^T column-major: [K, N]
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w = s[1], &offs = s[2];
    auto dy = aligned_contiguous(grads[0].to(x.scalar_type()));  // [M, N]
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0))  // w[e] [N, K] row-major
      dx = form_aten(GroupedLayout::kRowRow) ? at::_grouped_mm(dy, w, offs) : grouped_mm_ragged_m(dy, w, offs);
    if (ctx->needs_input_grad(1))  // [E, N, K], w's layout
      dw = form_aten(GroupedLayout::kColRow) ? at::_grouped_mm(dy.t(), x, offs) : grouped_mm_ragged_k(dy.t(), x, offs);
    return {dx, dw, at::Tensor()};
  }
};
}  // namespace
#endif

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == x.size(1), "grouped_linear: x must be [M, K] and w ",
              "[E, N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(grouped_linear_available(x, w), "grouped_linear: needs a build with kiln's grouped GEMM, a Hopper GPU, ",
              "bf16 x and w, K and N multiples of 8; got ", x.scalar_type(), " ", x.sizes(), " on ", x.device(),
              ", w ", w.scalar_type(), " ", w.sizes());
#ifdef KILN_GROUPED_GEMM
  return GroupedLinearFn::apply(aligned_contiguous(x), aligned_contiguous(w), offs.contiguous());
#else
  return {};
#endif
}

}  // namespace kiln::kernels
