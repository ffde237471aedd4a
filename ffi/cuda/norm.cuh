// What norm_fwd.cu (te_norm_fwd) and norm_bwd.cu (te_norm_bwd), the CUDA handlers of LayerNorm/RMSNorm over the last
// dim, both use: the block-size constants, the stores of 8 float32 results as float32, bfloat16 or float16 (Out;
// norm_fwd.cu adds the FP8 outputs), the row sum in a fixed order, and the launch policy (threads per row and chunks
// per thread, the dynamic shared-memory limit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "te_jax/cuda_check.h"
#include "te_jax/launch_utils.h"
#include "te_jax/norm_view.h"
#include "te_jax/vec_load.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr int kVec = 8;                        // elements per chunk (one 16-byte load of a 16-bit input)
constexpr int kMaxBlock = 512;                 // largest block of the fast kernels
constexpr int kMaxWarps = kMaxBlock / 32;
constexpr int kGenericThreads = 256;           // the one-row-per-block kernels

// ---- element types: ToFloat and Chunk (vec_load.cuh) --------------------------------------------------------------

// How 8 float32 results are stored: rounded to the output type, 16-byte stores (Store4: 4 of them, one store). Store
// returns the FP8 bytes for the transposed copy: zero here, the bytes for norm_fwd.cu's Out<Fp8<kFmt>>.
template <typename Tout>
struct Out;

template <>
struct Out<float> {
  static constexpr bool kFp8 = false;
  __device__ __forceinline__ static uint2 Store(void* out, int64_t i, const float (&y)[kVec], float) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(out) + i);
    p[0] = make_float4(y[0], y[1], y[2], y[3]);
    p[1] = make_float4(y[4], y[5], y[6], y[7]);
    return make_uint2(0, 0);
  }
  __device__ __forceinline__ static void Store4(void* out, int64_t i, const float* y, float) {
    *reinterpret_cast<float4*>(static_cast<float*>(out) + i) = make_float4(y[0], y[1], y[2], y[3]);
  }
  __device__ __forceinline__ static uint8_t StoreOne(void* out, int64_t i, float y, float) {
    static_cast<float*>(out)[i] = y;
    return 0;
  }
};

// bfloat16 and float16: 8 results in one 16-byte store, rounded to nearest even.
template <typename H, typename H2>
struct Out16 {
  static constexpr bool kFp8 = false;
  __device__ __forceinline__ static H2 Pack(float a, float b) {
    if constexpr (std::is_same_v<H, __nv_bfloat16>) {
      return __floats2bfloat162_rn(a, b);
    } else {
      return __floats2half2_rn(a, b);
    }
  }
  __device__ __forceinline__ static uint2 Store(void* out, int64_t i, const float (&y)[kVec], float) {
    H2 h[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = Pack(y[2 * k], y[2 * k + 1]);
    *reinterpret_cast<uint4*>(static_cast<H*>(out) + i) = *reinterpret_cast<const uint4*>(h);
    return make_uint2(0, 0);
  }
  // 4 results (y[0 .. 3]) in one 8-byte store.
  __device__ __forceinline__ static void Store4(void* out, int64_t i, const float* y, float) {
    const H2 h[2] = {Pack(y[0], y[1]), Pack(y[2], y[3])};
    *reinterpret_cast<uint2*>(static_cast<H*>(out) + i) = *reinterpret_cast<const uint2*>(h);
  }
  __device__ __forceinline__ static uint8_t StoreOne(void* out, int64_t i, float y, float) {
    if constexpr (std::is_same_v<H, __nv_bfloat16>) {
      static_cast<H*>(out)[i] = __float2bfloat16_rn(y);
    } else {
      static_cast<H*>(out)[i] = __float2half_rn(y);
    }
    return 0;
  }
};

template <>
struct Out<__nv_bfloat16> : Out16<__nv_bfloat16, __nv_bfloat162> {};
template <>
struct Out<__half> : Out16<__half, __half2> {};

// ---- reductions ---------------------------------------------------------------------------------------------------

// Adds the kWarps partial sums buf[k][first ..] in order (a compile-time count: the loop unrolls), read 4 at a time
// where kWarps is a multiple of 4 (first then is one too, and buf is 16-byte aligned).
template <int kWarps, int kValues>
__device__ __forceinline__ void SumWarps(float (&v)[kValues], const float (*buf)[kMaxWarps], int first) {
#pragma unroll
  for (int k = 0; k < kValues; ++k) {
    float p[kWarps];
    if constexpr (kWarps % 4 == 0) {
#pragma unroll
      for (int w = 0; w < kWarps; w += 4) {
        const float4 q = *reinterpret_cast<const float4*>(&buf[k][first + w]);
        p[w] = q.x, p[w + 1] = q.y, p[w + 2] = q.z, p[w + 3] = q.w;
      }
    } else {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) p[w] = buf[k][first + w];
    }
    float s = p[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) s += p[w];
    v[k] = s;
  }
}

// Sums v over the T threads of this thread's row (T a power of two <= 32, or a multiple of 32; the rows of a block
// are consecutive groups of T threads, this thread's the group-th): a butterfly within the warp, then the row's warps
// in order. Every thread of the row gets the same bits (the butterfly's two partners add the same two values). buf:
// kMaxWarps floats per value (16-byte aligned), not reused until another RowSum's __syncthreads has passed (callers
// alternate two buffers). The common T >= 32 and 2, 4, 8 or 16 warps per row take unrolled paths; the order of the
// additions is the same on every path.
template <int kValues>
__device__ __forceinline__ void RowSum(float (&v)[kValues], int T, int group, float (*buf)[kMaxWarps]) {
  if (T >= 32) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
#pragma unroll
      for (int k = 0; k < kValues; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
    }
  } else {
    for (int o = T / 2; o > 0; o /= 2) {
#pragma unroll
      for (int k = 0; k < kValues; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
    }
  }
  if (T <= 32) return;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < kValues; ++k) buf[k][warp] = v[k];
  }
  __syncthreads();
  const int warps = T / 32;
  const int first = group * warps;
  switch (warps) {
    case 2: SumWarps<2>(v, buf, first); break;
    case 4: SumWarps<4>(v, buf, first); break;
    case 8: SumWarps<8>(v, buf, first); break;
    case 16: SumWarps<16>(v, buf, first); break;
    default:
#pragma unroll
      for (int k = 0; k < kValues; ++k) {
        float s = buf[k][first];
        for (int w = 1; w < warps; ++w) s += buf[k][first + w];
        v[k] = s;
      }
  }
}

// ---- launch policy ------------------------------------------------------------------------------------------------

// Threads per row: a power of two up to 32 (several rows per warp), else a multiple of 32.
int RoundThreads(int t) {
  if (t > 32) return (t + 31) / 32 * 32;
  int p = 1;
  while (p < t) p *= 2;
  return p;
}

struct Shape {
  int n = 0;  // chunks per thread; 0: no fast kernel fits
  int threads = 0;
};

// Of the allowed chunk counts, the one that needs the fewest thread slots (n * T) for `chunks`, with T <=
// max_threads; ties go to the larger n (forward: more loads in flight per thread) or the smaller one (backward: fewer
// registers).
Shape PickShape(int chunks, const int* ns, int count, int max_threads, bool prefer_large) {
  Shape best;
  for (int k = 0; k < count; ++k) {
    const int T = RoundThreads((chunks + ns[k] - 1) / ns[k]);
    if (T > max_threads) continue;
    const int64_t slots = static_cast<int64_t>(T) * ns[k];
    const int64_t best_slots = static_cast<int64_t>(best.threads) * best.n;
    if (best.n == 0 || slots < best_slots || (slots == best_slots && (ns[k] > best.n) == prefer_large)) {
      best = {ns[k], T};
    }
  }
  return best;
}

__host__ __device__ constexpr int PowerOfTwoAtMost(int v) {
  int p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

// Launches kernel<<<blocks, threads, smem>>>(args) after raising its dynamic shared-memory limit to smem: for any
// size, since the kernel's static shared memory counts against the 48 KiB default too. The launch's error status.
template <typename Kernel, typename Args>
cudaError_t LaunchWithSharedMemory(Kernel kernel, int64_t blocks, int threads, size_t smem, cudaStream_t stream,
                                   const Args& args) {
  if (smem > 0) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<blocks, threads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace
}  // namespace te_jax
