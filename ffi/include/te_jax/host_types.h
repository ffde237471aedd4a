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

// Saturating cast: NaN -> NaN, |v| >= max -> +-max (inf included: ScaledToFp8 below sends an inf input to NaN),
// otherwise round to nearest even. Bit arithmetic and one float rounding, no libm calls (~3 ns an element): checked
// equal to a frexp/ldexp/nearbyint formulation on every bfloat16 value and every 7th float32 bit pattern.
inline uint8_t FloatToFp8(float v, const Fp8Format& fmt) {
  const uint32_t bits = FloatToBits(v);
  const uint8_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return sign | fmt.nan_bits;
  const float a = BitsToFloat(abs_bits);
  if (a >= fmt.max_finite) return sign | fmt.max_bits;
  // The binade's exponent, clamped to the smallest normal one (below it FP8 is subnormal, with a fixed quantum).
  int exp = std::max(static_cast<int>(abs_bits >> 23) - 127, fmt.min_normal_exp);
  // a / quantum, exactly (a power-of-two scaling): in [2^m, 2^(m+1)) for normals, [0, 2^m) for subnormals.
  const float r = a * BitsToFloat(static_cast<uint32_t>(127 + fmt.mant_bits - exp) << 23);
  constexpr float kRound = 8388608.0f;  // 2^23: adding and subtracting it rounds r (< 2^23) to an integer, half to even
  uint32_t q = static_cast<uint32_t>((r + kRound) - kRound);
  if (q < (1u << fmt.mant_bits)) return sign | static_cast<uint8_t>(q);  // subnormal (or zero): exponent field 0
  if (q == (2u << fmt.mant_bits)) {  // rounded up into the next binade
    ++exp;
    q = 1u << fmt.mant_bits;
  }
  const uint32_t exp_field = static_cast<uint32_t>(exp + fmt.bias);
  return sign | static_cast<uint8_t>((exp_field << fmt.mant_bits) | (q - (1u << fmt.mant_bits)));
}

// The FP8 cast every CPU handler makes (te_jax.ops.quantize.saturating_cast): x * scale saturating, and the format's
// positive NaN where x is +-inf or NaN (E4M3 has no inf; a clamp would turn an inf into +-max and hide it). The test is
// on x, not on the product: a finite x whose product overflows float32 still saturates.
inline uint8_t ScaledToFp8(float x, float scale, const Fp8Format& fmt) {
  if ((FloatToBits(x) & 0x7FFFFFFFu) >= 0x7F800000u) return fmt.nan_bits;
  return FloatToFp8(x * scale, fmt);
}

}  // namespace te_jax
