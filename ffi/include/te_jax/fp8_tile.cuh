// Device helpers of the FP8 cast kernels (quantize.cu, activation.cuh, norm_fwd.cu): packed FP8 conversion, the block amax on bit
// patterns, the byte gather of the 8x8 register transpose, and the fixed-order dbias column sum.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace te_jax {

template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint32_t Cvt4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFmt);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kFmt);
  return lo | (hi << 16);
}

// The input of the FP8 cast (te_jax.ops.quantize.saturating_cast): x * s, or NaN where x is +-inf or NaN. The
// conversion saturates (__NV_SATFINITE), which would turn an inf into +-max, a finite value training goes on with;
// E4M3 has no inf, so every non-finite x becomes NaN (in E5M2 too: one convention). The test is on x, not on the
// product, so a finite x whose product overflows still saturates as before. One compare and one select per element,
// in the same pass (the multiply is the one the kernels always made: __fmul_rn keeps it uncontracted).
__device__ __forceinline__ float Fp8Input(float x, float s) {
  return fabsf(x) <= 3.40282347e38f ? __fmul_rn(x, s) : __int_as_float(0x7FFFFFFF);
}

// The FP8 bytes of y[0..3] * s (NaN where y is not finite), packed little-endian.
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint32_t CastScaled4(const float* y, float s) {
  return Cvt4<kFmt>(Fp8Input(y[0], s), Fp8Input(y[1], s), Fp8Input(y[2], s), Fp8Input(y[3], s));
}

// The FP8 byte of y * s (NaN where y is not finite).
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint8_t CastScaled(float y, float s) {
  return __nv_cvt_float_to_fp8(Fp8Input(y, s), __NV_SATFINITE, kFmt);
}

// The bits of max(|a|, |b|), NaN if either is: one FMNMX.NAN with both operands' absolute values (PTX max.NaN,
// sm_80+). Folded into an amax with the unsigned max of bit patterns, as below: max|y| over pairs is the same value as
// over single elements, and a NaN comes out as 0x7FFFFFFF, above every other pattern of a non-negative float.
__device__ __forceinline__ uint32_t AbsMaxBits(float a, float b) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(fabsf(a)), "f"(fabsf(b)));
  return __float_as_uint(m);
}

// amax bits folded with 8 values: 4 pair maxima and two 3-input integer maxima (1.33 instructions per element as
// and-mask plus max3 on each element's bits; 0.75 this way).
__device__ __forceinline__ uint32_t FoldAbsMax8(uint32_t bits, const float (&y)[8]) {
  const uint32_t a = AbsMaxBits(y[0], y[1]), b = AbsMaxBits(y[2], y[3]);
  const uint32_t c = AbsMaxBits(y[4], y[5]), d = AbsMaxBits(y[6], y[7]);
  return max(max(max(bits, a), b), max(c, d));
}

// Reduces amax bits over the block and folds them into *amax with one atomic. The unsigned max of the bit patterns
// of |y| is exact and order independent, and a NaN anywhere gives a NaN amax (NaN patterns sort above +inf).
template <int kWarps>
__device__ __forceinline__ void BlockAmax(uint32_t bits, unsigned* amax, uint32_t (&scratch)[kWarps]) {
  bits = __reduce_max_sync(0xffffffffu, bits);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = scratch[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = max(m, scratch[w]);
    if (m != 0) atomicMax(amax, m);
  }
}

// Byte j of each of a, b, c, d, packed in that order.
__device__ __forceinline__ uint32_t GatherByte(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t j) {
  const uint32_t sel = j | ((j + 4) << 4);
  const uint32_t ab = __byte_perm(a, b, sel);
  const uint32_t cd = __byte_perm(c, d, sel);
  return __byte_perm(ab, cd, 0x5410);
}

// Column j of an 8x8 block of FP8 bytes held as 8 rows of 8 bytes (v[i]: row i): its 8 bytes, row 0 first, as one
// 8-byte word of the transposed block.
__device__ __forceinline__ uint2 TransposedRow(const uint2 (&v)[8], int j) {
  uint2 o;
  if (j < 4) {
    o.x = GatherByte(v[0].x, v[1].x, v[2].x, v[3].x, j);
    o.y = GatherByte(v[4].x, v[5].x, v[6].x, v[7].x, j);
  } else {
    o.x = GatherByte(v[0].y, v[1].y, v[2].y, v[3].y, j - 4);
    o.y = GatherByte(v[4].y, v[5].y, v[6].y, v[7].y, j - 4);
  }
  return o;
}

// dbias[c] = sum over the partial rows, in a fixed order: deterministic. (static: one copy per file using it.)
static __global__ void ColumnSumKernel(const float* __restrict__ partial, float* __restrict__ out, int64_t n_partial,
                                int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t p = 0; p < n_partial; ++p) s += partial[p * cols + c];
  out[c] = s;
}

}  // namespace te_jax
