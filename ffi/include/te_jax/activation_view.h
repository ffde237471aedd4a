// How the activation handlers see the pre-activation input x: (batch, rows, [2,] cols). The trailing dim is cols
// (N); a gated pair has a (2, N) block per row, its activated half first. `batch_ndim` leading dims form the batch
// of the transposed copy, which moves the feature block in front of the other leading dims.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

struct ActivationView {
  int64_t batch = 1;
  int64_t rows = 1;
  int64_t cols = 1;   // N: features per half
  bool gated = false;
  int64_t halves() const { return gated ? 2 : 1; }
  int64_t out_elements() const { return batch * rows * cols; }  // the forward output, and g
  int64_t in_elements() const { return out_elements() * halves(); }  // x, and dx
};

inline xla::ffi::ErrorOr<ActivationView> MakeActivationView(xla::ffi::Span<const int64_t> dims, bool gated,
                                                            int64_t batch_ndim) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  const int64_t feature_ndim = gated ? 2 : 1;
  if (rank < feature_ndim) return xla::ffi::Error::InvalidArgument("activation: x has too few dims");
  if (gated && dims[rank - 2] != 2) {
    return xla::ffi::Error::InvalidArgument("activation: a gated x must be (..., 2, N)");
  }
  const int64_t lead = rank - feature_ndim;
  if (batch_ndim < 0 || (lead > 0 && batch_ndim > lead - 1) || (lead == 0 && batch_ndim != 0)) {
    return xla::ffi::Error::InvalidArgument("activation: batch_ndim must be in [0, leading dims - 1]");
  }
  ActivationView v;
  v.gated = gated;
  for (int64_t i = 0; i < batch_ndim; ++i) v.batch *= dims[i];
  for (int64_t i = batch_ndim; i < lead; ++i) v.rows *= dims[i];
  v.cols = dims[rank - 1];
  return v;
}

}  // namespace te_jax
