// Scalar conversions for the CPU handlers: bf16/f16 -> f32 and f32 -> FP8 (E4M3FN, E5M2), round to nearest even.
// They reproduce what XLA's `convert` does on these types (ml_dtypes semantics), so that the CPU handlers are
// bitwise equal to the pure-JAX reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace te_jax {

inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return BitsToFloat(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  // Subnormal (or zero): mant * 2^-24, exact in f32.
  const float mag = std::ldexp(static_cast<float>(mant), -24);
  return sign ? -mag : mag;
}

// An FP8 format: stored mantissa bits, exponent bias, smallest normal exponent, largest finite value and its bits.
struct Fp8Format {
  int mant_bits;
  int bias;
  int min_normal_exp;
  float max_finite;
  uint8_t max_bits;
  uint8_t nan_bits;  // the NaN this code writes (sign bit added separately)
};
inline constexpr Fp8Format kE4M3{3, 7, -6, 448.0f, 0x7E, 0x7F};
inline constexpr Fp8Format kE5M2{2, 15, -14, 57344.0f, 0x7B, 0x7E};

// Saturating cast: NaN -> NaN, |v| > max -> +-max (inf included), otherwise round to nearest even.
inline uint8_t FloatToFp8(float v, const Fp8Format& fmt) {
  const uint8_t sign = (FloatToBits(v) >> 24) & 0x80u;
  if (std::isnan(v)) return sign | fmt.nan_bits;
  float a = std::fabs(v);
  if (a >= fmt.max_finite) return sign | fmt.max_bits;
  if (a == 0.0f) return sign;
  // Quantum (spacing of representable values) at a's binade, clamped to the subnormal spacing.
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int exp = std::max(e - 1, fmt.min_normal_exp);
  const float quantum = std::ldexp(1.0f, exp - fmt.mant_bits);
  // a / quantum is exact (power-of-two scaling); nearbyint rounds half to even in the default rounding mode.
  const float r = std::nearbyint(a / quantum) * quantum;
  if (r == 0.0f) return sign;
  std::frexp(r, &e);
  const int r_exp = e - 1;
  if (r_exp < fmt.min_normal_exp) {  // subnormal: exponent field 0
    const uint32_t mant = static_cast<uint32_t>(std::ldexp(r, -(fmt.min_normal_exp - fmt.mant_bits)));
    return sign | static_cast<uint8_t>(mant);
  }
  const uint32_t exp_field = static_cast<uint32_t>(r_exp + fmt.bias);
  const uint32_t mant =
      static_cast<uint32_t>(std::ldexp(r, fmt.mant_bits - r_exp)) - (1u << fmt.mant_bits);  // drop the implicit 1
  return sign | static_cast<uint8_t>((exp_field << fmt.mant_bits) | mant);
}

}  // namespace te_jax
