// What te_gemm's plan cache holds, for te_jax._te_cuda.gemm_plans(): one entry per device and problem, with how its
// cuBLASLt algorithm was chosen.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace te_jax {

struct GemmPlanInfo {
  int device;
  int64_t m, n, k;                           // row-major out[m, n] = lhs[m, k] . rhs[n, k]^T
  int parts;                                 // output buffers: one per part of rhs
  int64_t batch;                             // strided batch count (out[b] = lhs[b] . rhs[b]^T); 1: none
  std::string lhs_type, rhs_type, out_type;  // JAX dtype names
  bool fast_accum;
  int candidates;                            // algorithms the heuristic offered (all timed when more than one)
  int chosen;                                // the chosen one's rank in the heuristic's order
  bool deterministic;                        // chosen untimed: the heuristic's first
  bool captured;                             // the first call ran while XLA's stream was being captured
};

std::vector<GemmPlanInfo> GemmPlans();

}  // namespace te_jax
