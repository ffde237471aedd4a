// CUDA handlers for te_rope_fwd / te_rope_bwd: the rotation of the first R = 2 * half features of every head by the
// angles whose float32 cos/sin tables are given (backward: the same kernel with -sin), the other D - R features
// copied bit for bit. Only multiplies and adds, compiled with -fmad=false: every product and sum rounds once, as
// XLA's GPU code for te_jax.ops.rope.rope_fwd_ref does, so the outputs are bitwise equal to the reference's.
//
// Memory-bound: one thread per unit of a head: 8 rotated pairs (rotate half: 8 features at i and 8 at i + R/2, two 16-byte loads for 16-bit types),
// 4 pairs (interleaved: 8 consecutive features, one 16-byte load) or 8 features that pass through (a raw copy).
// A token's H heads of D features are contiguous in both layouts; a block of up to 256 threads covers the units of
// one token (more blocks along grid.y when a token has more than 256 units), or of several whole tokens when a token
// has at most 128 units (few heads or small D: decoding, grouped-query keys), so that blocks stay full.
// Vector accesses need D % 8 == 0, R % 16 == 0 (rotate half) or R % 8 == 0 (interleaved) and 16-byte aligned
// buffers; otherwise the same units use bounds-checked scalar accesses. The tables (S * R/2 floats, a few hundred
// KiB) are read through the read-only cache: each token's row is shared by its H heads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "te_jax/cuda_check.h"
#include "te_jax/launch_utils.h"
#include "te_jax/rope_view.h"
#include "te_jax/vec_load.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr int kVec = 8;           // features per unit
constexpr int kMaxThreads = 256;  // per block (one token)

struct Params {
  const void* x;
  const float* cos;
  const float* sin;
  void* y;
  RopeView view;
  int rot_units;         // units per head that rotate
  int units;             // units per head: rotating + passing through
  int per_token;         // heads * units
  int tokens_per_block;  // 1 when a token spans one or more blocks
  float sin_sign;  // -1 backward: a sign flip, exact
};

// 8 results converted to T and written with 16-byte stores (two for float32).
template <typename T>
__device__ __forceinline__ void Store8(T* p, const float (&v)[kVec]) {
  T h[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) h[j] = FromFloat<T>(v[j]);
#pragma unroll
  for (int w = 0; w < static_cast<int>(sizeof(T)) * kVec / 16; ++w) {
    reinterpret_cast<uint4*>(p)[w] = reinterpret_cast<const uint4*>(h)[w];
  }
}

// n consecutive table entries (n = 4 or 8), 16-byte aligned.
template <int kN>
__device__ __forceinline__ void LoadTable(const float* p, float (&v)[kN]) {
#pragma unroll
  for (int w = 0; w < kN / 4; ++w) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p) + w);
    v[4 * w] = q.x;
    v[4 * w + 1] = q.y;
    v[4 * w + 2] = q.z;
    v[4 * w + 3] = q.w;
  }
}

template <typename T, bool kInterleaved, bool kVector>
__global__ void __launch_bounds__(kMaxThreads) RopeKernel(const Params p) {
  const int in_block = blockIdx.y * blockDim.x + threadIdx.x;
  if (in_block >= p.tokens_per_block * p.per_token) return;
  const int local_token = in_block / p.per_token;
  const int item = in_block - local_token * p.per_token;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * p.tokens_per_block + local_token;
  if (token >= p.view.tokens()) return;
  const int head = item / p.units;
  const int unit = item - head * p.units;
  const int64_t offset = (token * p.view.heads + head) * p.view.dim;
  const T* x = static_cast<const T*>(p.x) + offset;
  T* y = static_cast<T*>(p.y) + offset;
  const int64_t half = p.view.half;

  if (unit >= p.rot_units) {  // features R + 8 k .. R + 8 k + 7 pass through
    const int64_t col = 2 * half + static_cast<int64_t>(unit - p.rot_units) * kVec;
    if constexpr (kVector) {
#pragma unroll
      for (int w = 0; w < static_cast<int>(sizeof(T)) * kVec / 16; ++w) {
        reinterpret_cast<uint4*>(y + col)[w] = __ldg(reinterpret_cast<const uint4*>(x + col) + w);
      }
    } else {
      for (int j = 0; j < kVec && col + j < p.view.dim; ++j) y[col + j] = x[col + j];
    }
    return;
  }

  const int64_t table_row = p.view.TableRow(token) * half;
  const float sign = p.sin_sign;
  if constexpr (!kInterleaved) {
    // Pairs i0 .. i0 + 7: features (i, i + R/2).
    const int64_t i0 = static_cast<int64_t>(unit) * kVec;
    float c[kVec], s[kVec], y1[kVec], y2[kVec];
    if constexpr (kVector) {
      Chunk<T> a, b;
      a.Load(x + i0);
      b.Load(x + i0 + half);
      LoadTable(p.cos + table_row + i0, c);
      LoadTable(p.sin + table_row + i0, s);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float x1 = a.Get(j), x2 = b.Get(j), sj = sign * s[j];
        y1[j] = x1 * c[j] - x2 * sj;
        y2[j] = x2 * c[j] + x1 * sj;
      }
      Store8(y + i0, y1);
      Store8(y + i0 + half, y2);
    } else {
      for (int j = 0; j < kVec && i0 + j < half; ++j) {
        const int64_t i = i0 + j;
        const float x1 = ToFloat(x[i]), x2 = ToFloat(x[i + half]);
        const float cj = __ldg(p.cos + table_row + i), sj = sign * __ldg(p.sin + table_row + i);
        y[i] = FromFloat<T>(x1 * cj - x2 * sj);
        y[i + half] = FromFloat<T>(x2 * cj + x1 * sj);
      }
    }
  } else {
    // Features e0 .. e0 + 7: pairs (2i, 2i + 1) for i = e0 / 2 .. e0 / 2 + 3.
    constexpr int kPairs = kVec / 2;
    const int64_t e0 = static_cast<int64_t>(unit) * kVec;
    const int64_t i0 = e0 / 2;
    if constexpr (kVector) {
      Chunk<T> a;
      a.Load(x + e0);
      float c[kPairs], s[kPairs], out[kVec];
      LoadTable(p.cos + table_row + i0, c);
      LoadTable(p.sin + table_row + i0, s);
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        const float x1 = a.Get(2 * j), x2 = a.Get(2 * j + 1), sj = sign * s[j];
        out[2 * j] = x1 * c[j] - x2 * sj;
        out[2 * j + 1] = x2 * c[j] + x1 * sj;
      }
      Store8(y + e0, out);
    } else {
      for (int j = 0; j < kPairs && i0 + j < half; ++j) {
        const int64_t i = i0 + j;
        const float x1 = ToFloat(x[2 * i]), x2 = ToFloat(x[2 * i + 1]);
        const float cj = __ldg(p.cos + table_row + i), sj = sign * __ldg(p.sin + table_row + i);
        y[2 * i] = FromFloat<T>(x1 * cj - x2 * sj);
        y[2 * i + 1] = FromFloat<T>(x2 * cj + x1 * sj);
      }
    }
  }
}

template <typename T>
ffi::Error LaunchAs(cudaStream_t stream, const Params& p, bool interleaved) {
  const RopeView& v = p.view;
  const int64_t rot_feature_step = interleaved ? kVec : 2 * kVec;  // features of the rotated block per unit
  const bool vec = v.dim % kVec == 0 && (2 * v.half) % rot_feature_step == 0 && Aligned(p.x, 16) &&
                   Aligned(p.y, 16) && Aligned(p.cos, 16) && Aligned(p.sin, 16);
  const int64_t tokens = v.tokens();
  const int64_t per_block = static_cast<int64_t>(p.tokens_per_block) * p.per_token;
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (per_block + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>((tokens + p.tokens_per_block - 1) / p.tokens_per_block),
                  static_cast<unsigned>((per_block + threads - 1) / threads));
  auto kernel = interleaved ? (vec ? RopeKernel<T, true, true> : RopeKernel<T, true, false>)
                            : (vec ? RopeKernel<T, false, true> : RopeKernel<T, false, false>);
  kernel<<<grid, threads, 0, stream>>>(p);
  return LastCudaError("rope kernel launch");
}

template <bool kBackward>
ffi::Error RopeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                    ffi::Result<ffi::AnyBuffer> y, bool sbhd, bool interleaved) {
  auto view = MakeRopeView(x, cos, sin, sbhd);
  if (view.has_error()) return view.error();
  const RopeView v = *view;
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("rope: the output must have x's dtype and size");
  }
  if (v.elements() == 0) return ffi::Error::Success();
  const int64_t pairs_per_unit = interleaved ? kVec / 2 : kVec;
  const int64_t rot_units = (v.half + pairs_per_unit - 1) / pairs_per_unit;
  const int64_t units = rot_units + (v.dim - 2 * v.half + kVec - 1) / kVec;
  // Grid limits: tokens on grid.x (< 2^31 blocks), one token's heads * units on at most 65535 blocks along grid.y.
  if (v.tokens() >= (int64_t{1} << 31) || v.heads * units > int64_t{65535} * kMaxThreads) {
    return ffi::Error::InvalidArgument("rope: x has B * S >= 2^31 tokens, or over 2^24 units of 8 features per token");
  }
  Params p;
  p.x = x.untyped_data();
  p.cos = static_cast<const float*>(cos.untyped_data());
  p.sin = static_cast<const float*>(sin.untyped_data());
  p.y = y->untyped_data();
  p.view = v;
  p.rot_units = static_cast<int>(rot_units);
  p.units = static_cast<int>(units);
  p.per_token = static_cast<int>(v.heads * units);
  p.tokens_per_block = p.per_token <= kMaxThreads / 2 ? kMaxThreads / p.per_token : 1;
  p.sin_sign = kBackward ? -1.0f : 1.0f;
  return WithFloatType(x.element_type(), "rope: x must be float32, bfloat16 or float16", [&](auto t) {
    return LaunchAs<decltype(t)>(stream, p, interleaved);
  });
}

}  // namespace

// Both allocate nothing: XLA may capture them into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RopeFwdCudaHandler, RopeCuda<false>,
                              RopeSignature(BindWithStream()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RopeBwdCudaHandler, RopeCuda<true>,
                              RopeSignature(BindWithStream()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
