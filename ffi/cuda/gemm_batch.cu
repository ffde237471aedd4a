// The pointer arrays of te_gemm's batched GEMM: see te_jax/gemm_batch.h.
#include "te_jax/gemm_batch.h"

namespace te_jax {
namespace {

__global__ void GemmBatchPointersKernel(GemmBatchPointers p, const void** a, const void** b, void** d) {
  const int i = threadIdx.x;
  if (i >= p.parts) return;
  a[i] = p.rhs + i * p.rhs_step;
  b[i] = p.lhs;
  d[i] = p.out[i];
}

}  // namespace

cudaError_t LaunchGemmBatchPointers(const GemmBatchPointers& p, const void** a, const void** b, void** d,
                                    cudaStream_t stream) {
  GemmBatchPointersKernel<<<1, kMaxGemmParts, 0, stream>>>(p, a, b, d);
  return cudaGetLastError();
}

}  // namespace te_jax
