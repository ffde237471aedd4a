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
#include "te_jax/norm_view.h"
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

// Calls f with a reader `float(int64_t i)` for x's element type (f32, bf16, f16); false for any other type. The
// per-type lambdas let each loop below compile without a type switch per element.
template <typename F>
bool WithReader(const ffi::AnyBuffer& b, F&& f) {
  const void* p = b.untyped_data();
  switch (b.element_type()) {
    case ffi::DataType::F32: f([p](int64_t i) { return static_cast<const float*>(p)[i]; }); return true;
    case ffi::DataType::BF16: f([p](int64_t i) { return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]); }); return true;
    case ffi::DataType::F16: f([p](int64_t i) { return F16ToFloat(static_cast<const uint16_t*>(p)[i]); }); return true;
    default: return false;
  }
}

// Calls f with a writer `uint8_t(int64_t i, float v)` for the buffer's element type (f32, bf16, f16, or FP8 with
// v * scale cast saturating, NaN for a non-finite v, returning the FP8 byte for the transposed copy); false for any
// other type.
template <typename F>
bool WithWriter(ffi::Result<ffi::AnyBuffer>& b, float scale, F&& f) {
  void* p = b->untyped_data();
  switch (b->element_type()) {
    case ffi::DataType::F32:
      f([p](int64_t i, float v) { return static_cast<float*>(p)[i] = v, uint8_t{0}; });
      return true;
    case ffi::DataType::BF16:
      f([p](int64_t i, float v) { return static_cast<uint16_t*>(p)[i] = FloatToBf16(v), uint8_t{0}; });
      return true;
    case ffi::DataType::F16:
      f([p](int64_t i, float v) { return static_cast<uint16_t*>(p)[i] = FloatToF16(v), uint8_t{0}; });
      return true;
    case ffi::DataType::F8E4M3FN:
      f([p, scale](int64_t i, float v) { return static_cast<uint8_t*>(p)[i] = ScaledToFp8(v, scale, kE4M3); });
      return true;
    case ffi::DataType::F8E5M2:
      f([p, scale](int64_t i, float v) { return static_cast<uint8_t*>(p)[i] = ScaledToFp8(v, scale, kE5M2); });
      return true;
    default:
      return false;
  }
}

// sum(v - shift) or sum((v - shift)^2) in double, over 8 interleaved partial sums: independent additions run in
// parallel instead of waiting on one another (a single chain costs ~4 cycles per element).
double RowSum(const float* v, int64_t n, double shift, bool squares) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (int k = 0; k < 8; ++k) {
      const double d = v[c + k] - shift;
      acc[k] += squares ? d * d : d;
    }
  }
  for (; c < n; ++c) {
    const double d = v[c] - shift;
    acc[c % 8] += squares ? d * d : d;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

struct FwdRows {
  int64_t rows, cols;
  bool rmsnorm;
  float epsilon;
  const float* g;  // gamma
  const float* beta;
  float* mean;     // LayerNorm only
  float* rsigma;
  uint8_t* qt;     // the transposed FP8 copy, or null
};

// Returns the amax bits of y (meaningful for FP8 outputs).
template <typename Load, typename Store>
uint32_t NormFwdLoop(const FwdRows& a, Load load, Store store) {
  std::vector<float> row(a.cols);
  // amax over the bit patterns of |y|, as quantize does: a NaN anywhere gives a NaN amax.
  uint32_t amax_bits = 0;
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t c = 0; c < a.cols; ++c) row[c] = load(r * a.cols + c);
    const double mu = a.rmsnorm ? 0.0 : RowSum(row.data(), a.cols, 0.0, false) / static_cast<double>(a.cols);
    const double var = RowSum(row.data(), a.cols, mu, true) / static_cast<double>(a.cols);
    const float m = static_cast<float>(mu);
    const float rs = static_cast<float>(1.0 / std::sqrt(var + static_cast<double>(a.epsilon)));
    if (!a.rmsnorm) a.mean[r] = m;
    a.rsigma[r] = rs;
    for (int64_t c = 0; c < a.cols; ++c) {
      const float y = a.rmsnorm ? (row[c] * rs) * a.g[c] : std::fma((row[c] - m) * rs, a.g[c], a.beta[c]);
      amax_bits = std::max(amax_bits, FloatToBits(y) & 0x7FFFFFFFu);
      const uint8_t q = store(r * a.cols + c, y);
      if (a.qt != nullptr) a.qt[c * a.rows + r] = q;
    }
  }
  return amax_bits;
}

ffi::Error NormFwdCpu(ffi::AnyBuffer x, ffi::BufferR1<ffi::F32> gamma, ffi::BufferR0<ffi::F32> scale,
                      ffi::BufferR1<ffi::F32> beta, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_t,
                      ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> mean,
                      ffi::Result<ffi::AnyBuffer> rsigma, bool rmsnorm, float epsilon) {
  auto shape = CheckNormFwd(x, Count(gamma), Count(beta), *out, *out_t, *amax, *mean, *rsigma, rmsnorm);
  if (shape.has_error()) return shape.error();
  const auto [rows, cols, fp8, want_t] = *shape;
  const FwdRows a{rows, cols, rmsnorm, epsilon, gamma.typed_data(), beta.typed_data(),
                  static_cast<float*>(mean->untyped_data()), static_cast<float*>(rsigma->untyped_data()),
                  want_t ? static_cast<uint8_t*>(out_t->untyped_data()) : nullptr};
  uint32_t amax_bits = 0;
  bool out_ok = true;
  const bool x_ok = WithReader(x, [&](auto load) {
    out_ok = WithWriter(out, *scale.typed_data(), [&](auto store) { amax_bits = NormFwdLoop(a, load, store); });
  });
  if (!x_ok) return ffi::Error::InvalidArgument("norm_fwd: x must be float32, bfloat16 or float16");
  if (!out_ok) return ffi::Error::InvalidArgument("norm_fwd: out must be f32/bf16/f16/f8e4m3fn/f8e5m2");
  if (fp8) *static_cast<float*>(amax->untyped_data()) = BitsToFloat(amax_bits);
  return ffi::Error::Success();
}

struct BwdRows {
  int64_t rows, cols;
  bool rmsnorm;
  const float* g;  // gamma
  const float* mean;
  const float* rsigma;
  float* dgamma;
  float* dbeta;
};

template <typename LoadX, typename LoadDz, typename LoadRes, typename Store>
void NormBwdLoop(const BwdRows& a, LoadX load_x, LoadDz load_dz, LoadRes load_res, Store store) {
  std::vector<float> xhat(a.cols), dy(a.cols);
  std::vector<double> dg(a.cols, 0.0), db(a.cols, 0.0);
  const double n = static_cast<double>(a.cols);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float rs = a.rsigma[r];
    const float m = a.rmsnorm ? 0.0f : a.mean[r];
    double s1 = 0.0, s2 = 0.0;
    for (int64_t c = 0; c < a.cols; ++c) {
      const float d = load_dz(r * a.cols + c);
      const float xv = load_x(r * a.cols + c);
      xhat[c] = a.rmsnorm ? xv * rs : (xv - m) * rs;
      dy[c] = d * a.g[c];
      s1 += dy[c];
      s2 += static_cast<double>(dy[c]) * xhat[c];
      db[c] += d;
      dg[c] += static_cast<double>(d) * xhat[c];
    }
    const float c1 = a.rmsnorm ? 0.0f : static_cast<float>(s1 / n);
    const float c2 = static_cast<float>(s2 / n);
    for (int64_t c = 0; c < a.cols; ++c) {
      const int64_t i = r * a.cols + c;
      store(i, ((dy[c] - c1) - xhat[c] * c2) * rs + load_res(i));
    }
  }
  for (int64_t c = 0; c < a.cols; ++c) a.dgamma[c] = static_cast<float>(dg[c]);
  if (!a.rmsnorm) {
    for (int64_t c = 0; c < a.cols; ++c) a.dbeta[c] = static_cast<float>(db[c]);
  }
}

ffi::Error NormBwdCpu(ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer rsigma, ffi::BufferR1<ffi::F32> gamma,
                      ffi::AnyBuffer mean, ffi::AnyBuffer dres, ffi::Result<ffi::AnyBuffer> dx,
                      ffi::Result<ffi::BufferR1<ffi::F32>> dgamma, ffi::Result<ffi::BufferR1<ffi::F32>> dbeta,
                      bool rmsnorm) {
  auto shape =
      CheckNormBwd(dz, x, rsigma, Count(gamma), mean, dres, *dx, Count(*dgamma), Count(*dbeta), rmsnorm);
  if (shape.has_error()) return shape.error();
  const int64_t rows = shape->rows, cols = shape->cols;
  const BwdRows a{rows, cols, rmsnorm, gamma.typed_data(), static_cast<const float*>(mean.untyped_data()),
                  static_cast<const float*>(rsigma.untyped_data()), dgamma->typed_data(), dbeta->typed_data()};
  bool ok = WithReader(x, [&](auto load_x) {
    WithReader(dz, [&](auto load_dz) {
      WithWriter(dx, 1.0f, [&](auto store) {
        if (Count(dres) == 0) {
          NormBwdLoop(a, load_x, load_dz, [](int64_t) { return 0.0f; }, store);
        } else {
          WithReader(dres, [&](auto load_res) { NormBwdLoop(a, load_x, load_dz, load_res, store); });
        }
      });
    });
  });
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument("norm_bwd: x must be float32, bfloat16 or float16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NormFwdCpuHandler, NormFwdCpu, NormFwdSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NormBwdCpuHandler, NormBwdCpu, NormBwdAttrs(NormBwdOperands(ffi::Ffi::Bind())));

}  // namespace te_jax
