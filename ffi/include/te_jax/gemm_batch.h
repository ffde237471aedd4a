// te_gemm with several outputs (rhs (P, N, K), out_p = lhs . rhs[p]^T) runs as one cuBLASLt pointer-array batched
// GEMM. Its pointer arrays live in device memory (the workspace's tail), written by a kernel on the GEMM's stream, so
// that a CUDA graph that captured the call replays it with the pointers it was captured with.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace te_jax {

// At most this many parts. Exported as te_jax._te_cuda.gemm_max_parts(); tests/test_geometry.py checks that it
// covers te_jax.ops.gemm.MAX_PARTS, the limit the API checks on every platform.
constexpr int kMaxGemmParts = 4;

struct GemmBatchPointers {
  const char* rhs;             // part p's A: rhs + p * rhs_step
  int64_t rhs_step;            // bytes: one part of rhs
  const char* lhs;             // every part's B
  void* out[kMaxGemmParts];    // part p's D
  int parts;
};

// Writes the A, B and D pointer arrays (one entry per part) on `stream`.
cudaError_t LaunchGemmBatchPointers(const GemmBatchPointers& p, const void** a, const void** b, void** d,
                                    cudaStream_t stream);

}  // namespace te_jax
