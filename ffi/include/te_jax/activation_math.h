// The activation formulas of te_jax.ops.activation, shared by the CPU and CUDA handlers: float32 operations in the
// order of activation_fwd_ref / activation_bwd_ref, each rounded once. Compile with FMA contraction off
// (-ffp-contract=off, nvcc -fmad=false): XLA computes a * b + c with two roundings, and so must the handlers.
//
// The two primitives that are not plain IEEE operations are the ones XLA uses on each platform's GPU: exp is
// libdevice's expf (XLA's GPU exp), 1 / d is rcp.approx.f32 (what XLA's NVPTX backend emits for a float32 1 / d at
// its division precision, div.full). On the host they are the C library's expf and IEEE division.
#pragma once

#include <cmath>

#include "te_jax/host_device.h"

namespace te_jax {

// The integer codes of a half's function: te_jax.ops.activation's _CODES (ACTIVATIONS, then the functions that are
// only a pair's halves). kNone is the second half of an activation that is not a pair.
enum class Act : int {
  kGelu = 0, kRelu = 1, kSilu = 2, kQuickGelu = 3, kSquaredRelu = 4, kSigmoid = 5,
  kLinear = 6, kClampedSilu = 7, kClampedLinear = 8, kNone = -1
};

// Clamped SwiGLU's parameters (te_jax.ops.activation.CLAMPED_SWIGLU_DEFAULTS); unused by the other functions.
struct ActParams {
  float limit = 7.0f;
  float alpha = 1.702f;
  float glu_linear_offset = 1.0f;
};

// gelu: z = x * (C1 + C2 * x^2), z' = C1 + C3 * x^2, with C1 = 2 sqrt(2/pi), C2 = C1 * 0.044715, C3 = 3 * C2
// (float32, the bits of the reference's np.float32 constants).
inline constexpr float kGeluC1 = 0x1.988454p+0f;
inline constexpr float kGeluC2 = 0x1.2444f2p-4f;
inline constexpr float kGeluC3 = 0x1.b6676cp-3f;
inline constexpr float kQuickGeluK = 0x1.b3b646p+0f;  // 1.702

TE_JAX_HD float ActExp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

TE_JAX_HD float ActRecip(float d) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
#else
  return 1.0f / d;
#endif
}

// The reciprocal the formulas below take as a parameter: ActRecip, on every platform.
struct ExactRecip {
  TE_JAX_HD float operator()(float d) const { return ActRecip(d); }
};

#if defined(__CUDACC__)
// The CUDA kernels' fast reciprocal, for the sigmoid's d = 1 + exp(-z) only (d >= 1, +inf or NaN): rcp.approx.ftz.f32
// is one MUFU.RCP, while rcp.approx.f32 also scales its operand around it (two compares, two selects, two multiplies)
// to keep denormal operands and results. The two are the same instruction on every d in [2^-126, 2^126]; for d >= 1
// they can differ only where 1 / d is denormal (d > 2^126). `worst` collects the largest bit pattern seen (a NaN's or
// +inf's is larger than any finite d's), so that a caller finding it above kFtzRecipExactMax recomputes with
// ExactRecip: bitwise the same results as ActRecip.
inline constexpr unsigned kFtzRecipExactMax = 0x7E800000u;  // the bits of 2^126
struct FtzRecip {
  unsigned& worst;
  __device__ __forceinline__ float operator()(float d) const {
    worst = max(worst, __float_as_uint(d));
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
  }
};
#endif

template <typename Recip>
TE_JAX_HD float Sigmoid(float z, Recip recip) { return recip(1.0f + ActExp(-z)); }

TE_JAX_HD float Relu(float x) { return x <= 0.0f ? 0.0f : x; }  // NaN stays NaN, -0 becomes +0

// min(x, limit) as a select (fminf would turn a NaN into limit): NaN stays NaN.
TE_JAX_HD float ClampAbove(float x, float limit) { return x > limit ? limit : x; }

// act(x); `s` receives the sigmoid that TimesDerivative reuses (unset where there is none).
template <Act A, typename Recip>
TE_JAX_HD float Activate(float x, float& s, Recip recip, const ActParams& p) {
  if constexpr (A == Act::kGelu) {
    s = Sigmoid(x * (kGeluC1 + kGeluC2 * (x * x)), recip);
    return x * s;
  } else if constexpr (A == Act::kSilu) {
    s = Sigmoid(x, recip);
    return x * s;
  } else if constexpr (A == Act::kQuickGelu) {
    s = Sigmoid(kQuickGeluK * x, recip);
    return x * s;
  } else if constexpr (A == Act::kSigmoid) {
    s = Sigmoid(x, recip);
    return s;
  } else if constexpr (A == Act::kClampedSilu) {
    const float c = ClampAbove(x, p.limit);
    s = Sigmoid(p.alpha * c, recip);
    return c * s;
  } else if constexpr (A == Act::kLinear) {
    return x;
  } else if constexpr (A == Act::kClampedLinear) {
    const float c = x < -p.limit ? -p.limit : ClampAbove(x, p.limit);
    return c + p.glu_linear_offset;
  } else if constexpr (A == Act::kRelu) {
    return Relu(x);
  } else {
    static_assert(A == Act::kSquaredRelu, "no such activation");
    const float r = Relu(x);
    return r * r;
  }
}

// gg * act'(x), given the `s` Activate returned for the same x. Where the derivative is zero it is a select, +0
// whatever gg: relu's where x <= 0, clamped_silu's where x > limit, clamped_linear's outside [-limit, limit].
template <Act A>
TE_JAX_HD float TimesDerivative(float gg, float x, float s, const ActParams& p) {
  if constexpr (A == Act::kRelu) {
    return x > 0.0f ? gg : 0.0f;
  } else if constexpr (A == Act::kSquaredRelu) {
    const float r = Relu(x);
    return gg * (r + r);
  } else if constexpr (A == Act::kLinear) {
    return gg;
  } else if constexpr (A == Act::kClampedLinear) {
    return x > p.limit || x < -p.limit ? 0.0f : gg;
  } else if constexpr (A == Act::kSigmoid) {
    return gg * (s * (1.0f - s));
  } else if constexpr (A == Act::kClampedSilu) {
    const float t = ClampAbove(x, p.limit) * (s * (1.0f - s));
    return x > p.limit ? 0.0f : gg * (s + t * p.alpha);
  } else {
    float t = x * (s * (1.0f - s));
    if constexpr (A == Act::kGelu) t = t * (kGeluC1 + kGeluC3 * (x * x));
    if constexpr (A == Act::kQuickGelu) t = t * kQuickGeluK;
    return gg * (s + t);
  }
}

// Forward: y = act(a), or f(a) * h(b) for a pair (A, B) = (f, h); B is kNone for a single activation.
template <Act A, Act B, typename Recip = ExactRecip>
TE_JAX_HD float Forward(float a, float b, const ActParams& p, Recip recip = {}) {
  float s = 0.0f;  // unset where there is no sigmoid
  const float y = Activate<A>(a, s, recip, p);
  if constexpr (B != Act::kNone) {
    float sb = 0.0f;
    return y * Activate<B>(b, sb, recip, p);
  } else {
    return y;
  }
}

// Backward: da = g * act'(a), or, for a pair, da = (g * h(b)) * f'(a) and db = (g * f(a)) * h'(b) (for a linear h:
// (g * b) * f'(a) and g * f(a)).
template <Act A, Act B, typename Recip = ExactRecip>
TE_JAX_HD void Backward(float g, float a, float b, float& da, float& db, const ActParams& p, Recip recip = {}) {
  float s = 0.0f;  // unset where there is no sigmoid
  const float y = Activate<A>(a, s, recip, p);
  if constexpr (B != Act::kNone) {
    float sb = 0.0f;
    const float yb = Activate<B>(b, sb, recip, p);
    da = TimesDerivative<A>(g * yb, a, s, p);
    db = TimesDerivative<B>(g * y, b, sb, p);
  } else {
    da = TimesDerivative<A>(g, a, s, p);
  }
}

}  // namespace te_jax
