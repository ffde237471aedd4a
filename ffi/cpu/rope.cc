// CPU handlers for te_rope_fwd / te_rope_bwd: the rotation of the first R = 2 * half features of every head by the
// angles whose float32 cos/sin tables are given (the backward one by the negated angles, with the same code and
// -sin), the other features copied bit for bit. Compiled with -ffp-contract=off: every product and sum rounds once,
// as in te_jax.ops.rope.rope_fwd_ref.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "te_jax/host_types.h"
#include "te_jax/rope_view.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

// Element access by storage type: float32 as is, bfloat16 and float16 through float32 (round to nearest even on
// the way back, as XLA's convert).
struct F32 {
  using Raw = float;
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};

struct Bf16 {
  using Raw = uint16_t;
  static float Load(uint16_t v) { return Bf16ToFloat(v); }
  static uint16_t Store(float f) {
    const uint32_t bits = FloatToBits(f);
    if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN, sign kept
    return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
};

struct F16 {
  using Raw = uint16_t;
  static float Load(uint16_t v) { return F16ToFloat(v); }
  static uint16_t Store(float f) {
    const _Float16 h = static_cast<_Float16>(f);  // round to nearest even
    uint16_t bits;
    std::memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
};

// y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s for each pair of each head; s is -sin for the backward pass.
template <typename E, bool kInterleaved>
void Rotate(const RopeView& v, const typename E::Raw* x, const float* cos, const float* sin, float sin_sign,
            typename E::Raw* y) {
  const int64_t row_len = v.heads * v.dim;
  const int64_t rot = 2 * v.half;
  for (int64_t t = 0; t < v.tokens(); ++t) {
    const float* ct = cos + v.TableRow(t) * v.half;
    const float* st = sin + v.TableRow(t) * v.half;
    for (int64_t h = 0; h < v.heads; ++h) {
      const typename E::Raw* xr = x + t * row_len + h * v.dim;
      typename E::Raw* yr = y + t * row_len + h * v.dim;
      for (int64_t i = 0; i < v.half; ++i) {
        const int64_t i1 = kInterleaved ? 2 * i : i;
        const int64_t i2 = kInterleaved ? 2 * i + 1 : i + v.half;
        const float x1 = E::Load(xr[i1]), x2 = E::Load(xr[i2]);
        const float c = ct[i], s = sin_sign * st[i];  // a sign flip: exact
        yr[i1] = E::Store(x1 * c - x2 * s);
        yr[i2] = E::Store(x2 * c + x1 * s);
      }
      std::memcpy(yr + rot, xr + rot, (v.dim - rot) * sizeof(typename E::Raw));  // the features that do not rotate
    }
  }
}

template <typename E>
void RotateAs(const RopeView& v, const void* x, const float* cos, const float* sin, float sin_sign, void* y,
              bool interleaved) {
  using Raw = typename E::Raw;
  auto rotate = interleaved ? Rotate<E, true> : Rotate<E, false>;
  rotate(v, static_cast<const Raw*>(x), cos, sin, sin_sign, static_cast<Raw*>(y));
}

template <bool kBackward>
ffi::Error RopeCpu(ffi::AnyBuffer x, ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> y, bool sbhd,
                   bool interleaved) {
  auto view = MakeRopeView(x, cos, sin, sbhd);
  if (view.has_error()) return view.error();
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("rope: the output must have x's dtype and size");
  }
  const float sin_sign = kBackward ? -1.0f : 1.0f;
  const float* c = static_cast<const float*>(cos.untyped_data());
  const float* s = static_cast<const float*>(sin.untyped_data());
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  switch (x.element_type()) {
    case ffi::DataType::F32: RotateAs<F32>(*view, in, c, s, sin_sign, out, interleaved); break;
    case ffi::DataType::BF16: RotateAs<Bf16>(*view, in, c, s, sin_sign, out, interleaved); break;
    case ffi::DataType::F16: RotateAs<F16>(*view, in, c, s, sin_sign, out, interleaved); break;
    default: return ffi::Error::InvalidArgument("rope: x must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RopeFwdCpuHandler, RopeCpu<false>, RopeSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RopeBwdCpuHandler, RopeCpu<true>, RopeSignature(ffi::Ffi::Bind()));

}  // namespace te_jax
