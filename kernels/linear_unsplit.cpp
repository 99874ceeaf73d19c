#include "kernels/linear_unsplit.hpp"

#include <ATen/ATen.h>

#ifdef KILN_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <tuple>
#include <map>
#include <memory>
#endif

namespace kiln::kernels {

namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_unsplit: x [M, K] and w [N, K] with one K, got x ",
              x.sizes(), " and w ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear_unsplit: x is ", x.scalar_type(), ", w is ", w.scalar_type());
  TORCH_CHECK(x.device() == w.device(), "linear_unsplit: x on ", x.device(), ", w on ", w.device());
}

#ifdef KILN_CUDA
void check_lt(cublasStatus_t s, const char* what) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "linear_unsplit: ", what, " failed: ", cublasLtGetStatusString(s));
}

// The largest power of two <= 256 that divides the address (cuBLASLt's heuristics otherwise
// assume 256-byte aligned operands).
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al) al /= 2;
  return al;
}

struct Key {
  int device, dtype;
  int64_t m, n, k, ldx, g, ldy, sy;  // g groups: w's group g at g N K, y's at g sy, rows ldy apart
  uint32_t ax, aw, ay;
  bool operator<(const Key& o) const {
    return std::tie(device, dtype, m, n, k, ldx, g, ldy, sy, ax, aw, ay) <
           std::tie(o.device, o.dtype, o.m, o.n, o.k, o.ldx, o.g, o.ldy, o.sy, o.ax, o.aw, o.ay);
  }
};

// RAII for the descriptors of one call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct Plan {
  Descs d;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;  // a grouped call's heuristic may find none: the caller copies in instead
};

// Rows with unit column stride, a row stride of whole 16-byte units and a 16-byte aligned start
// are read in place; anything else is copied first (clone: contiguous() keeps a 1-row view).
at::Tensor readable_rows(const at::Tensor& x_MK) {
  const int64_t per16 = x_MK.scalar_type() == at::kFloat ? 4 : 8;
  const bool in_place = x_MK.stride(1) == 1 && (x_MK.size(0) == 1 || (x_MK.stride(0) >= x_MK.size(1) &&
                                                                      x_MK.stride(0) % per16 == 0)) &&
                        alignment_of(x_MK.data_ptr()) >= 16;
  return in_place ? x_MK : x_MK.clone(at::MemoryFormat::Contiguous);
}

// y (row-major [M, N] per group, rows ldy apart, group g at g sy elements) = x w_g^T for the G
// groups of w [G N, K] (contiguous), each element summed over K without split-K: the one
// cuBLASLt call of linear_unsplit and linear_unsplit_into_groups, its plan cached per key.
// Returns false, having run nothing, when cuBLASLt has no algorithm without split-K for a
// grouped call (G > 1); for one group that throws.
bool run_lt(const at::Tensor& x, const at::Tensor& w, int64_t M, int64_t N, int64_t K, int64_t G, void* y, int64_t ldy,
            int64_t sy) {
  const int64_t ldx = M == 1 ? K : x.stride(0);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaDataType_t dt = x.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : x.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_32F;

  // Column-major view: y^T [N, M] = (w [N, K] as col-major K x N, transposed) x (x as col-major K x M).
  // One plan (descriptors and the heuristic's algorithm) per shape, row stride and alignment,
  // made on first use and kept: a call then costs one cublasLtMatmul.
  // Every group's start: y's alignment and the group offset's in bytes.
  const uint32_t ay = G > 1 ? std::min(alignment_of(y), alignment_of(reinterpret_cast<const void*>(
                                                             uintptr_t(sy * int64_t(x.element_size())))))
                            : alignment_of(y);
  const Key key{x.device().index(), int(dt), M, N, K, ldx, G, ldy, sy, alignment_of(x.data_ptr()),
                alignment_of(w.data_ptr()), ay};
  // Never destroyed (a thread may still call in while statics are torn down at exit); at most
  // kMaxPlans kept (the row count is in the key: cached keys grow every decode step), then
  // dropped all at once (a plan in use stays alive through its shared_ptr).
  constexpr std::size_t kMaxPlans = 4096;
  static auto* mu = new std::mutex;
  static auto* plans = new std::map<Key, std::shared_ptr<Plan>>;
  auto handle = at::cuda::getCurrentCUDABlasLtHandle();
  std::shared_ptr<Plan> plan;
  {
    const std::lock_guard<std::mutex> lock(*mu);
    if (plans->size() >= kMaxPlans && !plans->count(key)) plans->clear();
    auto& slot = (*plans)[key];
    if (!slot) {
      auto p = std::make_shared<Plan>();
      auto& d = p->d;
      check_lt(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      check_lt(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "setting TRANSA");
      check_lt(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "setting TRANSB");
      check_lt(cublasLtMatrixLayoutCreate(&d.a, dt, uint64_t(K), uint64_t(N), K), "layout of w");
      check_lt(cublasLtMatrixLayoutCreate(&d.b, dt, uint64_t(K), uint64_t(M), ldx), "layout of x");
      check_lt(cublasLtMatrixLayoutCreate(&d.c, dt, uint64_t(N), uint64_t(M), ldy), "layout of y");
      if (G > 1) {  // w's groups one after another, x the same for each, y's groups sy apart
        const int32_t count = int32_t(G);
        const int64_t offsets[3] = {N * K, 0, sy};
        cublasLtMatrixLayout_t layouts[3] = {d.a, d.b, d.c};
        for (int i = 0; i < 3; ++i) {
          check_lt(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
                   "setting the group count");
          check_lt(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offsets[i],
                                                    sizeof offsets[i]),
                   "setting the group offset");
        }
      }
      check_lt(cublasLtMatmulPreferenceCreate(&d.pref), "cublasLtMatmulPreferenceCreate");
      const uint64_t workspace = 0;
      const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE;  // no split-K of any kind
      check_lt(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace),
               "setting the workspace");
      check_lt(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes),
               "setting the reduction-scheme mask");
      check_lt(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.aw, sizeof key.aw), "alignment of w");
      check_lt(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.ax, sizeof key.ax), "alignment of x");
      check_lt(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.ay, sizeof key.ay), "alignment of y");
      check_lt(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.ay, sizeof key.ay), "alignment of y");
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const auto status = cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &result, &found);
      if (G == 1) {
        check_lt(status, "cublasLtMatmulAlgoGetHeuristic");
        TORCH_CHECK(found > 0, "linear_unsplit: cuBLASLt has no algorithm without split-K for x [", M, ", ", K,
                    "] (row stride ", ldx, ") and w [", N, ", ", K, "] in ", x.scalar_type());
      }
      p->found = status == CUBLAS_STATUS_SUCCESS && found > 0;
      p->algo = result.algo;
      slot = std::move(p);
    }
    plan = slot;
  }
  if (!plan->found) return false;
  const auto& d = plan->d;
  const float alpha = 1.0f, beta = 0.0f;
  check_lt(cublasLtMatmul(handle, d.op, &alpha, w.data_ptr(), d.a, x.data_ptr(), d.b, &beta, y, d.c, y, d.c,
                          &plan->algo, nullptr, 0, at::cuda::getCurrentCUDAStream(x.device().index()).stream()),
           "cublasLtMatmul");
  return true;
}
#endif

}  // namespace

bool linear_unsplit_uses_cublaslt(const at::Tensor& x_MK, const at::Tensor& w_NK) {
#ifdef KILN_CUDA
  const auto t = x_MK.scalar_type();
  const int64_t per16 = t == at::kFloat ? 4 : 8;  // elements in 16 bytes
  return x_MK.is_cuda() && (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat) && x_MK.size(1) % per16 == 0 &&
         w_NK.size(0) % per16 == 0;
#else
  (void)x_MK;
  (void)w_NK;
  return false;
#endif
}

at::Tensor linear_unsplit(const at::Tensor& x_MK, const at::Tensor& w_NK) {
  check_inputs(x_MK, w_NK);
  if (!linear_unsplit_uses_cublaslt(x_MK, w_NK) || x_MK.size(0) == 0 || x_MK.size(1) == 0 || w_NK.size(0) == 0)
    return at::linear(x_MK, w_NK);
#ifdef KILN_CUDA
  // fp32 runs on CUDA cores, where cuBLASLt's kernels for 1-2 rows add a row's products in
  // another order than its kernels for more rows: fewer than 32 rows are zero-padded to 32 (on
  // the H200, 32, 128 and 1024 rows gave 8192 rows' bits; the router's 32 x 2048 input is 256 KB).
  constexpr int64_t kMinFp32Rows = 32;
  if (x_MK.scalar_type() == at::kFloat && x_MK.size(0) < kMinFp32Rows) {
    auto padded = at::zeros({kMinFp32Rows, x_MK.size(1)}, x_MK.options());
    padded.narrow(0, 0, x_MK.size(0)).copy_(x_MK);
    return linear_unsplit(padded, w_NK).narrow(0, 0, x_MK.size(0)).contiguous();
  }
  const auto x = readable_rows(x_MK);
  const auto w = w_NK.is_contiguous() && alignment_of(w_NK.data_ptr()) >= 16 ? w_NK : w_NK.clone(at::MemoryFormat::Contiguous);
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  (void)run_lt(x, w, M, N, K, 1, y.data_ptr(), N, 0);  // one group: throws where it finds no algorithm
  return y;
#else
  return at::linear(x_MK, w_NK);
#endif
}

void linear_unsplit_into_groups(const at::Tensor& x_MK, const at::Tensor& w_GNK, const at::Tensor& out_MGN) {
  TORCH_CHECK(w_GNK.dim() == 3 && out_MGN.dim() == 3 && out_MGN.size(0) == x_MK.size(0) &&
                  out_MGN.size(1) == w_GNK.size(0) && out_MGN.size(2) == w_GNK.size(1),
              "linear_unsplit_into_groups: w [G, N, K] and out [M, G, N] expected for x [M, K], got x ", x_MK.sizes(),
              ", w ", w_GNK.sizes(), " and out ", out_MGN.sizes());
  const int64_t M = out_MGN.size(0), G = w_GNK.size(0), N = w_GNK.size(1), K = w_GNK.size(2);
  // The stacked [G N, K] weight, contiguous (a group-strided view, e.g. a narrow of a wider
  // weight, is copied here on every call: MLA's key rows, ~8 us on the H100).
  const auto w = w_GNK.is_contiguous() ? w_GNK : w_GNK.clone(at::MemoryFormat::Contiguous);
  const auto w2 = w.view({G * N, K});
  check_inputs(x_MK, w2);
  TORCH_CHECK(out_MGN.scalar_type() == x_MK.scalar_type() && out_MGN.device() == x_MK.device(),
              "linear_unsplit_into_groups: out is ", out_MGN.scalar_type(), " on ", out_MGN.device(), ", x ",
              x_MK.scalar_type(), " on ", x_MK.device());
  if (out_MGN.numel() == 0) return;
#ifdef KILN_CUDA
  const int64_t per16 = x_MK.scalar_type() == at::kFloat ? 4 : 8, ldy = out_MGN.stride(0), sy = out_MGN.stride(1);
  // One grouped call where out's rows and groups lie apart on 16-byte boundaries, without overlap.
  const bool grouped = linear_unsplit_uses_cublaslt(x_MK, w2) && K > 0 && out_MGN.stride(2) == 1 &&
                       (x_MK.scalar_type() != at::kFloat || M >= 32) && sy >= N && sy % per16 == 0 &&
                       ldy >= (G - 1) * sy + N && ldy % per16 == 0 && alignment_of(out_MGN.data_ptr()) >= 16;
  if (grouped) {
    const auto x = readable_rows(x_MK);
    if (run_lt(x, alignment_of(w.data_ptr()) >= 16 ? w : w.clone(), M, N, K, G, out_MGN.data_ptr(), ldy, sy)) return;
  }
#endif
  out_MGN.copy_(linear_unsplit(x_MK, w2).view({M, G, N}));
}

}  // namespace kiln::kernels
