// CUDA handler for te_quantize_block: the block-scaled casts of te_jax/ops/quantize_block.py (BLOCK_1X128,
// BLOCK_128X128, MXFP8_1X32, NVFP4_1X16), bit for bit its reference: the same float32 operations in the same order
// (IEEE division and reciprocal, no contraction into FMAs, subnormals kept, as XLA's GPU backend computes them).
//
// One 256-thread block per 128 x 128 tile of x (batch, rows, cols). Thread t holds 8 consecutive columns (chunk
// t % 16) of 8 consecutive rows (8 * (t / 16) ...): 16-byte loads, all in flight before the first use. A 1 x B block
// of a row is B / 8 consecutive lanes, its amax a few shuffles; a 16 x 16 block is 2 x 2 threads of one warp; a
// 128 x 128 block the whole tile. The transposed copy of 1 x B blocks quantizes x's columns in B-row blocks: each
// column's amax over its block from the registers (a shuffle between the two threads of a warp that hold the same
// columns, then shared memory across warps for B > 16), the codes cast in place with each column's scale. For square
// blocks the copy's codes are the data's. Either way the codes go through shared memory as bytes (16 KiB, the 8-byte
// chunks XOR-swizzled by row group so that both phases are free of bank conflicts), and each thread transposes an 8 x 8
// block of them in registers and writes 8 rows of the copy, coalesced along its rows.
//
// Element formats: FP8 codes are one byte each (cvt.rn.satfinite). E2M1 has no conversion instruction before sm_100:
// it is rounded here by comparison with the midpoints of its grid (ties to even). XLA passes float4_e2m1fn buffers
// packed two per byte (layout {0:E(4)}, ceil(n / 2) bytes; the FFI's element_count() is still n), element 2k in the
// low nibble of byte k and 2k + 1 in the high one (checked on XLA:CPU of jaxlib 0.11.2 through a custom call's raw
// bytes; XLA's GPU emitter packs the same way). A row of odd length starts mid-byte every other row: those rows'
// nibbles are OR-ed into a zeroed buffer with atomics (a slow path for odd shapes only).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "te_jax/cuda_check.h"
#include "te_jax/fp8_tile.cuh"
#include "te_jax/launch_utils.h"
#include "te_jax/quantize_block_view.h"
#include "te_jax/scaling_mode.h"
#include "te_jax/vec_load.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 128;
constexpr int kLines = 8;    // rows (or columns, for the copy) per thread
constexpr int kChunks = 16;  // 8-element chunks per tile line
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kF32NanBits = 0x7FC00000u;  // jnp.float32(nan)
constexpr float kF32Max = 3.40282347e38f;
constexpr int kMode1x128 = static_cast<int>(ScalingMode::kBlock1x128);
constexpr int kMode128 = static_cast<int>(ScalingMode::kBlock128x128);
constexpr int kModeMx = static_cast<int>(ScalingMode::kMxfp8_1x32);
constexpr int kModeNv = static_cast<int>(ScalingMode::kNvfp4_1x16);

// Resident blocks per SM the kernel is built for: 3 (at most 80 registers a thread) where a 16-bit input's cast without
// the copy fits in them unspilled, else 2.
template <typename T, bool kTransposed, bool kSR>
constexpr int BlocksPerSm() {
  return sizeof(T) == 2 && !kTransposed && !kSR ? 3 : 2;
}

template <int kMode>
constexpr int BlockCols() {
  return static_cast<int>(scale_block(static_cast<ScalingMode>(kMode)).cols);
}

struct Params {
  const void* x;
  const float* amax;      // NVFP4: the global amax (s_enc = 448 * 6 / amax, s_dec = 1 / s_enc)
  float* s_dec_out;       // NVFP4: s_dec, written by the first block
  const uint32_t* bits;   // stochastic rounding's bits of x, or null
  const uint32_t* bits_t; // ... of the copy (1 x 16 blocks), or null
  uint8_t* data;
  void* scale;
  uint8_t* data_t;        // null without the copy
  void* scale_t;
  int64_t batch, rows, cols, tiles_m, tiles_n;
  bool e5m2;              // the FP8 modes' element format
  bool pow2;              // BLOCK_*: power-of-two scales
  bool block_2d;          // NVFP4: 16 x 16 blocks
  bool x_vec;             // x's rows 16-byte accessible in chunks of 8
};

// ---- element formats ------------------------------------------------------------------------------------------

// The FP8 codes of two finite products (saturating to +-max, as the reference's clip then cast), a in the low byte: one
// conversion instruction for the pair.
__device__ __forceinline__ uint32_t Fp8Pair(float a, float b, bool e5m2) {
  const float2 v = make_float2(a, b);
  return e5m2 ? __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E5M2)
              : __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
}

// The FP8 NaN of the reference (0x7F in both formats: E4M3 S.1111.111, E5M2 S.11111.11).
__device__ __forceinline__ uint32_t Fp8Nan(bool) { return 0x7Fu; }

__device__ __forceinline__ float E4m3Value(uint32_t code) {
  __nv_fp8_e4m3 f;
  f.__x = static_cast<__nv_fp8_storage_t>(code);
  return static_cast<float>(f);
}

// float32 -> E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6), saturating, to nearest with ties to the even code: a tie at 0.25,
// 1.25, 2.5 or 5 goes down, one at 0.75, 1.75 or 3.5 up. The sign is kept (zeros included).
__device__ __forceinline__ uint32_t E2m1Rn(float v) {
  const float a = fabsf(v);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                        (a > 5.0f);
  return ((__float_as_uint(v) >> 28) & 8u) | code;
}

// Stochastic rounding: up iff (bits >> 8) * 2^-24 < (|v| - lo) / (hi - lo), as the reference's _round_e2m1.
__device__ __forceinline__ uint32_t E2m1Sr(float v, uint32_t bits) {
  const float a = fminf(fabsf(v), 6.0f);
  const float step = a >= 4.0f ? 2.0f : (a >= 2.0f ? 1.0f : 0.5f);
  const float lo = __fmul_rn(floorf(__fdiv_rn(a, step)), step);
  const float u = __fmul_rn(static_cast<float>(bits >> 8), 5.9604644775390625e-8f);  // 2^-24
  const bool up = u < __fdiv_rn(__fsub_rn(a, lo), step);
  return ((__float_as_uint(v) >> 28) & 8u) | E2m1Rn(up ? __fadd_rn(lo, step) : lo);
}

// ---- per-block scales -----------------------------------------------------------------------------------------

// NVFP4's global scale from the tensor's amax: s_enc = compute_scale(amax, 1, 448 * 6) (the quotient where it is a
// positive finite float32 and amax a positive finite one, else 1), s_dec = 1 / s_enc; IEEE division and reciprocal, as
// the reference's on XLA:CPU (each block computes them: one division, instead of XLA:GPU's of the same jnp, which can
// differ in the last bits).
__device__ __forceinline__ void GlobalScale(float amax, float& s_enc, float& s_dec) {
  const float q = __fdiv_rn(448.0f * 6.0f, amax);
  const bool ok = amax > 0.0f && amax <= kF32Max && q <= kF32Max && q > 0.0f;
  s_enc = ok ? q : 1.0f;
  s_dec = __frcp_rn(s_enc);
}

struct BlockScale {
  float mul;       // what the block's elements are multiplied by before their cast
  uint32_t scale;  // the stored scale's bits: float32 (BLOCK_*), E8M0 (MXFP8) or E4M3 (NVFP4)
  bool finite;     // the block holds no inf or NaN
};

// From a block's amax bits (the unsigned max of |x|'s bit patterns: NaN above inf above every finite value).
template <int kMode>
__device__ __forceinline__ BlockScale ScaleOf(uint32_t amax_bits, const Params& p, float s_enc, float s_dec) {
  BlockScale s;
  s.finite = amax_bits < kInfBits;
  const float amax = __uint_as_float(amax_bits);
  if constexpr (kMode == kMode1x128 || kMode == kMode128) {
    // compute_scale(amax, 1, fp8_max): fp8_max / amax where that is a positive finite float32, else 1.
    const float q = __fdiv_rn(p.e5m2 ? 57344.0f : 448.0f, amax);
    float scale = (amax > 0.0f && s.finite && q <= kF32Max && q > 0.0f) ? q : 1.0f;
    if (p.pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
    s.mul = scale;
    s.scale = s.finite ? __float_as_uint(__frcp_rn(scale)) : kF32NanBits;
  } else if constexpr (kMode == kModeMx) {
    // OCP MX v1.0 6.3: the shared exponent floor(log2(amax)) - emax_elem, clamped to E8M0's [-127, 127].
    const int biased = static_cast<int>(amax_bits >> 23);
    const int shared = max(biased - 127 - (p.e5m2 ? 15 : 8), -127);
    s.mul = __uint_as_float(static_cast<uint32_t>(127 - shared) << 23);  // 2^-shared, exact
    s.scale = s.finite ? static_cast<uint32_t>(shared + 127) : 0xFFu;
  } else {
    // e4m3(amax * (s_enc * (1 / 6))), saturating; the elements' multiplier min(1 / (scale * s_dec), float32 max),
    // 0 where the scale is 0.
    const float c = __fmul_rn(s_enc, static_cast<float>(1.0 / 6.0));
    const uint32_t code = s.finite ? static_cast<uint32_t>(__nv_cvt_float_to_fp8(
                                         fminf(__fmul_rn(amax, c), 448.0f), __NV_SATFINITE, __NV_E4M3))
                                   : 0x7Fu;
    const float sv = E4m3Value(code);
    s.mul = sv == 0.0f ? 0.0f : fminf(__frcp_rn(__fmul_rn(sv, s_dec)), kF32Max);
    s.scale = code;
  }
  return s;
}

// The codes of two elements, each of its own block (s0, s1: the same one along a row; bits: their stochastic
// rounding's random bits).
template <int kMode, bool kSR>
__device__ __forceinline__ void CodePair(float x0, float x1, const BlockScale& s0, const BlockScale& s1, uint32_t b0,
                                         uint32_t b1, bool e5m2, uint32_t& c0, uint32_t& c1) {
  const float v0 = __fmul_rn(x0, s0.mul), v1 = __fmul_rn(x1, s1.mul);
  if constexpr (kMode == kModeNv) {
    if constexpr (kSR) {
      c0 = E2m1Sr(v0, b0), c1 = E2m1Sr(v1, b1);
    } else {
      c0 = E2m1Rn(v0), c1 = E2m1Rn(v1);
    }
    c0 = s0.finite ? c0 : 0u, c1 = s1.finite ? c1 : 0u;
  } else {
    const uint32_t pair = Fp8Pair(v0, v1, e5m2);
    c0 = s0.finite ? pair & 0xFFu : Fp8Nan(e5m2);
    c1 = s1.finite ? (pair >> 8) & 0xFFu : Fp8Nan(e5m2);
  }
}

// The codes of 8 elements of one block.
template <int kMode, bool kSR>
__device__ __forceinline__ void Codes(const float (&f)[8], const BlockScale& s, const uint32_t* bits, bool e5m2,
                                      uint32_t (&codes)[8]) {
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    CodePair<kMode, kSR>(f[j], f[j + 1], s, s, kSR ? bits[j] : 0u, kSR ? bits[j + 1] : 0u, e5m2, codes[j],
                         codes[j + 1]);
  }
}

// ---- writes ---------------------------------------------------------------------------------------------------

// The 8 codes of elements [pos, pos + 8) of a line of `len` whose first element is element `line_start` of the
// buffer (the flat index, which places E2M1's nibbles); elements at or past len are not written.
template <bool kFp4>
__device__ __forceinline__ void WriteCodes(uint8_t* out, int64_t line_start, int64_t len, int64_t pos,
                                           const uint32_t (&c)[8]) {
  const int64_t e = line_start + pos;
  if constexpr (!kFp4) {
    if (len % 8 == 0) {
      uint2 w;
      w.x = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
      w.y = c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24);
      *reinterpret_cast<uint2*>(out + e) = w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (pos + j < len) out[e + j] = static_cast<uint8_t>(c[j]);
      }
    }
  } else if (len % 8 == 0) {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) w |= c[j] << (4 * j);
    *reinterpret_cast<uint32_t*>(out + e / 2) = w;
  } else if (len % 2 == 0) {  // pairs start at even elements: whole bytes
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      if (pos + j < len) out[e / 2 + j / 2] = static_cast<uint8_t>(c[j] | (c[j + 1] << 4));
    }
  } else {  // odd lines: a byte may hold the end of one line and the start of the next
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (pos + j < len) {
        const int64_t byte = (e + j) / 2;
        const uint32_t shift = static_cast<uint32_t>((byte % 4) * 8 + ((e + j) % 2) * 4);
        atomicOr(reinterpret_cast<unsigned int*>(out + (byte - byte % 4)), c[j] << shift);
      }
    }
  }
}

template <int kMode>
__device__ __forceinline__ void WriteScale(void* scale, int64_t index, uint32_t bits) {
  if constexpr (kMode == kMode1x128 || kMode == kMode128) {
    static_cast<uint32_t*>(scale)[index] = bits;
  } else {
    static_cast<uint8_t*>(scale)[index] = static_cast<uint8_t>(bits);
  }
}

// ---- the shared-memory tile of codes --------------------------------------------------------------------------

// One byte per code (E2M1's too), 8-byte chunks of tile row r at chunk k ^ (r / 8): the writes (a warp's two rows of
// 16 chunks) and the transposing reads (16 rows 8 apart, one chunk each) hit distinct banks.
using CodeTile = uint2[kTile][kChunks];

__device__ __forceinline__ uint2 PackBytes(const uint32_t (&c)[8]) {
  return make_uint2(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24), c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24));
}

// Thread (g, k) parks the codes of its row 8g + i, columns 8k .. 8k + 7.
__device__ __forceinline__ void StashCodes(CodeTile& tile, int g, int k, int i, const uint32_t (&codes)[8]) {
  tile[8 * g + i][k ^ g] = PackBytes(codes);
}

// After a barrier: thread (g, k) reads tile rows 8k .. 8k + 7, columns 8g .. 8g + 7, and writes them transposed: 8
// rows of the copy (x's columns col0 + 8g + j), positions row0 + 8k .. row0 + 8k + 7 of each.
template <bool kFp4>
__device__ __forceinline__ void WriteTransposed(const CodeTile& tile, const Params& p, int64_t b, int64_t row0,
                                                int64_t col0, int g, int k) {
  uint2 v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = tile[8 * k + i][g ^ k];
  const int64_t pos = row0 + 8 * k;
  if (pos >= p.rows) return;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t line = col0 + 8 * g + j;
    if (line >= p.cols) break;
    const uint2 t = TransposedRow(v, j);
    if (!kFp4 && p.rows % 8 == 0) {
      *reinterpret_cast<uint2*>(p.data_t + (b * p.cols + line) * p.rows + pos) = t;
      continue;
    }
    uint32_t c[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] = (t.x >> (8 * e)) & 0xFFu, c[e + 4] = (t.y >> (8 * e)) & 0xFFu;
    WriteCodes<kFp4>(p.data_t, (b * p.cols + line) * p.rows, p.rows, pos, c);
  }
}

// ---- loads ----------------------------------------------------------------------------------------------------

__device__ __forceinline__ void LoadBits(const uint32_t* line, int64_t pos, int64_t len, bool in_line,
                                         uint32_t (&b)[8]) {
  if (in_line && len % 8 == 0) {
    const uint4 lo = __ldg(reinterpret_cast<const uint4*>(line + pos));
    const uint4 hi = __ldg(reinterpret_cast<const uint4*>(line + pos) + 1);
    b[0] = lo.x, b[1] = lo.y, b[2] = lo.z, b[3] = lo.w, b[4] = hi.x, b[5] = hi.y, b[6] = hi.z, b[7] = hi.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = in_line && pos + j < len ? line[pos + j] : 0u;
  }
}

// ---- the kernel -----------------------------------------------------------------------------------------------

// One row of x, 8 elements per lane: its 1 x B blocks' amaxes (B / 8 lanes each), scales, codes and writes.
template <int kMode, bool kSR>
__device__ __forceinline__ void QuantizeLine(const Params& p, float s_enc, float s_dec, const float (&f)[8],
                                             const uint32_t (&bits)[8], uint8_t* data, void* scale, int64_t line,
                                             int64_t n_lines, int64_t len, int64_t pos, int64_t b) {
  constexpr int kB = BlockCols<kMode>();
  uint32_t amax = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = max(amax, __float_as_uint(f[j]) & kAbsMask);
#pragma unroll
  for (int off = 1; off < kB / 8; off <<= 1) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  const BlockScale s = ScaleOf<kMode>(amax, p, s_enc, s_dec);
  uint32_t codes[8];
  Codes<kMode, kSR>(f, s, bits, p.e5m2, codes);
  if (line < n_lines && pos < len) {
    const int64_t first = (b * n_lines + line) * len;
    WriteCodes<kMode == kModeNv>(data, first, len, pos, codes);
    if (pos % kB == 0) WriteScale<kMode>(scale, (b * n_lines + line) * CeilDiv(len, kB) + pos / kB, s.scale);
  }
}

// The copy of 1 x B blocks (B = kB rows of each of x's columns): thread (g, k)'s 8 columns' amaxes over their blocks,
// scales (the copy's scale_inv written by the threads holding a block's first rows) and codes, parked in `tile`.
template <int kMode, bool kSR, typename T>
__device__ __forceinline__ void QuantizeColumns(const Params& p, float s_enc, float s_dec, const Chunk<T> (&in)[kLines],
                                                CodeTile& tile, uint32_t (&colmax)[kWarps][kTile], int64_t b,
                                                int64_t row0, int64_t col0, int g, int k) {
  constexpr int kB = BlockCols<kMode>();
  static_assert(kB >= 16 && kB <= kTile, "a column block spans whole pairs of thread rows");
  const int64_t pos = row0 + 8 * g;
  uint32_t bits[kSR ? 8 : 1][8] = {};  // the copy's random bits: column j's rows pos .. pos + 7
  if constexpr (kSR) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t c = col0 + 8 * k + j;
      const bool ok = c < p.cols && pos < p.rows;
      LoadBits(p.bits_t + (b * p.cols + (ok ? c : 0)) * p.rows, pos, p.rows, ok, bits[j]);
    }
  }
  uint32_t m[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) m[j] = 0;
#pragma unroll
  for (int i = 0; i < kLines; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) m[j] = max(m[j], __float_as_uint(in[i].Get(j)) & kAbsMask);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) m[j] = max(m[j], __shfl_xor_sync(0xFFFFFFFFu, m[j], 16));  // rows of g ^ 1
  const int warp = threadIdx.x / 32;
  if constexpr (kB > 16) {  // the block's other warps (B / 16 of them, 16 rows each)
    constexpr int kSpan = kB / 16;
    if (g % 2 == 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j) colmax[warp][8 * k + j] = m[j];
    }
    __syncthreads();
    const int w0 = warp - warp % kSpan;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int w = 0; w < kSpan; ++w) m[j] = max(m[j], colmax[w0 + w][8 * k + j]);
    }
  }
  BlockScale sc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) sc[j] = ScaleOf<kMode>(m[j], p, s_enc, s_dec);
  // The threads of a block's first rows write its scales: the copy's line (x's column) c, block (row0 + 8g) / kB.
  if ((8 * g) % kB == 0 && pos < p.rows) {
    const int64_t per_line = CeilDiv(p.rows, kB);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t c = col0 + 8 * k + j;
      if (c < p.cols) WriteScale<kMode>(p.scale_t, (b * p.cols + c) * per_line + pos / kB, sc[j].scale);
    }
  }
#pragma unroll
  for (int i = 0; i < kLines; ++i) {
    uint32_t codes[8];
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      CodePair<kMode, kSR>(in[i].Get(j), in[i].Get(j + 1), sc[j], sc[j + 1], bits[kSR ? j : 0][i],
                           bits[kSR ? j + 1 : 0][i], p.e5m2, codes[j], codes[j + 1]);
    }
    StashCodes(tile, g, k, i, codes);
  }
}

template <typename T, int kMode, bool kTransposed, bool kSR>
__global__ void __launch_bounds__(kThreads, BlocksPerSm<T, kTransposed, kSR>()) QuantizeBlockKernel(const Params p) {
  __shared__ CodeTile tile;  // the copy's codes (unused without it)
  __shared__ uint32_t colmax[kWarps][kTile];  // the copy of 1 x 32 and 1 x 128 blocks: per-warp column amaxes
  __shared__ uint32_t scratch[kWarps];
  __shared__ uint32_t grid2d[kTile / 16][kTile / 16];  // NVFP4 16 x 16: the tile's E4M3 block scales

  const int64_t t = blockIdx.x;
  const int64_t b = t / (p.tiles_m * p.tiles_n);
  const int64_t row0 = ((t / p.tiles_n) % p.tiles_m) * kTile;
  const int64_t col0 = (t % p.tiles_n) * kTile;
  const int k = threadIdx.x % kChunks;
  const int g = threadIdx.x / kChunks;
  const int64_t col = col0 + 8 * k;
  const bool col_ok = col < p.cols;
  const T* x = static_cast<const T*>(p.x) + b * p.rows * p.cols;
  float s_enc = 0.0f, s_dec = 0.0f;
  if constexpr (kMode == kModeNv) {
    GlobalScale(*p.amax, s_enc, s_dec);
    if (blockIdx.x == 0 && threadIdx.x == 0) *p.s_dec_out = s_dec;
  }

  Chunk<T> in[kLines];
#pragma unroll
  for (int i = 0; i < kLines; ++i) {
    const int64_t r = row0 + 8 * g + i;
    in[i].LoadOrZero(x + (r < p.rows ? r : 0) * p.cols, col, p.cols, col_ok && r < p.rows, p.x_vec);
  }
  uint32_t bits[kSR ? kLines : 1][8] = {};  // stochastic rounding's random bits of the 8 rows, in flight with x
  if constexpr (kSR) {
#pragma unroll
    for (int i = 0; i < kLines; ++i) {
      const int64_t r = row0 + 8 * g + i;
      const bool ok = col_ok && r < p.rows;
      LoadBits(p.bits + (b * p.rows + (ok ? r : 0)) * p.cols, col, p.cols, ok, bits[i]);
    }
  }

  const bool square = kMode == kMode128 || (kMode == kModeNv && p.block_2d);
  if (!square) {
    // ---- 1 x B blocks along x's rows, and along its columns for the copy -------------------------------------
#pragma unroll
    for (int i = 0; i < kLines; ++i) {
      const int64_t r = row0 + 8 * g + i;
      float f[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = in[i].Get(j);
      QuantizeLine<kMode, kSR>(p, s_enc, s_dec, f, bits[kSR ? i : 0], p.data, p.scale, r, p.rows, p.cols, col, b);
    }
    if constexpr (kTransposed) {
      QuantizeColumns<kMode, kSR>(p, s_enc, s_dec, in, tile, colmax, b, row0, col0, g, k);
      __syncthreads();
      WriteTransposed<kMode == kModeNv>(tile, p, b, row0, col0, g, k);
    }
    return;
  }

  // ---- square blocks: 128 x 128 (the tile) or NVFP4's 16 x 16 (2 x 2 threads) ---------------------------------
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kLines; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = max(amax, __float_as_uint(in[i].Get(j)) & kAbsMask);
  }
  if (kMode == kMode128) {
    amax = __reduce_max_sync(0xFFFFFFFFu, amax);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) amax = max(amax, scratch[w]);
  } else {
    amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));   // the other 8 columns of the block
    amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 16));  // the other 8 rows
  }
  const BlockScale s = ScaleOf<kMode>(amax, p, s_enc, s_dec);
  const int64_t n_cb = CeilDiv(p.cols, kMode == kMode128 ? kTile : 16);
  const int64_t n_rb = CeilDiv(p.rows, kMode == kMode128 ? kTile : 16);
  if (kMode == kMode128 && threadIdx.x == 0) {
    const int64_t tm = row0 / kTile, tn = col0 / kTile;
    WriteScale<kMode>(p.scale, (b * n_rb + tm) * n_cb + tn, s.scale);
    if constexpr (kTransposed) WriteScale<kMode>(p.scale_t, (b * n_cb + tn) * n_rb + tm, s.scale);
  }
  if (kMode == kModeNv && kTransposed && g % 2 == 0 && k % 2 == 0) grid2d[g / 2][k / 2] = s.scale;
#pragma unroll
  for (int i = 0; i < kLines; ++i) {
    const int64_t r = row0 + 8 * g + i;
    float f[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = in[i].Get(j);
    uint32_t codes[8];
    Codes<kMode, kSR>(f, s, bits[kSR ? i : 0], p.e5m2, codes);
    if (r < p.rows && col_ok) {
      WriteCodes<kMode == kModeNv>(p.data, (b * p.rows + r) * p.cols, p.cols, col, codes);
      if (kMode == kModeNv && k % 2 == 0) WriteScale<kMode>(p.scale, (b * p.rows + r) * n_cb + col / 16, s.scale);
    }
    if constexpr (kTransposed) StashCodes(tile, g, k, i, codes);
  }
  if constexpr (kTransposed) {
    __syncthreads();
    WriteTransposed<kMode == kModeNv>(tile, p, b, row0, col0, g, k);
    if (kMode == kModeNv && k % 2 == 0) {  // the copy's 16 x 16 scales: line col0 + 8g + j, block (row0 + 8k) / 16
      const int64_t pos = row0 + 8 * k;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t line = col0 + 8 * g + j;
        if (line < p.cols && pos < p.rows) {
          WriteScale<kMode>(p.scale_t, (b * p.cols + line) * n_rb + pos / 16, grid2d[k / 2][g / 2]);
        }
      }
    }
  }
}

__global__ void GlobalScaleKernel(const float* amax, float* s_dec) {
  float s_enc, d;
  GlobalScale(*amax, s_enc, d);
  *s_dec = d;
}

template <typename T, int kMode, bool kTransposed, bool kSR>
ffi::Error Launch(cudaStream_t stream, const Params& p) {
  const int64_t blocks = p.batch * p.tiles_m * p.tiles_n;
  QuantizeBlockKernel<T, kMode, kTransposed, kSR><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return LastCudaError("quantize_block kernel launch");
}

template <typename T>
ffi::Error Dispatch(cudaStream_t stream, const Params& p, int64_t mode) {
  const bool tr = p.data_t != nullptr;
  const bool sr = p.bits != nullptr;
  ffi::Error err = ffi::Error::InvalidArgument("quantize_block: unknown mode");
  DispatchBool(tr, [&](auto kT) {
    constexpr bool kTr = decltype(kT)::value;
    switch (mode) {
      case kMode1x128: err = Launch<T, kMode1x128, kTr, false>(stream, p); break;
      case kMode128: err = Launch<T, kMode128, kTr, false>(stream, p); break;
      case kModeMx: err = Launch<T, kModeMx, kTr, false>(stream, p); break;
      case kModeNv:
        err = sr ? Launch<T, kModeNv, kTr, true>(stream, p) : Launch<T, kModeNv, kTr, false>(stream, p);
        break;
      default: break;
    }
  });
  return err;
}

// The scale shape's element count of data shaped (batch, rows, cols) as the view reads it.
int64_t ScaleCount(int64_t mode, bool block_2d, const QuantizeBlockView& v) {
  if (mode == kMode128) return v.batch * CeilDiv(v.rows, kTile) * CeilDiv(v.cols, kTile);
  const int64_t block = scale_block(static_cast<ScalingMode>(mode)).cols;
  (void)block_2d;  // NVFP4's 16 x 16 scales are stored in the 1 x 16 layout
  return v.batch * v.rows * CeilDiv(v.cols, block);
}

ffi::Error QuantizeBlockCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer amax, ffi::AnyBuffer bits,
                             ffi::AnyBuffer bits_t, ffi::Result<ffi::AnyBuffer> data,
                             ffi::Result<ffi::AnyBuffer> scale, ffi::Result<ffi::AnyBuffer> data_t,
                             ffi::Result<ffi::AnyBuffer> scale_t, ffi::Result<ffi::AnyBuffer> s_dec, int64_t mode,
                             bool power_of_two, bool block_2d) {
  if (mode != kMode1x128 && mode != kMode128 && mode != kModeMx && mode != kModeNv) {
    return ffi::Error::InvalidArgument("quantize_block: mode must be BLOCK_1X128, BLOCK_128X128, MXFP8_1X32 or "
                                       "NVFP4_1X16, got " + std::to_string(mode));
  }
  const bool nvfp4 = mode == kModeNv;
  const bool transposed = data_t->element_count() > 0;
  const bool sr = bits.element_count() > 0;
  if (block_2d && !nvfp4) return ffi::Error::InvalidArgument("quantize_block: block_2d is NVFP4's");
  if (power_of_two && mode != kMode1x128 && mode != kMode128) {
    return ffi::Error::InvalidArgument("quantize_block: power_of_two is BLOCK_1X128's and BLOCK_128X128's");
  }
  const ffi::DataType dt = data->element_type();
  if (nvfp4 ? dt != ffi::DataType::F4E2M1FN : (dt != ffi::DataType::F8E4M3FN && dt != ffi::DataType::F8E5M2)) {
    return ffi::Error::InvalidArgument("quantize_block: data must be float4_e2m1fn for NVFP4_1X16, float8_e4m3fn or "
                                       "float8_e5m2 otherwise");
  }
  auto view = MakeQuantizeBlockView(x.dimensions(), transposed || mode == kMode128 || block_2d);
  if (view.has_error()) return view.error();
  const QuantizeBlockView v = *view;
  const int64_t n = v.size();
  if (static_cast<int64_t>(data->element_count()) != n || (transposed && static_cast<int64_t>(
                                                                          data_t->element_count()) != n)) {
    return ffi::Error::InvalidArgument("quantize_block: data (and data_t) must hold as many elements as x");
  }
  const QuantizeBlockView vt{v.batch, v.cols, v.rows};
  if (static_cast<int64_t>(scale->element_count()) != ScaleCount(mode, block_2d, v) ||
      (transposed && static_cast<int64_t>(scale_t->element_count()) != ScaleCount(mode, block_2d, vt))) {
    return ffi::Error::InvalidArgument("quantize_block: scale_inv (and scale_inv_t) must have the mode's scale shape");
  }
  if (nvfp4 && (amax.element_count() != 1 || s_dec->element_count() != 1 ||
                amax.element_type() != ffi::DataType::F32 || s_dec->element_type() != ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument("quantize_block: NVFP4 takes the global amax and returns s_dec as float32 "
                                       "scalars");
  }
  if (sr && (!nvfp4 || static_cast<int64_t>(bits.element_count()) != n || bits.element_type() != ffi::DataType::U32 ||
             (transposed && !block_2d) != (bits_t.element_count() > 0) ||
             (bits_t.element_count() > 0 && static_cast<int64_t>(bits_t.element_count()) != n))) {
    return ffi::Error::InvalidArgument("quantize_block: stochastic rounding (NVFP4) takes uint32 bits of x's size, "
                                       "and of the copy's for 1 x 16 blocks with the copy");
  }
  if (n == 0) {  // no blocks: NVFP4's s_dec still comes out (of the amax given, or 0: 1)
    if (nvfp4) {
      GlobalScaleKernel<<<1, 1, 0, stream>>>(static_cast<const float*>(amax.untyped_data()),
                                             static_cast<float*>(s_dec->untyped_data()));
      return LastCudaError("quantize_block global scale launch");
    }
    return ffi::Error::Success();
  }

  Params p{};
  p.x = x.untyped_data();
  p.amax = nvfp4 ? static_cast<const float*>(amax.untyped_data()) : nullptr;
  p.s_dec_out = nvfp4 ? static_cast<float*>(s_dec->untyped_data()) : nullptr;
  p.bits = sr ? static_cast<const uint32_t*>(bits.untyped_data()) : nullptr;
  p.bits_t = sr && bits_t.element_count() > 0 ? static_cast<const uint32_t*>(bits_t.untyped_data()) : nullptr;
  p.data = static_cast<uint8_t*>(data->untyped_data());
  p.scale = scale->untyped_data();
  p.data_t = transposed ? static_cast<uint8_t*>(data_t->untyped_data()) : nullptr;
  p.scale_t = transposed ? scale_t->untyped_data() : nullptr;
  p.batch = v.batch, p.rows = v.rows, p.cols = v.cols;
  p.tiles_m = CeilDiv(v.rows, kTile), p.tiles_n = CeilDiv(v.cols, kTile);
  p.e5m2 = dt == ffi::DataType::F8E5M2;
  p.pow2 = power_of_two;
  p.block_2d = block_2d;
  p.x_vec = v.cols % 8 == 0 && Aligned(p.x, 16);
  const bool vec_ok = Aligned(p.data, 8) && (!transposed || Aligned(p.data_t, 8)) &&
                      (!sr || (Aligned(p.bits, 16) && (p.bits_t == nullptr || Aligned(p.bits_t, 16))));
  if (!vec_ok) return ffi::Error::InvalidArgument("quantize_block: XLA buffers are expected 16-byte aligned");
  if (nvfp4) {  // odd lines OR their nibbles into a zeroed buffer
    if (v.cols % 2) TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.data, 0, (n + 1) / 2, stream), "data memset");
    if (transposed && v.rows % 2) {
      TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.data_t, 0, (n + 1) / 2, stream), "data_t memset");
    }
  }
  return WithFloatType(x.element_type(), "quantize_block: x must be float32, bfloat16 or float16",
                       [&](auto dummy) { return Dispatch<decltype(dummy)>(stream, p, mode); });
}

}  // namespace

// Launches only on XLA's stream and allocates nothing, so XLA may capture it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeBlockCudaHandler, QuantizeBlockCuda,
                              BindWithStream()
                                  .Arg<ffi::AnyBuffer>()  // x: f32/bf16/f16, rank >= 1
                                  .Arg<ffi::AnyBuffer>()  // amax: NVFP4's f32 global amax, or empty
                                  .Arg<ffi::AnyBuffer>()  // bits: u32 per element of x (stochastic rounding), or empty
                                  .Arg<ffi::AnyBuffer>()  // bits_t: u32 per element of the copy, or empty
                                  .Ret<ffi::AnyBuffer>()  // data: FP8 / E2M1 (packed), x's shape
                                  .Ret<ffi::AnyBuffer>()  // scale_inv: the mode's scale shape and dtype
                                  .Ret<ffi::AnyBuffer>()  // data_t: the transposed copy, or empty
                                  .Ret<ffi::AnyBuffer>()  // scale_inv_t: its scales, or empty
                                  .Ret<ffi::AnyBuffer>()  // s_dec: NVFP4's f32 1 / s_enc, or empty
                                  .Attr<int64_t>("mode")        // te_jax::ScalingMode's number
                                  .Attr<bool>("power_of_two")   // BLOCK_*: power-of-two scales
                                  .Attr<bool>("block_2d"),      // NVFP4: 16 x 16 blocks
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
