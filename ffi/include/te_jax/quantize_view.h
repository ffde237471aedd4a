// How the quantize handlers see their input: a 3-D view (batch, rows, cols) of x. cols is x's last dim; the
// transposed copy swaps rows and cols within each batch element. `batch_ndim` leading dims form the batch:
// batch_ndim = rank - 2 swaps the last two dims, batch_ndim = 0 moves the last dim to the front (the K-major copy a
// Hopper FP8 GEMM needs for dgrad/wgrad).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

struct QuantizeView {
  int64_t batch = 1;
  int64_t rows = 1;
  int64_t cols = 1;
  int64_t size() const { return batch * rows * cols; }
};

inline xla::ffi::ErrorOr<QuantizeView> MakeQuantizeView(xla::ffi::Span<const int64_t> dims, int64_t batch_ndim) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (rank < 1) return xla::ffi::Error::InvalidArgument("quantize: x must have rank >= 1");
  if (batch_ndim < 0 || batch_ndim > rank - 1) {
    return xla::ffi::Error::InvalidArgument("quantize: batch_ndim must be in [0, rank - 1]");
  }
  QuantizeView v;
  for (int64_t i = 0; i < batch_ndim; ++i) v.batch *= dims[i];
  for (int64_t i = batch_ndim; i < rank - 1; ++i) v.rows *= dims[i];
  v.cols = dims[rank - 1];
  return v;
}

}  // namespace te_jax
