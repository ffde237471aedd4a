// CPU handler for te_quantize: saturating FP8 cast of x * scale, amax = max|x|, optional transposed copy and
// column sums (dbias). Bitwise equal to te_jax.ops.quantize.quantize_ref for the cast, amax and transpose.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "te_jax/host_types.h"
#include "te_jax/quantize_view.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

template <typename LoadFn>
ffi::Error QuantizeLoop(LoadFn load, const QuantizeView& v, const TransposedRows& t, float scale, const Fp8Format& fmt,
                        uint8_t* q, uint8_t* qt, float* amax_out, float* dbias) {
  // 64x64 tiles keep the transposed copy's column-order writes within cache lines. Each column still sums its rows
  // in increasing order.
  constexpr int64_t kTile = 64;
  // amax over the bit patterns of |x|: integer order equals float order for non-negative floats, and every NaN
  // pattern sorts above +inf, so a NaN anywhere gives a NaN amax, as jnp.max does.
  uint32_t amax_bits = 0;
  if (dbias != nullptr) std::fill(dbias, dbias + v.cols, 0.0f);
  for (int64_t b = 0; b < v.batch; ++b) {
    for (int64_t r0 = 0; r0 < v.rows; r0 += kTile) {
      const int64_t r1 = std::min(r0 + kTile, v.rows);
      for (int64_t c0 = 0; c0 < v.cols; c0 += kTile) {
        const int64_t c1 = std::min(c0 + kTile, v.cols);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t row = (b * v.rows + r) * v.cols;
          for (int64_t c = c0; c < c1; ++c) {
            const float x = load(row + c);
            amax_bits = std::max(amax_bits, FloatToBits(x) & 0x7FFFFFFFu);
            const uint8_t bits = ScaledToFp8(x, scale, fmt);
            q[row + c] = bits;
            if (qt != nullptr) qt[(b * v.cols + t.Row(c)) * v.rows + r] = bits;
            if (dbias != nullptr) dbias[c] += x;
          }
        }
      }
    }
  }
  *amax_out = BitsToFloat(amax_bits);
  return ffi::Error::Success();
}

ffi::Error QuantizeCpu(ffi::AnyBuffer x, ffi::BufferR0<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> q,
                       ffi::Result<ffi::AnyBuffer> qt, ffi::Result<ffi::BufferR0<ffi::F32>> amax,
                       ffi::Result<ffi::AnyBuffer> dbias, int64_t batch_ndim, int64_t t_parts, int64_t t_group) {
  auto view = MakeQuantizeView(x.dimensions(), batch_ndim);
  if (view.has_error()) return view.error();
  auto trows = MakeTransposedRows(view->cols, t_parts, t_group);
  if (trows.has_error()) return trows.error();
  const Fp8Format* fmt = nullptr;
  switch (q->element_type()) {
    case ffi::DataType::F8E4M3FN: fmt = &kE4M3; break;
    case ffi::DataType::F8E5M2: fmt = &kE5M2; break;
    default: return ffi::Error::InvalidArgument("quantize: q must be float8_e4m3fn or float8_e5m2");
  }
  const bool want_t = qt->element_count() > 0;
  const bool want_dbias = dbias->element_count() > 0;
  if (want_t && qt->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("quantize: qt must be empty or hold as many elements as x");
  }
  if (want_dbias && (dbias->element_type() != ffi::DataType::F32 || dbias->element_count() != view->cols)) {
    return ffi::Error::InvalidArgument("quantize: dbias must be empty or f32[cols]");
  }
  const float s = *scale.typed_data();
  auto* q_ptr = static_cast<uint8_t*>(q->untyped_data());
  auto* qt_ptr = want_t ? static_cast<uint8_t*>(qt->untyped_data()) : nullptr;
  auto* db_ptr = want_dbias ? static_cast<float*>(dbias->untyped_data()) : nullptr;
  float* amax_ptr = amax->typed_data();
  switch (x.element_type()) {
    case ffi::DataType::F32: {
      const float* p = static_cast<const float*>(x.untyped_data());
      return QuantizeLoop([p](int64_t i) { return p[i]; }, *view, *trows, s, *fmt, q_ptr, qt_ptr, amax_ptr,
                          db_ptr);
    }
    case ffi::DataType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(x.untyped_data());
      return QuantizeLoop([p](int64_t i) { return Bf16ToFloat(p[i]); }, *view, *trows, s, *fmt, q_ptr, qt_ptr,
                          amax_ptr, db_ptr);
    }
    case ffi::DataType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(x.untyped_data());
      return QuantizeLoop([p](int64_t i) { return F16ToFloat(p[i]); }, *view, *trows, s, *fmt, q_ptr, qt_ptr,
                          amax_ptr, db_ptr);
    }
    default:
      return ffi::Error::InvalidArgument("quantize: x must be float32, bfloat16 or float16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeCpuHandler, QuantizeCpu, QuantizeAttrs(QuantizeOperands(ffi::Ffi::Bind())));

}  // namespace te_jax
