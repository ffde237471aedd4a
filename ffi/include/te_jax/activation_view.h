// How the activation handlers see the pre-activation input x: (batch, rows, [2,] cols). The trailing dim is cols
// (N); a gated pair has a (2, N) block per row, its activated half first. `batch_ndim` leading dims form the batch
// of the transposed copy, which moves the feature block in front of the other leading dims.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "te_jax/activation_math.h"
#include "te_jax/buffer_checks.h"
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

// The result `out` (FP8, float32, bfloat16 or float16, n elements) and its transposed copy `out_t` (empty, or FP8
// with n elements).
inline xla::ffi::Error CheckActivationOutputs(const xla::ffi::AnyBuffer& out, const xla::ffi::AnyBuffer& out_t,
                                              int64_t n) {
  const xla::ffi::DataType t = out.element_type();
  const bool valid = IsFp8(t) || t == xla::ffi::DataType::F32 || t == xla::ffi::DataType::BF16 ||
                     t == xla::ffi::DataType::F16;
  if (!valid || Count(out) != n) {
    return xla::ffi::Error::InvalidArgument("activation: out must be FP8, f32, bf16 or f16 with the result's size");
  }
  if (Count(out_t) != 0 && (!IsFp8(t) || Count(out_t) != n)) {
    return xla::ffi::Error::InvalidArgument("activation: out_t must be empty, or an FP8 array of the result's size");
  }
  return xla::ffi::Error::Success();
}

// The backward's view of x, once g (x's dtype, the forward output's size), dx and dx_t (as CheckActivationOutputs,
// x's size) and dbias (empty, or float32 of the feature dims' size) are checked.
inline xla::ffi::ErrorOr<ActivationView> CheckActivationBwd(const xla::ffi::AnyBuffer& g, const xla::ffi::AnyBuffer& x,
                                                           const xla::ffi::AnyBuffer& dx,
                                                           const xla::ffi::AnyBuffer& dx_t,
                                                           const xla::ffi::AnyBuffer& dbias, bool gated,
                                                           int64_t batch_ndim) {
  auto view = MakeActivationView(x.dimensions(), gated, batch_ndim);
  if (view.has_error()) return view.error();
  const ActivationView v = *view;
  if (Count(g) != v.out_elements() || g.element_type() != x.element_type()) {
    return xla::ffi::Error::InvalidArgument("activation: g must have x's dtype and the forward output's size");
  }
  if (auto err = CheckActivationOutputs(dx, dx_t, v.in_elements()); err.failure()) return err;
  if (Count(dbias) > 0 && (dbias.element_type() != xla::ffi::DataType::F32 || Count(dbias) != v.halves() * v.cols)) {
    return xla::ffi::Error::InvalidArgument("activation: dbias must be empty or f32 of the feature dims' size");
  }
  return v;
}

template <Act A>
using ActConstant = std::integral_constant<Act, A>;

// Calls f(A constant, B constant) for the runtime codes of a form of te_jax.ops.activation.ACTIVATION_TYPES: `act`
// the (first) function, `gate` a pair's second (B = Act::kNone when not `gated`). Only those forms are compiled:
// each activation alone, with a linear second half or with itself; the bilinear pair; clamped SwiGLU.
template <typename F>
xla::ffi::Error DispatchActivation(int64_t act, bool gated, int64_t gate, F&& f) {
  auto forms = [&](auto a) -> xla::ffi::Error {
    if (!gated) return f(a, ActConstant<Act::kNone>{});
    if (gate == static_cast<int64_t>(Act::kLinear)) return f(a, ActConstant<Act::kLinear>{});
    if (gate == act) return f(a, a);
    return xla::ffi::Error::InvalidArgument("activation: a pair's second half must be linear or its first's");
  };
  switch (act) {
    case 0: return forms(ActConstant<Act::kGelu>{});
    case 1: return forms(ActConstant<Act::kRelu>{});
    case 2: return forms(ActConstant<Act::kSilu>{});
    case 3: return forms(ActConstant<Act::kQuickGelu>{});
    case 4: return forms(ActConstant<Act::kSquaredRelu>{});
    case 5: return forms(ActConstant<Act::kSigmoid>{});
    case 6:
      if (gated && gate == 6) return f(ActConstant<Act::kLinear>{}, ActConstant<Act::kLinear>{});
      return xla::ffi::Error::InvalidArgument("activation: linear is only the bilinear pair (linear, linear)");
    case 7:
      if (gated && gate == 8) return f(ActConstant<Act::kClampedSilu>{}, ActConstant<Act::kClampedLinear>{});
      return xla::ffi::Error::InvalidArgument("activation: clamped_silu is only the pair (clamped_silu, "
                                              "clamped_linear)");
    default: return xla::ffi::Error::InvalidArgument("activation: unknown activation code");
  }
}

// te_act_fwd's and te_act_bwd's FFI signatures after the platform's context; the CUDA backward adds its workspace
// result (dbias partials) between ActBwdOperands and ActAttrs.
template <typename B>
auto ActFwdOperands(B b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // x: f32/bf16/f16, (..., N) or (..., 2, N)
      .template Arg<xla::ffi::BufferR0<xla::ffi::F32>>()   // scale: multiplies y before an FP8 cast
      .template Ret<xla::ffi::AnyBuffer>()                 // out: FP8 or f32/bf16/f16, (..., N)
      .template Ret<xla::ffi::AnyBuffer>()                 // out_t: FP8 transposed copy, or empty
      .template Ret<xla::ffi::BufferR0<xla::ffi::F32>>();  // amax: max |y| (FP8 outputs)
}

template <typename B>
auto ActBwdOperands(B b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // g: the output gradient, x's dtype
      .template Arg<xla::ffi::AnyBuffer>()                 // x: the forward input
      .template Arg<xla::ffi::BufferR0<xla::ffi::F32>>()   // scale: multiplies dx before an FP8 cast
      .template Ret<xla::ffi::AnyBuffer>()                 // dx: FP8 or f32/bf16/f16, x's shape
      .template Ret<xla::ffi::AnyBuffer>()                 // dx_t: FP8 transposed copy, or empty
      .template Ret<xla::ffi::BufferR0<xla::ffi::F32>>()   // amax: max |dx| (FP8 outputs)
      .template Ret<xla::ffi::AnyBuffer>();                // dbias: f32 column sums of dx, or empty
}

template <typename B>
auto ActAttrs(B b) {
  return std::move(b).template Attr<int64_t>("act")  // the (first half's) function: an Act code
      .template Attr<bool>("gated")                  // x is (..., 2, N), a pair, its first half first
      .template Attr<int64_t>("batch_ndim")          // leading dims kept in front by the transposed copy
      .template Attr<int64_t>("gate")                // a pair's second half's function: an Act code
      .template Attr<float>("limit")                 // clamped SwiGLU: the clamp's bound
      .template Attr<float>("alpha")                 // clamped SwiGLU: the sigmoid's slope
      .template Attr<float>("glu_linear_offset");    // clamped SwiGLU: added to the clamped second half
}

}  // namespace te_jax
