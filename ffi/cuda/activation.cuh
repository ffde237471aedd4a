// The kernel of te_act_fwd / te_act_bwd, for activation_fwd.cu and activation_bwd.cu (one handler each, so that
// their 60 kernels each compile in parallel): the activation (forward) or g * act'(x) (backward) in float32, and in
// the same pass either te_quantize's FP8 outputs (saturating cast of y * scale, amax on bit patterns, the transposed
// copy, dbias) or a plain float32/bfloat16/float16 result. The formulas are activation_math.h's, compiled with
// -fmad=false so that every float32 operation rounds once, as in XLA's code for the reference.
//
// One kernel shape for every case: a 256-thread block per 128x128 tile of the output (per half of a gated pair).
// Each thread owns 8 consecutive columns of 8 rows (rows rsub + 16 i), loads them with 16-byte accesses where the
// row length allows (cols % 8 == 0; scalar, bounds-checked accesses otherwise and at ragged tile edges), four rows
// in flight at a time, and stores its results with 8-byte (FP8) or 16-byte (16-bit) accesses. A tile inside an
// aligned array (all but the ragged edges) takes a copy of that loop without bounds checks. For the transposed
// copy, the FP8 bytes are parked in shared memory (XOR-swizzled by row group: no bank conflicts on either side) and
// written out as 8x8 byte blocks transposed in registers, as quantize.cu does. amax is one atomicMax per block on
// bit patterns; dbias is deterministic: per-tile column partials in an XLA-allocated workspace, summed in a fixed
// order by the last block of each column of tiles.
//
// Template parameters are the form (the activation, and a pair's second half: activation_view.h's
// DispatchActivation, 20 forms), forward/backward, the input dtype and FP8-or-not: 240 kernels.
// The high-precision output dtype, the transposed copy and dbias are uniform run-time branches, which cost a few
// instructions per 8 elements and keep the build small; the FP8 format is one too at ragged tile edges, and a
// template constant of the whole-tile loop (two copies of it). The grid is (column tiles, row tiles, batch), so that
// a block finds its tile without a division.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "te_jax/activation_math.h"
#include "te_jax/activation_view.h"
#include "te_jax/cuda_check.h"
#include "te_jax/fp8_tile.cuh"
#include "te_jax/launch_utils.h"
#include "te_jax/vec_load.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 128;                              // tile rows = tile columns (per half)
constexpr int kVec = 8;                                 // columns per thread
constexpr int kChunksPerRow = kTile / kVec;             // 16
constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // 16
constexpr int kRowsPerThread = kTile / kRowsPerPass;    // 8
// Resident blocks per SM: 4 (32 warps, at most 64 registers per thread) for the FP8 forward of 16-bit inputs and the
// FP8 backward of a non-gated activation of bfloat16 inputs, which are bound by instruction issue, where more warps
// help (the gelu backward at (16384, 16384): 0.485 -> 0.455 ms from 3 to 4 blocks, at 12 more instructions per 16
// elements); 3 (24 warps, at most 80 registers) otherwise, where the gated gradient, float32 inputs or 16-bit outputs
// keep more values live (at 64 registers those spill; so does the float16 backward, whose conversions take more
// registers than bfloat16's). 24 warps with their rows of loads in flight each cover the memory latency. A pair
// whose second half is activated too (not linear) keeps that half's values live as well: 3 blocks forward; 2 (16
// warps, 128 registers) backward, where at 80 registers the (gelu, gelu) gradient spilled 1 KiB per thread (H100,
// bfloat16 (16384, 2, 8192), FP8 with dbias: (gelu, gelu) 1.10 -> 0.57 ms, clamped SwiGLU 0.68 -> 0.57 ms, bfloat16
// output 0.64 -> 0.48 ms; (gelu, linear) takes 0.50 ms).
template <typename T, Act B, bool kBwd, bool kFp8>
constexpr int MinBlocksPerSm() {
  constexpr bool kGated = B != Act::kNone;
  if constexpr (kBwd && kGated && B != Act::kLinear) return 2;
  if constexpr (!kFp8 || (kGated && B != Act::kLinear)) return 3;
  if constexpr (kBwd) return !kGated && std::is_same_v<T, __nv_bfloat16> ? 4 : 3;
  return sizeof(T) == 2 ? 4 : 3;
}

enum class HpType : int { kF32, kBf16, kF16 };

struct Params {
  const void* x;        // (batch, rows, halves, cols)
  const void* g;        // (batch, rows, cols), backward only
  const float* scale;
  void* out;            // (batch, rows, halves_out, cols)
  uint8_t* out_t;       // (batch, halves_out * cols, rows), or null
  unsigned* amax;       // FP8 only
  float* dbias_partial; // (batch * tiles_m, halves_out * cols), or null
  unsigned* dbias_done; // (tiles_n): the tiles of each column of tiles whose partials are written, zeroed per call
  float* dbias;         // (halves_out * cols): the column sums of the partials
  int64_t batch, rows, cols, tiles_m, tiles_n;
  int64_t b0, tm0;      // the first batch element and row of tiles of this launch (grid: tn, tm - tm0, b - b0)
  bool vec;             // cols % 8 == 0 and 16-byte aligned bases: vector accesses for whole chunks
  bool rows_vec;        // rows % 8 == 0 and an 8-byte aligned out_t: 8-byte stores of the transposed copy
  bool e5m2;            // FP8 format
  HpType hp;            // high-precision output dtype
  ActParams act;        // clamped SwiGLU's parameters
};

// Rows whose loads are issued before the first use: as many as keep the loaded data within ~24 registers per thread
// (4 for a plain 16-bit forward, 1 for a float32 gated backward), so that the kernel fits the register budget of
// MinBlocksPerSm.
template <typename T, int kInputsPerRow>
constexpr int RowsInFlight() {
  constexpr int regs = kInputsPerRow * 2 * static_cast<int>(sizeof(T));
  return regs <= 6 ? 4 : regs <= 12 ? 2 : 1;
}

__device__ __forceinline__ uint2 PackFp8(const float (&y)[8], float scale, bool e5m2) {
  uint2 p;
  if (e5m2) {
    p.x = CastScaled4<__NV_E5M2>(y, scale);
    p.y = CastScaled4<__NV_E5M2>(y + 4, scale);
  } else {
    p.x = CastScaled4<__NV_E4M3>(y, scale);
    p.y = CastScaled4<__NV_E4M3>(y + 4, scale);
  }
  return p;
}

// kWhole: the chunk is known to be inside the array with vector access allowed (a whole tile): no checks.
template <bool kWhole>
__device__ __forceinline__ void StoreFp8(uint8_t* row, int64_t col, int64_t cols, bool vec, uint2 p) {
  if (kWhole || (vec && col + kVec <= cols)) {
    *reinterpret_cast<uint2*>(row + col) = p;
  } else {
    for (int j = 0; j < kVec && col + j < cols; ++j) row[col + j] = (j < 4 ? p.x >> (8 * j) : p.y >> (8 * (j - 4))) & 0xFF;
  }
}

template <bool kWhole, typename H>
__device__ __forceinline__ void StoreHpAs(void* base, int64_t offset, int64_t col, int64_t cols, bool vec,
                                          const float (&y)[8]) {
  H* row = static_cast<H*>(base) + offset;
  if (kWhole || (vec && col + kVec <= cols)) {
    H h[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = FromFloat<H>(y[j]);
#pragma unroll
    for (int w = 0; w < static_cast<int>(sizeof(H)) * kVec / 16; ++w) {
      reinterpret_cast<uint4*>(row + col)[w] = reinterpret_cast<const uint4*>(h)[w];
    }
  } else {
    for (int j = 0; j < kVec && col + j < cols; ++j) row[col + j] = FromFloat<H>(y[j]);
  }
}

template <bool kWhole>
__device__ __forceinline__ void StoreHp(const Params& p, int64_t offset, int64_t col, const float (&y)[8]) {
  switch (p.hp) {
    case HpType::kF32: StoreHpAs<kWhole, float>(p.out, offset, col, p.cols, p.vec, y); break;
    case HpType::kBf16: StoreHpAs<kWhole, __nv_bfloat16>(p.out, offset, col, p.cols, p.vec, y); break;
    case HpType::kF16: StoreHpAs<kWhole, __half>(p.out, offset, col, p.cols, p.vec, y); break;
  }
}

template <Act A, Act B, bool kBwd, typename T, bool kFp8>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm<T, B, kBwd, kFp8>()) ActivationKernel(const Params p) {
  constexpr bool kGated = B != Act::kNone;  // a pair (A, B); B is kNone for a single activation
  // Halves of the output: a gated gradient has two (dx_a, dx_b); everything else one.
  constexpr int kOutHalves = kGated && kBwd ? 2 : 1;
  constexpr int kInHalves = kGated ? 2 : 1;
  __shared__ uint2 tile[kFp8 ? kOutHalves : 1][kFp8 ? kTile : 1][kChunksPerRow];
  __shared__ float col_sums[kBwd ? kWarps : 1][kBwd ? kOutHalves * kTile : 1];
  __shared__ uint32_t amax_scratch[kWarps];

  const int64_t b = p.b0 + blockIdx.z;
  const int64_t tm = p.tm0 + blockIdx.y;
  const int64_t tn = blockIdx.x;
  const int64_t row0 = tm * kTile;
  const int64_t col0 = tn * kTile;
  const int chunk = threadIdx.x % kChunksPerRow;
  const int rsub = threadIdx.x / kChunksPerRow;
  const int64_t col = col0 + chunk * kVec;
  const int64_t rows = p.rows, cols = p.cols;
  const T* x = static_cast<const T*>(p.x) + b * rows * kInHalves * cols;
  const T* g = kBwd ? static_cast<const T*>(p.g) + b * rows * cols : nullptr;
  const int64_t out_base = b * rows * kOutHalves * cols;
  const float scale = kFp8 ? *p.scale : 1.0f;
  const bool want_t = kFp8 && p.out_t != nullptr;
  const bool want_dbias = kBwd && p.dbias_partial != nullptr;

  uint32_t amax_bits = 0;
  float dsum[kOutHalves][kVec];
#pragma unroll
  for (int h = 0; h < kOutHalves; ++h) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) dsum[h][j] = 0.0f;
  }

  // The rows of the tile, 8 per thread: kWhole for a tile inside the array with vector access allowed (every tile
  // but the ragged edges of an aligned array), which needs no bounds checks; the FP8 format kFmt a template
  // constant there (1: E4M3, 2: E5M2), a run-time one at the edges (0).
  auto tile_rows = [&](auto whole_tag, auto fmt_tag) {
    constexpr bool kWhole = decltype(whole_tag)::value;
    constexpr int kFmt = decltype(fmt_tag)::value;
    const bool e5m2 = kFmt == 0 ? p.e5m2 : kFmt == 2;
    constexpr int kRowsInFlight = RowsInFlight<T, 1 + kGated + kBwd>();
#pragma unroll 1
    for (int i0 = 0; i0 < kRowsPerThread; i0 += kRowsInFlight) {
      // Kept as loaded (16-bit inputs stay packed while the loads are in flight) and converted on use. Elements past
      // the array read as 0, which every activation and gradient maps to 0: amax and dbias stay exact.
      Chunk<T> xa[kRowsInFlight], xb[kGated ? kRowsInFlight : 1], gv[kBwd ? kRowsInFlight : 1];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) {
        const int64_t r = row0 + rsub + (i0 + i) * kRowsPerPass;
        const bool in_row = kWhole || r < rows;
        const int64_t rr = in_row ? r : 0;
        if constexpr (kWhole) {
          xa[i].Load(x + rr * kInHalves * cols + col);
          if constexpr (kGated) xb[i].Load(x + (rr * 2 + 1) * cols + col);
          if constexpr (kBwd) gv[i].Load(g + rr * cols + col);
        } else {
          xa[i].LoadOrZero(x + rr * kInHalves * cols, col, cols, in_row, p.vec);
          if constexpr (kGated) xb[i].LoadOrZero(x + (rr * 2 + 1) * cols, col, cols, in_row, p.vec);
          if constexpr (kBwd) gv[i].LoadOrZero(g + rr * cols, col, cols, in_row, p.vec);
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) {
        const int lr = rsub + (i0 + i) * kRowsPerPass;
        const int64_t r = row0 + lr;
        float y[kOutHalves][kVec];
        auto compute = [&](auto recip) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            float second = 0.0f;  // the pair's second half
            if constexpr (kGated) second = xb[i].Get(j);
            if constexpr (kBwd) {
              float db = 0.0f;
              Backward<A, B>(gv[i].Get(j), xa[i].Get(j), second, y[0][j], db, p.act, recip);
              if constexpr (kOutHalves == 2) y[1][j] = db;
            } else {
              y[0][j] = Forward<A, B>(xa[i].Get(j), second, p.act, recip);
            }
          }
        };
        // The sigmoid's reciprocal as one MUFU.RCP; in the rare chunk where that could differ from ActRecip (a
        // denormal 1 / d, or a NaN), computed again with ActRecip itself (FtzRecip in activation_math.h).
        unsigned worst = 0;
        compute(FtzRecip{worst});
        if (worst > kFtzRecipExactMax) compute(ExactRecip{});
#pragma unroll
        for (int h = 0; h < kOutHalves; ++h) {
          const int64_t offset = out_base + (r * kOutHalves + h) * cols;
          if (want_dbias) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) dsum[h][j] += y[h][j];
          }
          if constexpr (kFp8) {
            amax_bits = FoldAbsMax8(amax_bits, y[h]);
            const uint2 packed = PackFp8(y[h], scale, e5m2);
            if (kWhole || r < rows) StoreFp8<kWhole>(static_cast<uint8_t*>(p.out) + offset, col, cols, p.vec, packed);
            if (want_t) tile[h][lr][chunk ^ ((lr / 8) % kChunksPerRow)] = packed;
          } else {
            if (kWhole || r < rows) StoreHp<kWhole>(p, offset, col, y[h]);
          }
        }
      }
    }
  };
  using RuntimeFmt = std::integral_constant<int, 0>;
  if (p.vec && row0 + kTile <= rows && col0 + kTile <= cols) {
    if constexpr (kFp8) {
      if (p.e5m2) {
        tile_rows(std::true_type{}, std::integral_constant<int, 2>{});
      } else {
        tile_rows(std::true_type{}, std::integral_constant<int, 1>{});
      }
    } else {
      tile_rows(std::true_type{}, RuntimeFmt{});
    }
  } else {
    tile_rows(std::false_type{}, RuntimeFmt{});
  }

  if constexpr (kFp8) {
    if (want_t) {
      __syncthreads();
      const int gq = threadIdx.x % kChunksPerRow;  // tile rows 8 gq .. 8 gq + 7
      const int hq = threadIdx.x / kChunksPerRow;  // tile columns 8 hq .. 8 hq + 7
      const int64_t qr = row0 + 8 * gq;            // position along a row of out_t
      const int64_t c_base = col0 + 8 * hq;
#pragma unroll
      for (int h = 0; h < kOutHalves; ++h) {
        uint2 v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = tile[h][8 * gq + i][hq ^ gq];
        if (qr >= rows || c_base >= cols) continue;
        uint8_t* qt = p.out_t + (b * kOutHalves + h) * cols * rows;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint2 o = TransposedRow(v, j);
          const int64_t c = c_base + j;
          if (c >= cols) break;
          uint8_t* dst = qt + c * rows + qr;
          if (p.rows_vec) {
            *reinterpret_cast<uint2*>(dst) = o;
          } else {
            for (int k = 0; k < 8 && qr + k < rows; ++k) dst[k] = (k < 4 ? o.x >> (8 * k) : o.y >> (8 * (k - 4))) & 0xFF;
          }
        }
      }
    }
  }

  if constexpr (kBwd) {
    if (want_dbias) {
      // Lanes l and l + 16 of a warp hold the same columns; then the 8 warps are summed in a fixed order.
      const int warp = threadIdx.x / 32;
#pragma unroll
      for (int h = 0; h < kOutHalves; ++h) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) dsum[h][j] += __shfl_xor_sync(0xffffffffu, dsum[h][j], 16);
        if (threadIdx.x % 32 < 16) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) col_sums[warp][h * kTile + chunk * kVec + j] = dsum[h][j];
        }
      }
      __syncthreads();
      // Thread t sums column t % 128 of half t / 128.
      const int h = threadIdx.x / kTile;
      const int64_t c = col0 + threadIdx.x % kTile;
      const int64_t out_cols = kOutHalves * cols;
      const bool has_column = h < kOutHalves && c < cols;
      if (has_column) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += col_sums[w][threadIdx.x];
        p.dbias_partial[(b * p.tiles_m + tm) * out_cols + h * cols + c] = s;
      }
      // The block that writes the last partial row of this column of tiles sums its columns' partials in a fixed
      // order (deterministic), instead of a second kernel. The pattern of a grid barrier: the block's partials, then
      // one thread's fence and count (the fence is cumulative through the block barrier), and the summing block's
      // fence before it reads them from L2. One fence per block: a fence in every thread would wait for each
      // thread's outstanding output stores.
      __shared__ bool last;
      __syncthreads();
      const unsigned n_partial = static_cast<unsigned>(p.batch * p.tiles_m);
      if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(p.dbias_done + tn, 1u) == n_partial - 1;
      }
      __syncthreads();
      if (last) {
        __threadfence();
        // kParts threads per column (2, or 1 for the two halves of a gated gradient), each summing a contiguous
        // range of partial rows in order; then the ranges in order.
        constexpr int kColumns = kOutHalves * kTile;
        constexpr int kParts = kThreads / kColumns;
        const int part = threadIdx.x / kColumns;
        const int hc = threadIdx.x % kColumns;
        const int64_t cc = col0 + hc % kTile;
        const unsigned per = (n_partial + kParts - 1) / kParts;
        const unsigned q_end = min(n_partial, (part + 1) * per);
        float s = 0.0f;
        if (cc < cols) {
          const float* column = p.dbias_partial + (hc / kTile) * cols + cc;
#pragma unroll 8
          for (unsigned q = part * per; q < q_end; ++q) s += __ldcg(column + q * out_cols);
        }
        if constexpr (kParts > 1) {
          col_sums[part][hc] = s;
          __syncthreads();
          if (part == 0) {
#pragma unroll
            for (int k = 1; k < kParts; ++k) s += col_sums[k][hc];
          }
        }
        if (part == 0 && cc < cols) p.dbias[(hc / kTile) * cols + cc] = s;
      }
    }
  }
  if constexpr (kFp8) BlockAmax(amax_bits, p.amax, amax_scratch);
}

// The backward's workspace (ActBwdWorkspace): the dbias partials, one row per tile row of each batch element...
inline int64_t DbiasPartialRows(const ActivationView& v) { return v.batch * ((v.rows + kTile - 1) / kTile); }

// ... then the count of finished tiles per column of tiles (the dbias sums' completion counters).
inline int64_t DbiasCounters(const ActivationView& v) { return (v.cols + kTile - 1) / kTile; }

// Launches the kernel for x's dtype and the output kind (zeroing the dbias counters first, when dbias is asked for).
template <bool kBwd>
ffi::Error Launch(cudaStream_t stream, const ActivationView& v, ffi::DataType in_type, ffi::DataType out_type,
                  int64_t act, int64_t gate, Params p) {
  p.batch = v.batch;
  p.rows = v.rows;
  p.cols = v.cols;
  p.tiles_m = (v.rows + kTile - 1) / kTile;
  p.tiles_n = (v.cols + kTile - 1) / kTile;
  p.e5m2 = out_type == ffi::DataType::F8E5M2;
  p.hp = out_type == ffi::DataType::F32 ? HpType::kF32 : out_type == ffi::DataType::BF16 ? HpType::kBf16 : HpType::kF16;
  p.vec = v.cols % kVec == 0 && Aligned(p.x, 16) && (!kBwd || Aligned(p.g, 16)) && Aligned(p.out, 16);
  p.rows_vec = v.rows % 8 == 0 && (p.out_t == nullptr || Aligned(p.out_t, 8));
  const bool fp8 = IsFp8(out_type);
  auto launch = [&](auto dtype_tag) -> ffi::Error {
    using T = decltype(dtype_tag);
    return DispatchActivation(act, v.gated, gate, [&](auto a, auto h) -> ffi::Error {
      constexpr Act kAct = decltype(a)::value;
      constexpr Act kGate = decltype(h)::value;
      auto kernel = fp8 ? ActivationKernel<kAct, kGate, kBwd, T, true> : ActivationKernel<kAct, kGate, kBwd, T, false>;
      // Grid (tn, tm, b): no index division in the kernel. Past the grid's y and z limits (65535), more launches.
      constexpr int64_t kMaxYZ = 65535;
      for (int64_t b0 = 0; b0 < v.batch; b0 += kMaxYZ) {
        for (int64_t tm0 = 0; tm0 < p.tiles_m; tm0 += kMaxYZ) {
          Params q = p;
          q.b0 = b0;
          q.tm0 = tm0;
          const dim3 grid(static_cast<unsigned>(p.tiles_n), static_cast<unsigned>(std::min(kMaxYZ, p.tiles_m - tm0)),
                          static_cast<unsigned>(std::min(kMaxYZ, v.batch - b0)));
          kernel<<<grid, kThreads, 0, stream>>>(q);
          if (auto err = CudaError(cudaGetLastError(), "activation kernel launch"); err.failure()) return err;
        }
      }
      return ffi::Error::Success();
    });
  };
  if (p.dbias_partial != nullptr) {
    TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.dbias_done, 0, DbiasCounters(v) * sizeof(unsigned), stream),
                                "dbias counters memset");
  }
  return WithFloatType(in_type, "activation: inputs must be float32, bfloat16 or float16", launch);
}

// Zeroes amax, which the kernel folds block maxima into (and which stays 0 for an empty input).
ffi::Error Prologue(cudaStream_t stream, ffi::Result<ffi::BufferR0<ffi::F32>>& amax) {
  return CudaError(cudaMemsetAsync(amax->typed_data(), 0, sizeof(float), stream), "amax memset");
}

}  // namespace
}  // namespace te_jax
