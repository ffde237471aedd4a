// The workspaces of the CUDA handlers that take one: an extra result buffer, so that XLA allocates it with the
// outputs and the handler allocates nothing (and may be captured into a CUDA graph). Each size is computed by one
// function, defined beside its handler, which the handler checks and carves its workspace with. The CUDA module
// exports them (`<target>_workspace` in ffi/cuda/module.cc) and te_jax/ops asks it for the result to give XLA
// (te_jax._core.native.workspace), so the geometry lives only here.
#pragma once

#include <cstdint>

#include "te_jax/activation_view.h"
#include "te_jax/quantize_view.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

// A workspace result: a 1-D array of `count` elements of `type`.
struct WorkspaceSize {
  int64_t count;
  xla::ffi::DataType type;
};

// te_gemm: cuBLASLt's workspace, then (parts > 1) the batched GEMM's pointer arrays; bytes.
// parts in [1, kMaxGemmParts].
WorkspaceSize GemmWorkspace(int parts);

// te_grouped_gemm: cuBLASLt's workspace, the per-tile pointer arrays and scalars, and a scratch output for the tiles
// past the groups (ragged: a float32 (k, n) matrix; else (tile, n) of out_bytes each); bytes. rows % tile == 0.
WorkspaceSize GroupedGemmWorkspace(bool ragged, int64_t rows, int64_t k, int64_t n, int64_t tile, int out_bytes);

// te_quantize and te_quantize_interleaved with dbias: float32 column partials of x's view (the interleaved parts side
// by side), one row per row tile.
WorkspaceSize QuantizeWorkspace(const QuantizeView& v);

// te_act_bwd with dbias: float32 column partials of dx, one row per row tile, then the completion counters.
WorkspaceSize ActBwdWorkspace(const ActivationView& v);

// te_norm_bwd: float32 partial sums, one row per worker, of dgamma and (LayerNorm) of dbeta. cols >= 1.
WorkspaceSize NormBwdWorkspace(int64_t rows, int64_t cols, bool rmsnorm);

}  // namespace te_jax
