// How te_quantize_block_cuda sees its input: a 3-D view (batch, rows, cols) of x. cols is x's last dim. With 2-D
// blocks (BLOCK_128X128, NVFP4's 16 x 16) or a transposed copy, rows is x's second-to-last dim and the leading dims
// form the batch; otherwise every leading dim is a row (batch 1), so that a (batch, sequence, hidden) activation
// fills whole tiles.
#pragma once

#include <cstdint>

#include "te_jax/host_device.h"
#include "te_jax/scaling_mode.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

struct QuantizeBlockView {
  int64_t batch = 1;
  int64_t rows = 1;
  int64_t cols = 1;
  int64_t size() const { return batch * rows * cols; }
};

inline xla::ffi::ErrorOr<QuantizeBlockView> MakeQuantizeBlockView(xla::ffi::Span<const int64_t> dims,
                                                                  bool keep_rows) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (rank < 1) return xla::ffi::Error::InvalidArgument("quantize_block: x must have rank >= 1");
  if (keep_rows && rank < 2) {
    return xla::ffi::Error::InvalidArgument(
        "quantize_block: 2-D blocks and the transposed copy need x of rank >= 2");
  }
  QuantizeBlockView v;
  v.cols = dims[rank - 1];
  const int64_t row_dims = keep_rows ? rank - 2 : 0;  // leading dims that are batch
  for (int64_t i = 0; i < row_dims; ++i) v.batch *= dims[i];
  for (int64_t i = row_dims; i < rank - 1; ++i) v.rows *= dims[i];
  return v;
}

TE_JAX_HD int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace te_jax
