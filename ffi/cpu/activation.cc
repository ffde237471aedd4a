// CPU handlers for te_act_fwd / te_act_bwd: the activation (or its gradient) in float32, then either the FP8 cast
// of te_quantize (saturating cast of y * scale, amax = max|y| on bit patterns, transposed copy, dbias) or a plain
// float32/bfloat16/float16 result. The formulas are activation_math.h's; this file only walks the arrays.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "te_jax/activation_math.h"
#include "te_jax/activation_view.h"
#include "te_jax/host_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

uint16_t FloatToBf16(float f) {
  const uint32_t bits = FloatToBits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN, sign kept
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);  // round to nearest even
}

uint16_t FloatToF16(float f) {
  const _Float16 h = static_cast<_Float16>(f);  // round to nearest even, as XLA's convert
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}

// Where the float32 results go. Element (b, r, f) of the result, f < out_cols, is written row-major; the FP8 path
// also writes the transposed copy (b, f, r), amax and dbias.
class Sink {
 public:
  Sink(const ActivationView& v, int64_t out_cols, ffi::Result<ffi::AnyBuffer>& out,
       ffi::Result<ffi::AnyBuffer>& out_t, float scale, float* dbias)
      : rows_(v.rows), out_cols_(out_cols), type_(out->element_type()), out_(out->untyped_data()),
        out_t_(out_t->element_count() > 0 ? static_cast<uint8_t*>(out_t->untyped_data()) : nullptr),
        scale_(scale), dbias_(dbias) {
    if (type_ == ffi::DataType::F8E4M3FN) fmt_ = &kE4M3;
    if (type_ == ffi::DataType::F8E5M2) fmt_ = &kE5M2;
    if (dbias_ != nullptr) std::fill(dbias_, dbias_ + out_cols_, 0.0f);
  }

  void Put(int64_t b, int64_t r, int64_t f, float y) {
    const int64_t i = (b * rows_ + r) * out_cols_ + f;
    if (dbias_ != nullptr) dbias_[f] += y;
    if (fmt_ != nullptr) {
      // amax over the bit patterns of |y|: every NaN sorts above +inf, so a NaN gives a NaN amax.
      amax_bits_ = std::max(amax_bits_, FloatToBits(y) & 0x7FFFFFFFu);
      const uint8_t bits = ScaledToFp8(y, scale_, *fmt_);
      static_cast<uint8_t*>(out_)[i] = bits;
      if (out_t_ != nullptr) out_t_[(b * out_cols_ + f) * rows_ + r] = bits;
      return;
    }
    switch (type_) {
      case ffi::DataType::F32: static_cast<float*>(out_)[i] = y; break;
      case ffi::DataType::BF16: static_cast<uint16_t*>(out_)[i] = FloatToBf16(y); break;
      default: static_cast<uint16_t*>(out_)[i] = FloatToF16(y); break;
    }
  }

  float amax() const { return BitsToFloat(amax_bits_); }

 private:
  int64_t rows_, out_cols_;
  ffi::DataType type_;
  void* out_;
  uint8_t* out_t_;
  const Fp8Format* fmt_ = nullptr;
  float scale_;
  float* dbias_;
  uint32_t amax_bits_ = 0;
};

// Calls f(loader) with a loader for `buffer`'s dtype: element i as float32.
template <typename F>
ffi::Error WithLoader(const ffi::AnyBuffer& buffer, F&& f) {
  switch (buffer.element_type()) {
    case ffi::DataType::F32: {
      const float* p = static_cast<const float*>(buffer.untyped_data());
      return f([p](int64_t i) { return p[i]; });
    }
    case ffi::DataType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(buffer.untyped_data());
      return f([p](int64_t i) { return Bf16ToFloat(p[i]); });
    }
    case ffi::DataType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(buffer.untyped_data());
      return f([p](int64_t i) { return F16ToFloat(p[i]); });
    }
    default:
      return ffi::Error::InvalidArgument("activation: inputs must be float32, bfloat16 or float16");
  }
}

ffi::Error ActFwdCpu(ffi::AnyBuffer x, ffi::BufferR0<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> out_t, ffi::Result<ffi::BufferR0<ffi::F32>> amax, int64_t act,
                     bool gated, int64_t batch_ndim, int64_t gate, float limit, float alpha,
                     float glu_linear_offset) {
  auto view = MakeActivationView(x.dimensions(), gated, batch_ndim);
  if (view.has_error()) return view.error();
  const ActivationView v = *view;
  if (auto err = CheckActivationOutputs(*out, *out_t, v.out_elements()); err.failure()) return err;
  Sink sink(v, v.cols, out, out_t, *scale.typed_data(), nullptr);
  const ActParams params{limit, alpha, glu_linear_offset};
  auto err = WithLoader(x, [&](auto load) {
    return DispatchActivation(act, gated, gate, [&](auto a, auto h) {
      constexpr Act kAct = decltype(a)::value;
      constexpr Act kGate = decltype(h)::value;
      constexpr bool kGated = kGate != Act::kNone;
      for (int64_t b = 0; b < v.batch; ++b) {
        for (int64_t r = 0; r < v.rows; ++r) {
          const int64_t row = (b * v.rows + r) * v.halves() * v.cols;
          for (int64_t c = 0; c < v.cols; ++c) {
            const float xb = kGated ? load(row + v.cols + c) : 0.0f;
            sink.Put(b, r, c, Forward<kAct, kGate>(load(row + c), xb, params));
          }
        }
      }
      return ffi::Error::Success();
    });
  });
  *amax->typed_data() = sink.amax();
  return err;
}

ffi::Error ActBwdCpu(ffi::AnyBuffer g, ffi::AnyBuffer x, ffi::BufferR0<ffi::F32> scale,
                     ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dx_t,
                     ffi::Result<ffi::BufferR0<ffi::F32>> amax, ffi::Result<ffi::AnyBuffer> dbias, int64_t act,
                     bool gated, int64_t batch_ndim, int64_t gate, float limit, float alpha,
                     float glu_linear_offset) {
  auto view = CheckActivationBwd(g, x, *dx, *dx_t, *dbias, gated, batch_ndim);
  if (view.has_error()) return view.error();
  const ActivationView v = *view;
  const int64_t out_cols = v.halves() * v.cols;
  const bool want_dbias = dbias->element_count() > 0;
  float* db = want_dbias ? static_cast<float*>(dbias->untyped_data()) : nullptr;
  Sink sink(v, out_cols, dx, dx_t, *scale.typed_data(), db);
  const ActParams params{limit, alpha, glu_linear_offset};
  auto err = WithLoader(x, [&](auto load) {
    return WithLoader(g, [&](auto load_g) {  // g has x's dtype
      return DispatchActivation(act, gated, gate, [&](auto a, auto h) {
        constexpr Act kAct = decltype(a)::value;
        constexpr Act kGate = decltype(h)::value;
        constexpr bool kGated = kGate != Act::kNone;
        for (int64_t b = 0; b < v.batch; ++b) {
          for (int64_t r = 0; r < v.rows; ++r) {
            const int64_t row = (b * v.rows + r) * out_cols;
            const int64_t g_row = (b * v.rows + r) * v.cols;
            for (int64_t c = 0; c < v.cols; ++c) {
              float da = 0.0f, db_ = 0.0f;
              const float xb = kGated ? load(row + v.cols + c) : 0.0f;
              Backward<kAct, kGate>(load_g(g_row + c), load(row + c), xb, da, db_, params);
              sink.Put(b, r, c, da);
              if (kGated) sink.Put(b, r, v.cols + c, db_);
            }
          }
        }
        return ffi::Error::Success();
      });
    });
  });
  *amax->typed_data() = sink.amax();
  return err;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActFwdCpuHandler, ActFwdCpu, ActAttrs(ActFwdOperands(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActBwdCpuHandler, ActBwdCpu, ActAttrs(ActBwdOperands(ffi::Ffi::Bind())));

}  // namespace te_jax
