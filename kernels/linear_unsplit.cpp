#include "kernels/linear_unsplit.hpp"

#include <ATen/ATen.h>

#ifdef KILN_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

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
  int64_t m, n, k, ldx;
  uint32_t ax, aw, ay;
  bool operator<(const Key& o) const {
    return std::tie(device, dtype, m, n, k, ldx, ax, aw, ay) < std::tie(o.device, o.dtype, o.m, o.n, o.k, o.ldx, o.ax, o.aw, o.ay);
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
};
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
  const int64_t per16 = x_MK.scalar_type() == at::kFloat ? 4 : 8;
  // Rows with unit column stride, a row stride of whole 16-byte units and a 16-byte aligned start
  // are read in place; anything else is copied first (clone: contiguous() keeps a 1-row view).
  const bool in_place = x_MK.stride(1) == 1 && (x_MK.size(0) == 1 || (x_MK.stride(0) >= x_MK.size(1) &&
                                                                      x_MK.stride(0) % per16 == 0)) &&
                        alignment_of(x_MK.data_ptr()) >= 16;
  const auto x = in_place ? x_MK : x_MK.clone(at::MemoryFormat::Contiguous);
  const auto w = w_NK.is_contiguous() && alignment_of(w_NK.data_ptr()) >= 16 ? w_NK : w_NK.clone(at::MemoryFormat::Contiguous);
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1), ldx = M == 1 ? K : x.stride(0);
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({M, N}, x.options());
  const cudaDataType_t dt = x.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : x.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_32F;

  // Column-major view: y^T [N, M] = (w [N, K] as col-major K x N, transposed) x (x as col-major K x M).
  // One plan (descriptors and the heuristic's algorithm) per shape, row stride and alignment,
  // made on first use and kept: a call then costs one cublasLtMatmul.
  const Key key{x.device().index(), int(dt), M, N, K, ldx, alignment_of(x.data_ptr()), alignment_of(w.data_ptr()),
                alignment_of(y.data_ptr())};
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
      check_lt(cublasLtMatrixLayoutCreate(&d.c, dt, uint64_t(N), uint64_t(M), N), "layout of y");
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
      check_lt(cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &result, &found),
               "cublasLtMatmulAlgoGetHeuristic");
      TORCH_CHECK(found > 0, "linear_unsplit: cuBLASLt has no algorithm without split-K for x [", M, ", ", K, "] (row stride ",
                  ldx, ") and w [", N, ", ", K, "] in ", x.scalar_type());
      p->algo = result.algo;
      slot = std::move(p);
    }
    plan = slot;
  }
  const auto& d = plan->d;
  const float alpha = 1.0f, beta = 0.0f;
  check_lt(cublasLtMatmul(handle, d.op, &alpha, w.data_ptr(), d.a, x.data_ptr(), d.b, &beta, y.data_ptr(), d.c, y.data_ptr(), d.c,
                          &plan->algo, nullptr, 0, at::cuda::getCurrentCUDAStream(x.device().index()).stream()),
           "cublasLtMatmul");
  return y;
#else
  return at::linear(x_MK, w_NK);
#endif
}

}  // namespace kiln::kernels
