// What the norm handlers (CPU and CUDA) check of their operands and results before computing: the sizes that
// te_jax/ops/norm.py's abstract evaluation gives them.
#pragma once

#include <cstdint>

#include "te_jax/buffer_checks.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

struct NormShape {
  int64_t rows = 0;
  int64_t cols = 0;
  bool fp8 = false;     // FP8 output (with amax)
  bool want_t = false;  // and its transposed copy
};

// Forward: x (rows, cols), gamma (cols,), beta (cols,) or empty for RMSNorm; out like x, out_t empty or FP8 like x,
// amax one float for FP8 outputs, mean (rows,) or empty for RMSNorm, rsigma (rows,).
inline xla::ffi::ErrorOr<NormShape> CheckNormFwd(const xla::ffi::AnyBuffer& x, int64_t gamma_count,
                                                 int64_t beta_count, const xla::ffi::AnyBuffer& out,
                                                 const xla::ffi::AnyBuffer& out_t, const xla::ffi::AnyBuffer& amax,
                                                 const xla::ffi::AnyBuffer& mean, const xla::ffi::AnyBuffer& rsigma,
                                                 bool rmsnorm) {
  NormShape s;
  s.cols = Cols(x);
  if (s.cols < 1) return xla::ffi::Error::InvalidArgument("norm_fwd: x's last dim must be >= 1");
  s.rows = Count(x) / s.cols;
  s.fp8 = IsFp8(out.element_type());
  s.want_t = Count(out_t) > 0;
  if (Count(out) != Count(x) || gamma_count != s.cols || beta_count != (rmsnorm ? 0 : s.cols) ||
      Count(rsigma) != s.rows || Count(mean) != (rmsnorm ? 0 : s.rows) || Count(amax) != (s.fp8 ? 1 : 0) ||
      (s.want_t && (!s.fp8 || Count(out_t) != Count(x)))) {
    return xla::ffi::Error::InvalidArgument("norm_fwd: operand or result sizes do not match x");
  }
  return s;
}

// Backward: dz like x (x's type or float32), dx x's type and shape, float32 rsigma (rows,) and mean (rows,) or
// empty for RMSNorm, gamma and dgamma (cols,), dbeta (cols,) or empty for RMSNorm. Returns (rows, cols).
inline xla::ffi::ErrorOr<NormShape> CheckNormBwd(const xla::ffi::AnyBuffer& dz, const xla::ffi::AnyBuffer& x,
                                                 const xla::ffi::AnyBuffer& rsigma, int64_t gamma_count,
                                                 const xla::ffi::AnyBuffer& mean, const xla::ffi::AnyBuffer& dx,
                                                 int64_t dgamma_count, int64_t dbeta_count, bool rmsnorm) {
  NormShape s;
  s.cols = Cols(x);
  if (s.cols < 1 || dx.element_type() != x.element_type() ||
      (dz.element_type() != x.element_type() && dz.element_type() != xla::ffi::DataType::F32)) {
    return xla::ffi::Error::InvalidArgument("norm_bwd: dx must be x's type, dz x's type or f32, x's last dim >= 1");
  }
  s.rows = Count(x) / s.cols;
  if (Count(dz) != Count(x) || Count(dx) != Count(x) || rsigma.element_type() != xla::ffi::DataType::F32 ||
      Count(rsigma) != s.rows || mean.element_type() != xla::ffi::DataType::F32 ||
      Count(mean) != (rmsnorm ? 0 : s.rows) || gamma_count != s.cols || dgamma_count != s.cols ||
      dbeta_count != (rmsnorm ? 0 : s.cols)) {
    return xla::ffi::Error::InvalidArgument("norm_bwd: operand or result sizes do not match x");
  }
  return s;
}

}  // namespace te_jax
