// What the norm handlers (CPU and CUDA) check of their operands and results before computing: the sizes that
// te_jax/ops/norm.py's abstract evaluation gives them.
#pragma once

#include <cstdint>
#include <utility>

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
// empty for RMSNorm, gamma and dgamma (cols,), dbeta (cols,) or empty for RMSNorm, dres x's type and shape or empty.
// Returns (rows, cols).
inline xla::ffi::ErrorOr<NormShape> CheckNormBwd(const xla::ffi::AnyBuffer& dz, const xla::ffi::AnyBuffer& x,
                                                 const xla::ffi::AnyBuffer& rsigma, int64_t gamma_count,
                                                 const xla::ffi::AnyBuffer& mean, const xla::ffi::AnyBuffer& dres,
                                                 const xla::ffi::AnyBuffer& dx, int64_t dgamma_count,
                                                 int64_t dbeta_count, bool rmsnorm) {
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
      dbeta_count != (rmsnorm ? 0 : s.cols) ||
      (Count(dres) != 0 && (Count(dres) != Count(x) || dres.element_type() != x.element_type()))) {
    return xla::ffi::Error::InvalidArgument("norm_bwd: operand or result sizes do not match x");
  }
  return s;
}

// te_norm_fwd's and te_norm_bwd's FFI signatures after the platform's context; the CUDA backward adds its
// workspace result (per-worker partial sums) between NormBwdOperands and NormBwdAttrs.
template <typename B>
auto NormFwdSignature(B b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // x: f32/bf16/f16, rank >= 1
      .template Arg<xla::ffi::BufferR1<xla::ffi::F32>>()   // gamma: (cols,), the factor (gamma + 1 if zero-centered)
      .template Arg<xla::ffi::BufferR0<xla::ffi::F32>>()   // scale: multiplies y before an FP8 cast
      .template Arg<xla::ffi::BufferR1<xla::ffi::F32>>()   // beta: (cols,), empty for RMSNorm
      .template Ret<xla::ffi::AnyBuffer>()                 // out: x's shape, f32/bf16/f16 or FP8
      .template Ret<xla::ffi::AnyBuffer>()                 // out_t: FP8 (cols, rows), or empty
      .template Ret<xla::ffi::AnyBuffer>()                 // amax: f32 max |y| (FP8), or empty
      .template Ret<xla::ffi::AnyBuffer>()                 // mean: f32 per row, empty for RMSNorm
      .template Ret<xla::ffi::AnyBuffer>()                 // rsigma: f32 per row
      .template Attr<bool>("rmsnorm")                      // RMSNorm instead of LayerNorm
      .template Attr<float>("epsilon");                    // added to the variance
}

template <typename B>
auto NormBwdOperands(B b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // dz: x's shape, x's type or f32
      .template Arg<xla::ffi::AnyBuffer>()                 // x: the forward input
      .template Arg<xla::ffi::AnyBuffer>()                 // rsigma: f32 per row
      .template Arg<xla::ffi::BufferR1<xla::ffi::F32>>()   // gamma: (cols,)
      .template Arg<xla::ffi::AnyBuffer>()                 // mean: f32 per row, empty for RMSNorm
      .template Arg<xla::ffi::AnyBuffer>()                 // dres: added to dx (x's shape and type), or empty
      .template Ret<xla::ffi::AnyBuffer>()                 // dx: x's shape and type
      .template Ret<xla::ffi::BufferR1<xla::ffi::F32>>()   // dgamma: (cols,)
      .template Ret<xla::ffi::BufferR1<xla::ffi::F32>>();  // dbeta: (cols,), empty for RMSNorm
}

template <typename B>
auto NormBwdAttrs(B b) {
  return std::move(b).template Attr<bool>("rmsnorm");  // RMSNorm instead of LayerNorm
}

}  // namespace te_jax
