// CPU handlers for te_norm_fwd and te_norm_bwd: LayerNorm/RMSNorm over the last dim, forward (high-precision or
// FP8 output with amax and the transposed copy) and backward (dx, dgamma, dbeta).
//
// The row sums are accumulated in double and rounded once, so the statistics are at least as accurate as the
// float32 reference's. Everything after them is float32 and elementwise, written to be bitwise equal to
// te_jax.ops.norm.norm_apply_ref given the same mean and rsigma: LayerNorm's last step is one fused multiply-add
// (std::fma), as XLA compiles it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "te_jax/host_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

// float32 -> bfloat16, round to nearest even (XLA's convert); NaN stays NaN.
uint16_t FloatToBf16(float f) {
  const uint32_t b = FloatToBits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// float32 -> float16, round to nearest even; beyond the largest finite value (65504) rounds to inf.
uint16_t FloatToF16(float f) {
  const uint32_t b = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t mag = b & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (mag >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520, the tie above 65504: inf
  if (mag < 0x38800000u) {                        // below 2^-14: a multiple of the subnormal step 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(BitsToFloat(mag) * 16777216.0f));
  }
  const uint32_t rounded = mag + 0xFFFu + ((mag >> 13) & 1u) - ((127u - 15u) << 23);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

// Reads element i of a float32/bfloat16/float16 buffer as float32.
class Reader {
 public:
  Reader(const ffi::AnyBuffer& b) : type_(b.element_type()), data_(b.untyped_data()) {}
  bool ok() const { return type_ == ffi::DataType::F32 || type_ == ffi::DataType::BF16 || type_ == ffi::DataType::F16; }
  float operator()(int64_t i) const {
    switch (type_) {
      case ffi::DataType::F32: return static_cast<const float*>(data_)[i];
      case ffi::DataType::BF16: return Bf16ToFloat(static_cast<const uint16_t*>(data_)[i]);
      default: return F16ToFloat(static_cast<const uint16_t*>(data_)[i]);
    }
  }

 private:
  ffi::DataType type_;
  const void* data_;
};

// Writes float32 values to a float32/bfloat16/float16/FP8 buffer; FP8 gets value * scale, saturating.
class Writer {
 public:
  Writer(ffi::Result<ffi::AnyBuffer>& b, float scale)
      : type_(b->element_type()), data_(b->untyped_data()), scale_(scale) {}
  bool ok() const {
    return type_ == ffi::DataType::F32 || type_ == ffi::DataType::BF16 || type_ == ffi::DataType::F16 || fp8();
  }
  bool fp8() const { return type_ == ffi::DataType::F8E4M3FN || type_ == ffi::DataType::F8E5M2; }
  // Stores v at i; for FP8 returns the byte written (for the transposed copy).
  uint8_t operator()(int64_t i, float v) const {
    switch (type_) {
      case ffi::DataType::F32: static_cast<float*>(data_)[i] = v; return 0;
      case ffi::DataType::BF16: static_cast<uint16_t*>(data_)[i] = FloatToBf16(v); return 0;
      case ffi::DataType::F16: static_cast<uint16_t*>(data_)[i] = FloatToF16(v); return 0;
      default: {
        const uint8_t q = FloatToFp8(v * scale_, type_ == ffi::DataType::F8E4M3FN ? kE4M3 : kE5M2);
        static_cast<uint8_t*>(data_)[i] = q;
        return q;
      }
    }
  }

 private:
  ffi::DataType type_;
  void* data_;
  float scale_;
};

int64_t Cols(const ffi::AnyBuffer& x) {
  auto dims = x.dimensions();
  return dims.size() == 0 ? 0 : dims.back();
}

// element_count() as a signed count, to compare with dims.
template <typename B>
int64_t Count(const B& b) {
  return static_cast<int64_t>(b.element_count());
}

ffi::Error NormFwdCpu(ffi::AnyBuffer x, ffi::BufferR1<ffi::F32> gamma, ffi::BufferR0<ffi::F32> scale,
                      ffi::BufferR1<ffi::F32> beta, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_t,
                      ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> mean,
                      ffi::Result<ffi::AnyBuffer> rsigma, bool rmsnorm, float epsilon, bool zero_centered_gamma) {
  const Reader load(x);
  const Writer store(out, *scale.typed_data());
  const int64_t cols = Cols(x);
  if (!load.ok() || cols < 1) return ffi::Error::InvalidArgument("norm_fwd: x must be f32/bf16/f16, last dim >= 1");
  if (!store.ok()) return ffi::Error::InvalidArgument("norm_fwd: out must be f32/bf16/f16/f8e4m3fn/f8e5m2");
  const int64_t rows = Count(x) / cols;
  const bool want_t = Count(*out_t) > 0;
  if (Count(*out) != Count(x) || Count(gamma) != cols ||
      Count(beta) != (rmsnorm ? 0 : cols) || Count(*rsigma) != rows ||
      Count(*mean) != (rmsnorm ? 0 : rows) || Count(*amax) != (store.fp8() ? 1 : 0) ||
      (want_t && (!store.fp8() || Count(*out_t) != Count(x)))) {
    return ffi::Error::InvalidArgument("norm_fwd: operand or result sizes do not match x");
  }
  const float* g_in = gamma.typed_data();
  const float* b_in = beta.typed_data();
  auto* mean_out = static_cast<float*>(mean->untyped_data());
  auto* rsigma_out = static_cast<float*>(rsigma->untyped_data());
  auto* qt = static_cast<uint8_t*>(out_t->untyped_data());
  std::vector<float> g(cols), row(cols);
  for (int64_t c = 0; c < cols; ++c) g[c] = zero_centered_gamma ? g_in[c] + 1.0f : g_in[c];
  // amax over the bit patterns of |y|, as quantize does: a NaN anywhere gives a NaN amax.
  uint32_t amax_bits = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) row[c] = load(r * cols + c);
    double mu = 0.0;
    if (!rmsnorm) {
      for (int64_t c = 0; c < cols; ++c) mu += row[c];
      mu /= static_cast<double>(cols);
    }
    double var = 0.0;
    for (int64_t c = 0; c < cols; ++c) var += (row[c] - mu) * (row[c] - mu);
    var /= static_cast<double>(cols);
    const float m = static_cast<float>(mu);
    const float rs = static_cast<float>(1.0 / std::sqrt(var + static_cast<double>(epsilon)));
    if (!rmsnorm) mean_out[r] = m;
    rsigma_out[r] = rs;
    for (int64_t c = 0; c < cols; ++c) {
      const float y = rmsnorm ? (row[c] * rs) * g[c] : std::fma((row[c] - m) * rs, g[c], b_in[c]);
      amax_bits = std::max(amax_bits, FloatToBits(y) & 0x7FFFFFFFu);
      const uint8_t q = store(r * cols + c, y);
      if (want_t) qt[c * rows + r] = q;
    }
  }
  if (store.fp8()) *static_cast<float*>(amax->untyped_data()) = BitsToFloat(amax_bits);
  return ffi::Error::Success();
}

ffi::Error NormBwdCpu(ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer rsigma, ffi::BufferR1<ffi::F32> gamma,
                      ffi::AnyBuffer mean, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::BufferR1<ffi::F32>> dgamma,
                      ffi::Result<ffi::BufferR1<ffi::F32>> dbeta, bool rmsnorm, bool zero_centered_gamma) {
  const Reader load_x(x), load_dz(dz);
  const Writer store_dx(dx, 1.0f);
  const int64_t cols = Cols(x);
  if (!load_x.ok() || cols < 1 || dx->element_type() != x.element_type() ||
      (dz.element_type() != x.element_type() && dz.element_type() != ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument("norm_bwd: x and dx f32/bf16/f16 (last dim >= 1), dz like x or f32");
  }
  const int64_t rows = Count(x) / cols;
  if (Count(dz) != Count(x) || Count(*dx) != Count(x) ||
      rsigma.element_type() != ffi::DataType::F32 || Count(rsigma) != rows ||
      mean.element_type() != ffi::DataType::F32 || Count(mean) != (rmsnorm ? 0 : rows) ||
      Count(gamma) != cols || Count(*dgamma) != cols ||
      Count(*dbeta) != (rmsnorm ? 0 : cols)) {
    return ffi::Error::InvalidArgument("norm_bwd: operand or result sizes do not match x");
  }
  const float* rs_in = static_cast<const float*>(rsigma.untyped_data());
  const float* mean_in = static_cast<const float*>(mean.untyped_data());
  std::vector<float> g(cols), xhat(cols), dy(cols);
  std::vector<double> dg(cols, 0.0), db(cols, 0.0);
  for (int64_t c = 0; c < cols; ++c) g[c] = zero_centered_gamma ? gamma.typed_data()[c] + 1.0f : gamma.typed_data()[c];
  const double n = static_cast<double>(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float rs = rs_in[r];
    const float m = rmsnorm ? 0.0f : mean_in[r];
    double s1 = 0.0, s2 = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const float d = load_dz(r * cols + c);
      xhat[c] = rmsnorm ? load_x(r * cols + c) * rs : (load_x(r * cols + c) - m) * rs;
      dy[c] = d * g[c];
      s1 += dy[c];
      s2 += static_cast<double>(dy[c]) * xhat[c];
      db[c] += d;
      dg[c] += static_cast<double>(d) * xhat[c];
    }
    const float c1 = rmsnorm ? 0.0f : static_cast<float>(s1 / n);
    const float c2 = static_cast<float>(s2 / n);
    for (int64_t c = 0; c < cols; ++c) store_dx(r * cols + c, ((dy[c] - c1) - xhat[c] * c2) * rs);
  }
  for (int64_t c = 0; c < cols; ++c) dgamma->typed_data()[c] = static_cast<float>(dg[c]);
  if (!rmsnorm) {
    for (int64_t c = 0; c < cols; ++c) dbeta->typed_data()[c] = static_cast<float>(db[c]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NormFwdCpuHandler, NormFwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()               // x: f32/bf16/f16, rank >= 1
                                  .Arg<ffi::BufferR1<ffi::F32>>()     // gamma: (cols,)
                                  .Arg<ffi::BufferR0<ffi::F32>>()     // scale: multiplies y before an FP8 cast
                                  .Arg<ffi::BufferR1<ffi::F32>>()     // beta: (cols,), empty for RMSNorm
                                  .Ret<ffi::AnyBuffer>()               // out: x's shape, f32/bf16/f16 or FP8
                                  .Ret<ffi::AnyBuffer>()               // out_t: FP8 (cols, rows), or empty
                                  .Ret<ffi::AnyBuffer>()               // amax: f32 max |y| (FP8), or empty
                                  .Ret<ffi::AnyBuffer>()               // mean: f32 per row, empty for RMSNorm
                                  .Ret<ffi::AnyBuffer>()               // rsigma: f32 per row
                                  .Attr<bool>("rmsnorm")               // RMSNorm instead of LayerNorm
                                  .Attr<float>("epsilon")              // added to the variance
                                  .Attr<bool>("zero_centered_gamma"));  // multiply by gamma + 1

XLA_FFI_DEFINE_HANDLER_SYMBOL(NormBwdCpuHandler, NormBwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()                 // dz: x's shape, x's type or f32
                                  .Arg<ffi::AnyBuffer>()                 // x: the forward input
                                  .Arg<ffi::AnyBuffer>()                 // rsigma: f32 per row
                                  .Arg<ffi::BufferR1<ffi::F32>>()       // gamma: (cols,)
                                  .Arg<ffi::AnyBuffer>()                 // mean: f32 per row, empty for RMSNorm
                                  .Ret<ffi::AnyBuffer>()                 // dx: x's shape and type
                                  .Ret<ffi::BufferR1<ffi::F32>>()       // dgamma: (cols,)
                                  .Ret<ffi::BufferR1<ffi::F32>>()       // dbeta: (cols,), empty for RMSNorm
                                  .Attr<bool>("rmsnorm")                 // RMSNorm instead of LayerNorm
                                  .Attr<bool>("zero_centered_gamma"));  // the forward multiplied by gamma + 1

}  // namespace te_jax
