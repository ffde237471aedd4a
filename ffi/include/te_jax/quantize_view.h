// How the quantize handlers see their input: a 3-D view (batch, rows, cols) of x. cols is x's last dim; the
// transposed copy swaps rows and cols within each batch element. `batch_ndim` leading dims form the batch:
// batch_ndim = rank - 2 swaps the last two dims, batch_ndim = 0 moves the last dim to the front (the K-major copy a
// Hopper FP8 GEMM needs for dgrad/wgrad).
#pragma once

#include <cstdint>
#include <utility>

#include "te_jax/host_device.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

// te_quantize_interleaved (CUDA) takes 1 to this many parts, whose columns side by side number at most
// kMaxInterleavedCols (the kernels' column arithmetic is 32-bit). Exported as te_jax._te_cuda's
// quantize_interleaved_max_parts() and quantize_interleaved_max_cols(); tests/test_geometry.py checks that they cover
// the limits te_jax.ops.quantize_interleaved checks on every platform.
inline constexpr int kMaxInterleavedParts = 4;
inline constexpr int64_t kMaxInterleavedCols = INT32_MAX;

struct QuantizeView {
  int64_t batch = 1;
  int64_t rows = 1;
  int64_t cols = 1;
  int64_t size() const { return batch * rows * cols; }
};

// Which row of the transposed copy (within a batch element) x's column c becomes: row c, or with parts > 1 the rows
// grouped by part: x's columns come in chunks of `group`, chunk j belonging to part j % parts, and the copy is
// (parts, cols / parts, rows), each part's chunks in order (the q, k and v rows of an (H, 3, D) QKV kernel, each
// part a GEMM operand of its own).
struct TransposedRows {
  int64_t parts = 1;
  int64_t group = 1;
  int64_t part_rows = 0;  // cols / parts

  TE_JAX_HD int64_t Row(int64_t c) const {
    if (parts == 1) return c;
    const int64_t chunk = c / group;
    return (chunk % parts) * part_rows + (chunk / parts) * group + c % group;
  }
};

// The transposed copy's row map from the handlers' t_parts and t_group attributes, checked against x's cols.
inline xla::ffi::ErrorOr<TransposedRows> MakeTransposedRows(int64_t cols, int64_t t_parts, int64_t t_group) {
  if (t_parts == 1) return TransposedRows{1, 1, cols};
  if (t_parts < 1 || t_group < 1 || cols % (t_parts * t_group) != 0) {
    return xla::ffi::Error::InvalidArgument("quantize: t_parts * t_group must divide x's last dim");
  }
  return TransposedRows{t_parts, t_group, cols / t_parts};
}

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

// The results of te_quantize and te_quantize_interleaved (CUDA), in order.
template <typename B>
auto QuantizeResults(B b) {
  return std::move(b).template Ret<xla::ffi::AnyBuffer>()  // q: FP8, x's shape
      .template Ret<xla::ffi::AnyBuffer>()                 // qt: FP8 transposed copy, or empty
      .template Ret<xla::ffi::BufferR0<xla::ffi::F32>>()   // amax: max |x|
      .template Ret<xla::ffi::AnyBuffer>();                // dbias: f32 column sums, or empty
}

// te_quantize's operands and results after the platform's context; the CUDA handler adds its workspace result (dbias
// partials) after them, then QuantizeAttrs.
template <typename B>
auto QuantizeOperands(B b) {
  return QuantizeResults(std::move(b).template Arg<xla::ffi::AnyBuffer>()  // x: f32/bf16/f16, rank >= 1
                             .template Arg<xla::ffi::BufferR0<xla::ffi::F32>>());  // scale: multiplies x
}

template <typename B>
auto QuantizeAttrs(B b) {
  return std::move(b)
      .template Attr<int64_t>("batch_ndim")  // leading dims kept in front by qt
      .template Attr<int64_t>("t_parts")     // qt's rows grouped in this many parts (TransposedRows)
      .template Attr<int64_t>("t_group");    // ... from chunks of this many of x's columns
}

}  // namespace te_jax
