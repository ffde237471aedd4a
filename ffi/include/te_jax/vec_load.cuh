// 16-byte vector loads of 8 consecutive float32/bfloat16/float16 elements, read as float32: the input side of the
// memory-bound kernels (quantize, norm, activation, softmax).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace te_jax {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

// A float32 result rounded to nearest even in T (float32, bfloat16 or float16).
template <typename T>
__device__ __forceinline__ T FromFloat(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
}

// 8 consecutive input elements, loaded with 16-byte accesses (two for float32).
template <typename T>
struct Chunk {
  static constexpr int kElems = 8;
  static constexpr int kWords = sizeof(T) * kElems / 16;
  uint4 raw[kWords];

  __device__ __forceinline__ void Load(const T* p) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) raw[w] = __ldg(reinterpret_cast<const uint4*>(p) + w);
  }
  // Load(p) if `pred`, else zeros: one predicated load per 16 bytes, with p computed whatever pred is (callers pass
  // an address inside the array either way), so that the compiler keeps one pointer instead of recomputing it under
  // each predicate.
  __device__ __forceinline__ void LoadIf(bool pred, const T* p) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      uint4& r = raw[w];
      asm("{\n .reg .pred q;\n setp.ne.u32 q, %4, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
          " mov.b32 %3, 0;\n @q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%5];\n}"
          : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
          : "r"(static_cast<unsigned>(pred)), "l"(reinterpret_cast<const uint4*>(p) + w));
    }
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int w = 0; w < kWords; ++w) raw[w] = make_uint4(0, 0, 0, 0);
  }
  // Elements [col, col + 8) of a row of `cols`: one or two 16-byte loads when the chunk is whole and the row
  // vector-accessible, bounds-checked scalar loads otherwise; elements past the row, or of a row that is not there
  // (in_row false), read as 0.
  __device__ __forceinline__ void LoadOrZero(const T* row, int64_t col, int64_t cols, bool in_row, bool vec) {
    if (in_row && vec && col + kElems <= cols) {
#pragma unroll
      for (int w = 0; w < kWords; ++w) raw[w] = __ldg(reinterpret_cast<const uint4*>(row + col) + w);
    } else {
      T* e = reinterpret_cast<T*>(raw);
#pragma unroll
      for (int j = 0; j < kElems; ++j) e[j] = in_row && col + j < cols ? row[col + j] : T(0.0f);
    }
  }
  __device__ __forceinline__ float Get(int i) const {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // bf16 is the top half of a float32: one integer op per element, no conversion instructions.
      const uint32_t w = reinterpret_cast<const uint32_t*>(raw)[i / 2];
      return __uint_as_float(i % 2 == 0 ? w << 16 : w & 0xFFFF0000u);
    } else {
      return ToFloat(reinterpret_cast<const T*>(raw)[i]);
    }
  }
};

}  // namespace te_jax
