#pragma once
// Tensor-core building blocks shared by the .cu files that run bf16 mma.sync (sm_80 and later,
// Hopper included): the m16n8k16 product with fp32 accumulation, the transposing 4-matrix
// shared-memory load, and the 16-byte asynchronous global -> shared copy (cp.async) that feeds
// them. Fragment layouts and instructions: PTX ISA, "Matrix Fragments for mma.m16n8k16",
// "ldmatrix", "cp.async". Device code only; include from .cu files.
#include <cuda_bf16.h>

#include <cstdint>

namespace kiln::kernels::cuda {

/// c += a (16x16 bf16, row) * b (16x8 bf16, col), fp32 accumulation: mma.sync.m16n8k16.
/// a: the thread's 4 registers of the A fragment, b0/b1: its 2 of the B fragment, c: its 4
/// accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// Four 8x8 bf16 matrices from shared memory (ldmatrix.x4): thread (g = lane / 4, t = lane % 4)
/// gets elements (g, 2t) and (g, 2t+1) of matrix i in d[i]; p: this thread's row address
/// (threads 8i..8i+7 give the rows of matrix i).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&d)[4], const __nv_bfloat16* p) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(s));
}

/// Four 8x8 bf16 matrices from shared memory, transposed (ldmatrix.x4.trans); p: this thread's
/// row address (threads 8i..8i+7 give the rows of matrix i).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&d)[4], const __nv_bfloat16* p) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(s));
}

/// 16 bytes global -> shared (cp.async.cg); bytes = 0 fills the 16 bytes with zeros (a masked
/// or out-of-range element).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes));
}
/// Closes the group of cp.async issued so far by this thread.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace kiln::kernels::cuda
