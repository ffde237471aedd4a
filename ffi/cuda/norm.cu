// CUDA handlers for te_norm_fwd and te_norm_bwd: LayerNorm/RMSNorm over the last dim (te_jax/ops/norm.py defines
// the math; this file computes exactly its elementwise part, and its sums in a fixed order).
//
// Forward, fast path (cols % 8 == 0, 16-byte aligned rows): a row is held in registers by T threads (a power of two
// up to 32, or a multiple of 32), each with n chunks of 8 elements loaded with 16-byte accesses, chunk t + j * T of
// the row for thread t (consecutive threads read consecutive 16 bytes). The statistics are two passes over those
// registers in float32 (the sum, then the sum of squared deviations), each reduced by a warp butterfly and then the
// row's warps in order, so every thread of the row gets the same bits. P rows share a block. amax is reduced on the
// bit patterns of |y| and folded into the result with one atomicMax per block. Anything else goes through a
// one-row-per-block kernel that re-reads the row from global memory (L1/L2) for each pass.
// The transposed FP8 copy: when rows and cols are multiples of 16 (FP8 GEMM operands), a second kernel transposes the
// FP8 result in 128 x 128-byte tiles through shared memory (full-line loads and stores). Otherwise it is staged in
// the normalizing kernel: a block runs L passes of P rows (R = P * L rows, up to 64 KiB of FP8 bytes), then each
// thread writes the R bytes of one column of out_t with one store.
//
// Backward: "workers" of T threads each own a fixed block of consecutive rows and a fixed set of columns. Per row they
// copy x and dz into a shared-memory ring (cp.async, one or two rows ahead of the row being reduced), reduce the two
// row sums like the forward, write dx, and accumulate dgamma (registers) and dbeta (shared memory) for their columns.
// Each worker then writes its partial sums as one row of the XLA-allocated workspace, and a column-sum kernel adds the
// partial rows in a fixed order: the same bits on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "te_jax/cuda_check.h"
#include "te_jax/norm_view.h"
#include "te_jax/fp8_tile.cuh"
#include "te_jax/vec_load.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr int kVec = 8;                        // elements per chunk (one 16-byte load of a 16-bit input)
constexpr int kMaxBlock = 512;                 // largest block of the fast kernels
constexpr int kMaxWarps = kMaxBlock / 32;
constexpr int kFwdBlock = 256;                 // forward: rows share a block up to this many threads
constexpr int kGenericThreads = 256;           // the one-row-per-block kernels
constexpr int kStageBytes = 64 * 1024;         // forward: FP8 bytes staged per block for the transposed copy
constexpr int kTile = 128;                     // FP8 transpose kernel: 128 x 128-byte tiles ...
constexpr int kTileThreads = 256;              // ... per block of this many threads
// Backward partial rows (te_jax/ops/norm.py's _bwd_partial_rows): at least 256, and 2^20 / cols when more, which
// gives ~2^17 threads (8 columns each) to fill the GPU when rows are short.
constexpr int kBwdMinPartials = 256;
constexpr int64_t kBwdPartialElems = 1 << 20;
constexpr int kColSumCols = 32;                // column-sum kernel: columns per block
constexpr int kColSumSlices = 8;               // ... and partial-row slices summed in parallel, then in order

// ---- element types: ToFloat and Chunk (vec_load.cuh) --------------------------------------------------------------

// 8 float32 parameters (gamma or beta), from L1: every row reads the same ones.
__device__ __forceinline__ void LoadParams(const float* p, float (&v)[kVec]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

template <__nv_fp8_interpretation_t kFmt>
struct Fp8 {};

// How 8 float32 results are stored: rounded to the output type (FP8: times scale, saturating), 16-byte stores
// (8-byte for FP8). Pack returns the FP8 bytes for the transposed copy.
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

template <__nv_fp8_interpretation_t kFmt>
struct Out<Fp8<kFmt>> {
  static constexpr bool kFp8 = true;
  __device__ __forceinline__ static uint32_t Cvt4(float a, float b, float c, float d) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFmt);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kFmt);
    return lo | (hi << 16);
  }
  __device__ __forceinline__ static uint2 Store(void* out, int64_t i, const float (&y)[kVec], float s) {
    uint2 q;
    q.x = Cvt4(__fmul_rn(y[0], s), __fmul_rn(y[1], s), __fmul_rn(y[2], s), __fmul_rn(y[3], s));
    q.y = Cvt4(__fmul_rn(y[4], s), __fmul_rn(y[5], s), __fmul_rn(y[6], s), __fmul_rn(y[7], s));
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(out) + i) = q;
    return q;
  }
  __device__ __forceinline__ static uint8_t StoreOne(void* out, int64_t i, float y, float s) {
    const uint8_t q = __nv_cvt_float_to_fp8(__fmul_rn(y, s), __NV_SATFINITE, kFmt);
    static_cast<uint8_t*>(out)[i] = q;
    return q;
  }
};

// The normalized value: LayerNorm fma((x - mean) * rsigma, g, b), RMSNorm (x * rsigma) * g, each step rounded as
// te_jax.ops.norm.norm_apply_ref rounds it (the intrinsics keep the compiler from contracting anything else).
template <bool kRms>
__device__ __forceinline__ float Normalize(float x, float mean, float rsigma, float g, float b) {
  if constexpr (kRms) {
    return __fmul_rn(__fmul_rn(x, rsigma), g);
  } else {
    return __fmaf_rn(__fmul_rn(__fsub_rn(x, mean), rsigma), g, b);
  }
}

// ---- reductions ---------------------------------------------------------------------------------------------------

// Sums v over the T threads of this thread's row (T a power of two <= 32, or a multiple of 32; the rows of a block
// are consecutive groups of T threads): a butterfly within the warp, then the row's warps in order. Every thread of
// the row gets the same bits (the butterfly's two partners add the same two values). buf: kMaxWarps floats per
// value, not reused until another RowSum's __syncthreads has passed (callers alternate two buffers).
template <int kValues>
__device__ __forceinline__ void RowSum(float (&v)[kValues], int T, float (*buf)[kMaxWarps]) {
  const int width = T < 32 ? T : 32;
  for (int o = width / 2; o > 0; o /= 2) {
#pragma unroll
    for (int k = 0; k < kValues; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
  }
  if (T <= 32) return;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < kValues; ++k) buf[k][warp] = v[k];
  }
  __syncthreads();
  const int first = (threadIdx.x / T) * (T / 32);
#pragma unroll
  for (int k = 0; k < kValues; ++k) {
    float s = buf[k][first];
    for (int w = 1; w < T / 32; ++w) s += buf[k][first + w];
    v[k] = s;
  }
}

// Folds this block's amax bits into *amax with one atomic (unsigned max: exact and order independent).
__device__ __forceinline__ void BlockAmax(uint32_t bits, unsigned* amax, uint32_t* scratch) {
  bits = __reduce_max_sync(0xffffffffu, bits);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = scratch[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = max(m, scratch[w]);
    if (m != 0) atomicMax(amax, m);
  }
}

// ---- forward ------------------------------------------------------------------------------------------------------

struct FwdArgs {
  const void* x;
  const float* gamma;
  const float* beta;      // LayerNorm only
  const float* scale;     // FP8 outputs only
  void* out;
  uint8_t* out_t;         // the transposed FP8 copy, or null
  unsigned* amax;         // FP8 outputs only
  float* mean;            // LayerNorm only
  float* rsigma;
  int64_t rows;
  int cols;
  float epsilon;
  bool zero_centered;
  int threads_per_row;    // T
  int rows_per_pass;      // P
  int passes;             // L: the transposed copy stages R = P * L rows per block
};

// Writes the staged FP8 rows [row0, row0 + R) of out_t: column c's R bytes are contiguous there, one store each.
__device__ __forceinline__ void WriteTransposed(const uint8_t* staged, int pitch, int R, const FwdArgs& a,
                                                int64_t row0) {
  const int valid = a.rows - row0 < R ? static_cast<int>(a.rows - row0) : R;
  const int width = min(R, 16);
  const bool vector = valid == R && a.rows % width == 0;  // row0 is a multiple of R: every store is aligned
  for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
    uint8_t* dst = a.out_t + static_cast<int64_t>(c) * a.rows + row0;
    if (!vector) {
      for (int r = 0; r < valid; ++r) dst[r] = staged[r * pitch + c];
      continue;
    }
    for (int r0 = 0; r0 < R; r0 += 16) {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        if (r < width) w[r / 4] |= static_cast<uint32_t>(staged[(r0 + r) * pitch + c]) << (8 * (r % 4));
      }
      switch (width) {
        case 16: *reinterpret_cast<uint4*>(dst + r0) = make_uint4(w[0], w[1], w[2], w[3]); break;
        case 8: *reinterpret_cast<uint2*>(dst + r0) = make_uint2(w[0], w[1]); break;
        case 4: *reinterpret_cast<uint32_t*>(dst + r0) = w[0]; break;
        case 2: *reinterpret_cast<uint16_t*>(dst + r0) = static_cast<uint16_t>(w[0]); break;
        default: dst[r0] = static_cast<uint8_t>(w[0]); break;
      }
    }
  }
}

// Resident blocks per SM the forward kernel is compiled for: 2 (at most 64 registers per thread, so 1024 threads per
// SM) where that does not spill; a float32 input with 4 chunks per thread (32 registers of data) keeps 1.
template <typename Tin, int kN>
constexpr int FwdMinBlocks() {
  return sizeof(Tin) == 4 && kN == 4 ? 1 : 2;
}

template <typename Tin, typename Tout, bool kRms, int kN>
__global__ void __launch_bounds__(kMaxBlock, FwdMinBlocks<Tin, kN>()) NormFwdKernel(FwdArgs a) {
  extern __shared__ __align__(16) uint8_t staged[];  // transposed copy: R rows x pitch FP8 bytes
  __shared__ float red[2][1][kMaxWarps];
  __shared__ uint32_t amax_scratch[kMaxWarps];
  using O = Out<Tout>;
  const int T = a.threads_per_row;
  const int t = threadIdx.x % T;
  const int rr = threadIdx.x / T;
  const int chunks = a.cols / kVec;
  const int pitch = kN * T * kVec;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * a.rows_per_pass * a.passes;
  const float n = static_cast<float>(a.cols);
  const float scale = O::kFp8 ? *a.scale : 1.0f;
  const bool stage = O::kFp8 && a.out_t != nullptr;
  uint32_t amax_bits = 0;
  int slot = 0;

  for (int l = 0; l < a.passes; ++l) {
    const int local = l * a.rows_per_pass + rr;
    const int64_t row = row0 + local;
    const bool row_ok = row < a.rows;
    const Tin* xr = static_cast<const Tin*>(a.x) + row * a.cols;
    Chunk<Tin> v[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const int c = t + j * T;
      if (row_ok && c < chunks) {
        v[j].Load(xr + c * kVec);
      } else {
        v[j].Zero();  // adds nothing to the sum; excluded from the deviations below
      }
    }
    float mean = 0.0f;
    if constexpr (!kRms) {
      float s[1] = {0.0f};
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) s[0] += v[j].Get(i);
      }
      RowSum(s, T, red[slot++ & 1]);
      mean = s[0] / n;
    }
    float s2[1] = {0.0f};
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      if (t + j * T < chunks) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float d = v[j].Get(i) - mean;
          s2[0] = fmaf(d, d, s2[0]);
        }
      }
    }
    RowSum(s2, T, red[slot++ & 1]);
    const float rsigma = __frsqrt_rn(s2[0] / n + a.epsilon);
    if (t == 0 && row_ok) {
      if constexpr (!kRms) a.mean[row] = mean;
      a.rsigma[row] = rsigma;
    }
    if (!row_ok) continue;  // past the last row: nothing to store, nothing for amax
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const int c = t + j * T;
      if (c >= chunks) continue;
      float g[kVec], b[kVec], y[kVec];
      LoadParams(a.gamma + c * kVec, g);
      if constexpr (!kRms) LoadParams(a.beta + c * kVec, b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gi = a.zero_centered ? __fadd_rn(g[i], 1.0f) : g[i];
        y[i] = Normalize<kRms>(v[j].Get(i), mean, rsigma, gi, kRms ? 0.0f : b[i]);
        if constexpr (O::kFp8) amax_bits = max(amax_bits, __float_as_uint(y[i]) & 0x7FFFFFFFu);
      }
      const uint2 q = O::Store(a.out, row * a.cols + c * kVec, y, scale);
      if (O::kFp8 && stage) *reinterpret_cast<uint2*>(staged + local * pitch + c * kVec) = q;
    }
  }
  if constexpr (O::kFp8) {
    if (stage) {
      __syncthreads();
      WriteTransposed(staged, pitch, a.rows_per_pass * a.passes, a, row0);
    }
    BlockAmax(amax_bits, a.amax, amax_scratch);
  }
}

// Any shape: one row per block, each pass re-reading the row (from L1/L2), scalar accesses.
template <typename Tin, typename Tout, bool kRms>
__global__ void __launch_bounds__(kGenericThreads) NormFwdGenericKernel(FwdArgs a) {
  __shared__ float red[2][1][kMaxWarps];
  __shared__ uint32_t amax_scratch[kMaxWarps];
  using O = Out<Tout>;
  const int64_t row = blockIdx.x;
  const Tin* xr = static_cast<const Tin*>(a.x) + row * a.cols;
  const float n = static_cast<float>(a.cols);
  const float scale = O::kFp8 ? *a.scale : 1.0f;
  float mean = 0.0f;
  if constexpr (!kRms) {
    float s[1] = {0.0f};
    for (int c = threadIdx.x; c < a.cols; c += blockDim.x) s[0] += ToFloat(xr[c]);
    RowSum(s, blockDim.x, red[0]);
    mean = s[0] / n;
  }
  float s2[1] = {0.0f};
  for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
    const float d = ToFloat(xr[c]) - mean;
    s2[0] = fmaf(d, d, s2[0]);
  }
  RowSum(s2, blockDim.x, red[1]);
  const float rsigma = __frsqrt_rn(s2[0] / n + a.epsilon);
  if (threadIdx.x == 0) {
    if constexpr (!kRms) a.mean[row] = mean;
    a.rsigma[row] = rsigma;
  }
  uint32_t amax_bits = 0;
  for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
    const float g = a.zero_centered ? __fadd_rn(a.gamma[c], 1.0f) : a.gamma[c];
    const float y = Normalize<kRms>(ToFloat(xr[c]), mean, rsigma, g, kRms ? 0.0f : a.beta[c]);
    const uint8_t q = O::StoreOne(a.out, row * a.cols + c, y, scale);
    if constexpr (O::kFp8) {
      amax_bits = max(amax_bits, __float_as_uint(y) & 0x7FFFFFFFu);
      if (a.out_t != nullptr) a.out_t[static_cast<int64_t>(c) * a.rows + row] = q;
    }
  }
  if constexpr (O::kFp8) BlockAmax(amax_bits, a.amax, amax_scratch);
}

// ---- the transposed FP8 copy --------------------------------------------------------------------------------------

// out_t = out^T on FP8 bytes (rows and cols multiples of 16, both 16-byte aligned): one 128 x 128-byte tile per
// block. The tile is loaded with 16-byte accesses (8 threads per 128-byte row: full lines) into shared memory, word w
// of tile row r at word w ^ (4 * ((r / 16) % 8)). Then the lane (g, q) of warp v (g = lane / 4, q = lane % 4) reads
// the words 4v + q of the 16 tile rows 16g .. 16g + 15 (the swizzle puts the warp's 32 reads in 32 banks), gathers
// their bytes into 4 columns x 16 rows and writes them as 4 16-byte pieces of out_t; for each of the 4 stores, the 8
// lanes that share q cover the 128 contiguous bytes of one out_t row: every store is full 128-byte lines.
__global__ void __launch_bounds__(kTileThreads)
    Fp8TransposeKernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out_t, int64_t rows, int64_t cols) {
  __shared__ __align__(16) uint32_t tile[kTile][kTile / 4];
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  const int64_t r0 = blockIdx.x / col_tiles * kTile;
  const int64_t c0 = blockIdx.x % col_tiles * kTile;
  constexpr int kPieces = kTile * kTile / 16;  // 16-byte pieces per tile
#pragma unroll
  for (int k = threadIdx.x; k < kPieces; k += kTileThreads) {
    const int r = k / (kTile / 16);
    const int p = k % (kTile / 16);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows && c0 + 16 * p < cols) v = __ldg(reinterpret_cast<const uint4*>(in + (r0 + r) * cols + c0) + p);
    *reinterpret_cast<uint4*>(&tile[r][4 * (p ^ ((r / 16) % 8))]) = v;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int w = 4 * (threadIdx.x / 32) + lane % 4;  // this lane's word: tile columns 4w .. 4w + 3
  uint32_t a[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) a[i] = tile[16 * g + i][w ^ (4 * g)];
  if (r0 + 16 * g >= rows) return;  // rows % 16 == 0: a group of 16 rows is all in or all out
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t c = c0 + 4 * w + j;
    if (c >= cols) break;
    const uint4 v = make_uint4(GatherByte(a[0], a[1], a[2], a[3], j), GatherByte(a[4], a[5], a[6], a[7], j),
                               GatherByte(a[8], a[9], a[10], a[11], j), GatherByte(a[12], a[13], a[14], a[15], j));
    *reinterpret_cast<uint4*>(out_t + c * rows + r0 + 16 * g) = v;
  }
}

// ---- backward -----------------------------------------------------------------------------------------------------

struct BwdArgs {
  const void* dz;
  const void* x;
  const float* mean;  // LayerNorm only
  const float* rsigma;
  const float* gamma;
  void* dx;
  float* partial;     // [partial_rows][cols] dgamma partials, then (LayerNorm) as many dbeta partials
  int64_t rows;
  int cols;
  bool zero_centered;
  int threads_per_row;  // T
  int workers_per_block;
  int workers;
  int64_t partial_rows;  // the workspace's row count per parameter (>= workers)
  int64_t row_block;     // rows per worker
};

// Shared memory of the fast backward kernel, per thread: a ring of kStages rows of x and dz (the next rows are
// copied in with cp.async, 16 bytes per copy, each thread its own chunks, so no barrier, while the current row is
// reduced: kStages - 1 rows in flight), then (LayerNorm) the thread's dbeta accumulators, kept here rather than in
// registers so that 2 blocks of 512 threads fit an SM without spills. Three stages where the total stays within
// 96 KiB at 512 threads (two such blocks per SM), else two.
template <typename T, typename Tdz, bool kRms, int kN>
struct BwdSmem {
  static constexpr int kWx = Chunk<T>::kWords;    // uint4 per chunk of x ...
  static constexpr int kWdz = Chunk<Tdz>::kWords;  // ... and of dz
  static constexpr int kSlots = kN * (kWx + kWdz);  // uint4 per thread and stage: x's chunks, then dz's
  static constexpr int kAcc = kRms ? 0 : kN * kVec / 4;  // float4 dbeta accumulators per thread
  static constexpr int kStages = (3 * kSlots + kAcc) * 16 * kMaxBlock <= 96 * 1024 ? 3 : 2;
  static constexpr size_t Bytes(int threads) {
    return static_cast<size_t>(kStages * kSlots + kAcc) * 16 * threads;
  }
};

// Resident blocks per SM the backward kernel is compiled for: 2 (at most 64 registers per thread) for 16-bit x and
// dz with up to 2 chunks per thread, so that the 256 workers of a large input (512 threads each at hidden 8192) are
// resident at once on 132 SMs instead of running in two waves (before: 122 registers, one block per SM); otherwise
// 1. The driver sizes the shared-memory carveout so that the shared memory does not limit this (Volta and later
// tuning guides: "the driver automatically configures the shared memory capacity for each kernel to avoid shared
// memory occupancy bottlenecks").
template <typename T, typename Tdz, int kN>
constexpr int BwdMinBlocks() {
  return sizeof(T) == 2 && sizeof(Tdz) == 2 && kN <= 2 ? 2 : 1;
}

template <typename T, typename Tdz, bool kRms, int kN>
__global__ void __launch_bounds__(kMaxBlock, BwdMinBlocks<T, Tdz, kN>()) NormBwdKernel(BwdArgs a) {
  using Smem = BwdSmem<T, Tdz, kRms, kN>;
  constexpr int kStages = Smem::kStages;
  constexpr int kSlots = Smem::kSlots;
  constexpr int kWx = Smem::kWx;
  constexpr int kWdz = Smem::kWdz;
  extern __shared__ uint4 ring[];  // [stage][slot][thread], then the dbeta accumulators [k][thread]
  __shared__ float red[2][2][kMaxWarps];
  const int Tn = a.threads_per_row;
  const int t = threadIdx.x % Tn;
  const int worker = blockIdx.x * a.workers_per_block + threadIdx.x / Tn;
  const int64_t first = worker * a.row_block;
  const int64_t end = min(first + a.row_block, a.rows);  // first >= rows for idle workers: no rows
  const int chunks = a.cols / kVec;
  const float n = static_cast<float>(a.cols);
  float4* db = reinterpret_cast<float4*>(ring + kStages * kSlots * blockDim.x) + threadIdx.x;  // db[k * blockDim.x]
  float dg[kN][kVec];
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) dg[j][i] = 0.0f;
  }
  if constexpr (!kRms) {
#pragma unroll
    for (int k = 0; k < Smem::kAcc; ++k) db[k * blockDim.x] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  auto slot = [&](int64_t i, int k) {
    return ring + (static_cast<int>(i % kStages) * kSlots + k) * blockDim.x + threadIdx.x;
  };
  // Row first + i into its stage, as one commit group (empty past the worker's rows).
  auto fetch = [&](int64_t i) {
    const int64_t row = first + i;
    if (row < end) {
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const int c = t + j * Tn;
        if (c >= chunks) continue;
        const uint4* xs = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + row * a.cols + c * kVec);
        const uint4* dzs = reinterpret_cast<const uint4*>(static_cast<const Tdz*>(a.dz) + row * a.cols + c * kVec);
#pragma unroll
        for (int w = 0; w < kWx; ++w) __pipeline_memcpy_async(slot(i, j * kWx + w), xs + w, sizeof(uint4));
#pragma unroll
        for (int w = 0; w < kWdz; ++w) __pipeline_memcpy_async(slot(i, kN * kWx + j * kWdz + w), dzs + w, sizeof(uint4));
      }
    }
    __pipeline_commit();
  };
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) fetch(k);
  int red_slot = 0;
  for (int64_t i = 0; i < a.row_block; ++i) {
    // The stage written here was last read (into registers) in the previous iteration.
    fetch(i + kStages - 1);
    __pipeline_wait_prior(kStages - 1);  // row i's group has landed
    const int64_t row = first + i;
    const bool ok = row < end;
    // x and dz of chunk j, read from the ring in each of the two passes (fewer registers than holding them).
    auto read = [&](int j, Chunk<T>& xc, Chunk<Tdz>& dzc) {
#pragma unroll
      for (int w = 0; w < kWx; ++w) xc.raw[w] = *slot(i, j * kWx + w);
#pragma unroll
      for (int w = 0; w < kWdz; ++w) dzc.raw[w] = *slot(i, kN * kWx + j * kWdz + w);
    };
    const float rs = ok ? a.rsigma[row] : 0.0f;
    const float m = (!kRms && ok) ? a.mean[row] : 0.0f;
    float s[2] = {0.0f, 0.0f};  // sum(dy), sum(dy * xhat)
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const int c = t + j * Tn;
      if (!ok || c >= chunks) continue;  // past the worker's rows: nothing to add
      Chunk<T> xc;
      Chunk<Tdz> dzc;
      read(j, xc, dzc);
      float g[kVec];
      LoadParams(a.gamma + c * kVec, g);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float gi = a.zero_centered ? g[e] + 1.0f : g[e];
        const float xhat = kRms ? xc.Get(e) * rs : (xc.Get(e) - m) * rs;
        const float d = dzc.Get(e);
        const float dy = d * gi;
        s[0] += dy;
        s[1] = fmaf(dy, xhat, s[1]);
        dg[j][e] = fmaf(d, xhat, dg[j][e]);
      }
      if constexpr (!kRms) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float4& b = db[(2 * j + h) * blockDim.x];
          b = make_float4(b.x + dzc.Get(4 * h), b.y + dzc.Get(4 * h + 1), b.z + dzc.Get(4 * h + 2),
                          b.w + dzc.Get(4 * h + 3));
        }
      }
    }
    RowSum(s, Tn, red[red_slot++ & 1]);
    const float c1 = kRms ? 0.0f : s[0] / n;
    const float c2 = s[1] / n;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const int c = t + j * Tn;
      if (!ok || c >= chunks) continue;
      Chunk<T> xc;
      Chunk<Tdz> dzc;
      read(j, xc, dzc);
      float g[kVec], dx[kVec];
      LoadParams(a.gamma + c * kVec, g);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float gi = a.zero_centered ? g[e] + 1.0f : g[e];
        const float xhat = kRms ? xc.Get(e) * rs : (xc.Get(e) - m) * rs;
        const float dy = dzc.Get(e) * gi;
        dx[e] = ((dy - c1) - xhat * c2) * rs;
      }
      Out<T>::Store(a.dx, row * a.cols + c * kVec, dx, 1.0f);
    }
  }
  __pipeline_wait_prior(0);  // nothing left in flight at exit (the trailing groups are empty)
  if (worker >= a.workers) return;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const int c = t + j * Tn;
    if (c >= chunks) continue;
    float4* pg = reinterpret_cast<float4*>(a.partial + worker * a.cols + c * kVec);
    pg[0] = make_float4(dg[j][0], dg[j][1], dg[j][2], dg[j][3]);
    pg[1] = make_float4(dg[j][4], dg[j][5], dg[j][6], dg[j][7]);
    if constexpr (!kRms) {
      float4* pb = reinterpret_cast<float4*>(a.partial + (a.partial_rows + worker) * a.cols + c * kVec);
      pb[0] = db[2 * j * blockDim.x];
      pb[1] = db[(2 * j + 1) * blockDim.x];
    }
  }
}

// Any shape: one worker per block, each pass re-reading the row; the partial sums accumulate in the worker's own
// workspace rows (read-modify-write by the one thread that owns each column).
template <typename T, typename Tdz, bool kRms>
__global__ void __launch_bounds__(kGenericThreads) NormBwdGenericKernel(BwdArgs a) {
  __shared__ float red[2][2][kMaxWarps];
  const int worker = blockIdx.x;
  const int64_t first = worker * a.row_block;
  const int64_t end = min(first + a.row_block, a.rows);
  const float n = static_cast<float>(a.cols);
  float* pg = a.partial + worker * a.cols;
  float* pb = a.partial + (a.partial_rows + worker) * a.cols;
  for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
    pg[c] = 0.0f;
    if constexpr (!kRms) pb[c] = 0.0f;
  }
  const T* xs = static_cast<const T*>(a.x);
  const Tdz* dzs = static_cast<const Tdz*>(a.dz);
  int slot = 0;
  for (int64_t row = first; row < end; ++row) {
    const float rs = a.rsigma[row];
    const float m = kRms ? 0.0f : a.mean[row];
    float s[2] = {0.0f, 0.0f};
    for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float gi = a.zero_centered ? a.gamma[c] + 1.0f : a.gamma[c];
      const float xhat = (ToFloat(xs[row * a.cols + c]) - m) * rs;
      const float d = ToFloat(dzs[row * a.cols + c]);
      const float dy = d * gi;
      s[0] += dy;
      s[1] = fmaf(dy, xhat, s[1]);
      pg[c] = fmaf(d, xhat, pg[c]);
      if constexpr (!kRms) pb[c] += d;
    }
    RowSum(s, blockDim.x, red[slot++ & 1]);
    const float c1 = kRms ? 0.0f : s[0] / n;
    const float c2 = s[1] / n;
    for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float gi = a.zero_centered ? a.gamma[c] + 1.0f : a.gamma[c];
      const float xhat = (ToFloat(xs[row * a.cols + c]) - m) * rs;
      const float dy = ToFloat(dzs[row * a.cols + c]) * gi;
      Out<T>::StoreOne(a.dx, row * a.cols + c, ((dy - c1) - xhat * c2) * rs, 1.0f);
    }
  }
}

// out[p][c] = sum over w < workers of partial[p][w][c], in the order: slices of consecutive partial rows summed in
// parallel, then the slices in order. blockIdx.y picks the parameter (dgamma, dbeta).
__global__ void __launch_bounds__(kColSumCols* kColSumSlices)
    ColumnSumKernel(const float* __restrict__ partial, float* __restrict__ dgamma, float* __restrict__ dbeta,
                    int workers, int64_t partial_rows, int cols) {
  __shared__ float sums[kColSumSlices][kColSumCols];
  const int lc = threadIdx.x % kColSumCols;
  const int slice = threadIdx.x / kColSumCols;
  const int c = blockIdx.x * kColSumCols + lc;
  const float* p = partial + blockIdx.y * partial_rows * cols;
  const int per_slice = (workers + kColSumSlices - 1) / kColSumSlices;
  const int w_end = min(workers, (slice + 1) * per_slice);
  float s = 0.0f;
  if (c < cols) {
#pragma unroll 8
    for (int w = slice * per_slice; w < w_end; ++w) s += p[static_cast<int64_t>(w) * cols + c];
  }
  sums[slice][lc] = s;
  __syncthreads();
  if (slice == 0 && c < cols) {
    float total = sums[0][lc];
#pragma unroll
    for (int k = 1; k < kColSumSlices; ++k) total += sums[k][lc];
    (blockIdx.y == 0 ? dgamma : dbeta)[c] = total;
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

int PowerOfTwoAtMost(int v) {
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

bool Aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

template <typename F>
void DispatchBool(bool v, F&& f) {
  if (v) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Calls f(std::integral_constant<int, n>) for the n in kNs equal to v.
template <int... kNs, typename F>
void DispatchN(int v, F&& f) {
  ((v == kNs ? (f(std::integral_constant<int, kNs>{}), 0) : 0), ...);
}

// The transposed copy of a (rows, cols) FP8 array with both dims multiples of 16 (as FP8 GEMM operands are): a
// separate pass over the FP8 result (1 byte read + 1 written per element) with full-line stores beats staging a few
// rows per block in the normalizing kernel, whose column stores of R <= 16 bytes leave each 32-byte sector of out_t
// partly written until other blocks fill it (for (32768, 8192): R = 8, 24% of the copy bandwidth).
bool SeparateTranspose(const FwdArgs& a) {
  return a.out_t != nullptr && a.rows % 16 == 0 && a.cols % 16 == 0 && Aligned(a.out, 16);
}

ffi::Error LaunchFp8Transpose(cudaStream_t stream, const void* in, uint8_t* out_t, int64_t rows, int64_t cols) {
  const int64_t tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
  Fp8TransposeKernel<<<tiles, kTileThreads, 0, stream>>>(static_cast<const uint8_t*>(in), out_t, rows, cols);
  return LastCudaError("norm_fwd transpose launch");
}

template <typename Tin, typename Tout>
ffi::Error LaunchFwd(cudaStream_t stream, FwdArgs a, bool rms) {
  if (SeparateTranspose(a)) {
    uint8_t* out_t = a.out_t;
    a.out_t = nullptr;
    ffi::Error err = LaunchFwd<Tin, Tout>(stream, a, rms);
    if (err.failure()) return err;
    return LaunchFp8Transpose(stream, a.out, out_t, a.rows, a.cols);
  }
  const int chunks = a.cols / kVec;
  // Up to 4 chunks per thread: 8 chunks of a 16-bit input would take 32 registers of data, and the compiler then
  // needs ~120 registers (it converts and schedules the gamma/beta loads of all chunks at once) or spills at 64.
  static constexpr int kNs[] = {2, 4};
  const bool aligned = Aligned(a.x, 16) && Aligned(a.out, 16) && Aligned(a.gamma, 16) &&
                       (a.beta == nullptr || Aligned(a.beta, 16));
  const Shape shape = a.cols % kVec == 0 && aligned ? PickShape(chunks, kNs, 2, kMaxBlock, true) : Shape{};
  if (shape.n == 0) {
    a.rows_per_pass = a.passes = 1;
    DispatchBool(rms, [&](auto kRms) {
      NormFwdGenericKernel<Tin, Tout, decltype(kRms)::value><<<a.rows, kGenericThreads, 0, stream>>>(a);
    });
    return LastCudaError("norm_fwd generic kernel launch");
  }
  a.threads_per_row = shape.threads;
  a.rows_per_pass = std::max(1, PowerOfTwoAtMost(kFwdBlock / shape.threads));
  a.passes = 1;
  size_t smem = 0;
  if (a.out_t != nullptr) {
    const int pitch = shape.n * shape.threads * kVec;
    const int staged_rows = std::max(a.rows_per_pass, std::min(16, PowerOfTwoAtMost(kStageBytes / pitch)));
    a.passes = staged_rows / a.rows_per_pass;
    smem = static_cast<size_t>(staged_rows) * pitch;
  }
  const int64_t rows_per_block = static_cast<int64_t>(a.rows_per_pass) * a.passes;
  const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  const int threads = a.rows_per_pass * shape.threads;
  ffi::Error err = ffi::Error::Success();
  DispatchBool(rms, [&](auto kRms) {
    auto launch = [&](auto kN) {
      auto kernel = NormFwdKernel<Tin, Tout, decltype(kRms)::value, decltype(kN)::value>;
      err = CudaError(LaunchWithSharedMemory(kernel, blocks, threads, smem, stream, a), "norm_fwd kernel launch");
    };
    DispatchN<2, 4>(shape.n, launch);
  });
  return err;
}

template <typename T, typename Tdz>
ffi::Error LaunchBwd(cudaStream_t stream, BwdArgs a, bool rms, float* dgamma, float* dbeta) {
  const int chunks = a.cols / kVec;
  // Per thread: x, dz and the two accumulators; with a float32 operand at most 2 chunks, to stay within registers.
  static constexpr int kNs16[] = {1, 2, 4};
  static constexpr int kNs32[] = {1, 2};
  constexpr bool k32 = sizeof(T) == 4 || sizeof(Tdz) == 4;
  const bool aligned = Aligned(a.x, 16) && Aligned(a.dz, 16) && Aligned(a.dx, 16) && Aligned(a.gamma, 16) &&
                       Aligned(a.partial, 16);
  const Shape shape = a.cols % kVec == 0 && aligned
                          ? PickShape(chunks, k32 ? kNs32 : kNs16, k32 ? 2 : 3, kMaxBlock, false)
                          : Shape{};
  a.row_block = (a.rows + a.partial_rows - 1) / a.partial_rows;
  a.workers = static_cast<int>((a.rows + a.row_block - 1) / a.row_block);
  ffi::Error err = ffi::Error::Success();
  if (shape.n == 0) {
    a.workers_per_block = 1;
    DispatchBool(rms, [&](auto kRms) {
      NormBwdGenericKernel<T, Tdz, decltype(kRms)::value><<<a.workers, kGenericThreads, 0, stream>>>(a);
    });
    err = LastCudaError("norm_bwd generic kernel launch");
  } else {
    a.threads_per_row = shape.threads;
    a.workers_per_block = std::max(1, PowerOfTwoAtMost(kMaxBlock / shape.threads));
    const int blocks = (a.workers + a.workers_per_block - 1) / a.workers_per_block;
    const int threads = a.workers_per_block * shape.threads;
    DispatchBool(rms, [&](auto kRms) {
      auto launch = [&](auto kN) {
        constexpr int n = decltype(kN)::value;
        auto kernel = NormBwdKernel<T, Tdz, decltype(kRms)::value, n>;
        const size_t smem = BwdSmem<T, Tdz, decltype(kRms)::value, n>::Bytes(threads);
        const cudaError_t status = LaunchWithSharedMemory(kernel, blocks, threads, smem, stream, a);
        if (status != cudaSuccess) {  // the message is built only on failure: this is every call's path
          err = CudaError(status, "norm_bwd kernel launch (" + std::to_string(a.rows) + " x " + std::to_string(a.cols) +
                                      ", n=" + std::to_string(n) + ", " + std::to_string(blocks) + " blocks of " +
                                      std::to_string(threads) + " threads, " + std::to_string(smem) +
                                      " bytes of shared memory)");
        }
      };
      if constexpr (k32) {
        DispatchN<1, 2>(shape.n, launch);
      } else {
        DispatchN<1, 2, 4>(shape.n, launch);
      }
    });
  }
  if (err.failure()) return err;
  const dim3 grid((a.cols + kColSumCols - 1) / kColSumCols, rms ? 1 : 2);
  ColumnSumKernel<<<grid, kColSumCols * kColSumSlices, 0, stream>>>(a.partial, dgamma, dbeta, a.workers,
                                                                    a.partial_rows, a.cols);
  return LastCudaError("norm_bwd column-sum launch");
}

// ---- handlers -----------------------------------------------------------------------------------------------------

ffi::Error NormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::BufferR1<ffi::F32> gamma,
                       ffi::BufferR0<ffi::F32> scale, ffi::BufferR1<ffi::F32> beta, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> out_t, ffi::Result<ffi::AnyBuffer> amax,
                       ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rsigma, bool rmsnorm,
                       float epsilon, bool zero_centered_gamma) {
  auto shape = CheckNormFwd(x, Count(gamma), Count(beta), *out, *out_t, *amax, *mean, *rsigma, rmsnorm);
  if (shape.has_error()) return shape.error();
  const int64_t rows = shape->rows, cols = shape->cols;
  const bool fp8 = shape->fp8, want_t = shape->want_t;
  if (cols > (1 << 30)) return ffi::Error::InvalidArgument("norm_fwd: x's last dim must be in [1, 2^30]");
  if (rows > INT32_MAX) return ffi::Error::InvalidArgument("norm_fwd: more than 2^31 - 1 rows");
  if (fp8) TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(amax->untyped_data(), 0, sizeof(float), stream), "amax memset");
  if (rows == 0) return ffi::Error::Success();
  FwdArgs a{};
  a.x = x.untyped_data();
  a.gamma = gamma.typed_data();
  a.beta = rmsnorm ? nullptr : beta.typed_data();
  a.scale = scale.typed_data();
  a.out = out->untyped_data();
  a.out_t = want_t ? static_cast<uint8_t*>(out_t->untyped_data()) : nullptr;
  a.amax = fp8 ? static_cast<unsigned*>(amax->untyped_data()) : nullptr;
  a.mean = rmsnorm ? nullptr : static_cast<float*>(mean->untyped_data());
  a.rsigma = static_cast<float*>(rsigma->untyped_data());
  a.rows = rows;
  a.cols = static_cast<int>(cols);
  a.epsilon = epsilon;
  a.zero_centered = zero_centered_gamma;
  if (want_t && !Aligned(a.out_t, 16)) return ffi::Error::InvalidArgument("norm_fwd: out_t must be 16-byte aligned");

  auto with_input = [&](auto in) -> ffi::Error {
    using Tin = decltype(in);
    switch (out->element_type()) {
      case ffi::DataType::F32: return LaunchFwd<Tin, float>(stream, a, rmsnorm);
      case ffi::DataType::BF16: return LaunchFwd<Tin, __nv_bfloat16>(stream, a, rmsnorm);
      case ffi::DataType::F16: return LaunchFwd<Tin, __half>(stream, a, rmsnorm);
      case ffi::DataType::F8E4M3FN: return LaunchFwd<Tin, Fp8<__NV_E4M3>>(stream, a, rmsnorm);
      case ffi::DataType::F8E5M2: return LaunchFwd<Tin, Fp8<__NV_E5M2>>(stream, a, rmsnorm);
      default: return ffi::Error::InvalidArgument("norm_fwd: out must be f32/bf16/f16/f8e4m3fn/f8e5m2");
    }
  };
  switch (x.element_type()) {
    case ffi::DataType::F32: return with_input(float{});
    case ffi::DataType::BF16: return with_input(__nv_bfloat16{});
    case ffi::DataType::F16: return with_input(__half{});
    default: return ffi::Error::InvalidArgument("norm_fwd: x must be float32, bfloat16 or float16");
  }
}

ffi::Error NormBwdCuda(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer rsigma,
                       ffi::BufferR1<ffi::F32> gamma, ffi::AnyBuffer mean, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::BufferR1<ffi::F32>> dgamma, ffi::Result<ffi::BufferR1<ffi::F32>> dbeta,
                       ffi::Result<ffi::AnyBuffer> workspace, bool rmsnorm, bool zero_centered_gamma) {
  auto shape = CheckNormBwd(dz, x, rsigma, Count(gamma), mean, *dx, Count(*dgamma), Count(*dbeta), rmsnorm);
  if (shape.has_error()) return shape.error();
  const int64_t rows = shape->rows, cols = shape->cols;
  if (cols > (1 << 30)) return ffi::Error::InvalidArgument("norm_bwd: x's last dim must be in [1, 2^30]");
  const bool dz_f32 = dz.element_type() == ffi::DataType::F32;
  // The partial rows: te_jax/ops/norm.py's _bwd_partial_rows, which sized the workspace.
  const int64_t partial_rows = std::min(rows, std::max<int64_t>(kBwdMinPartials, kBwdPartialElems / cols));
  if (workspace->element_type() != ffi::DataType::F32 || Count(*workspace) != partial_rows * cols * (rmsnorm ? 1 : 2)) {
    return ffi::Error::InvalidArgument("norm_bwd: the workspace must be f32[partial_rows * cols * (1 or 2)]");
  }
  if (rows == 0) {
    TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dgamma->typed_data(), 0, cols * sizeof(float), stream), "memset");
    if (!rmsnorm) {
      TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dbeta->typed_data(), 0, cols * sizeof(float), stream), "memset");
    }
    return ffi::Error::Success();
  }
  BwdArgs a{};
  a.dz = dz.untyped_data();
  a.x = x.untyped_data();
  a.mean = rmsnorm ? nullptr : static_cast<const float*>(mean.untyped_data());
  a.rsigma = static_cast<const float*>(rsigma.untyped_data());
  a.gamma = gamma.typed_data();
  a.dx = dx->untyped_data();
  a.partial = static_cast<float*>(workspace->untyped_data());
  a.rows = rows;
  a.cols = static_cast<int>(cols);
  a.zero_centered = zero_centered_gamma;
  a.partial_rows = partial_rows;
  float* dg = dgamma->typed_data();
  float* db = rmsnorm ? nullptr : dbeta->typed_data();
  switch (x.element_type()) {
    case ffi::DataType::F32: return LaunchBwd<float, float>(stream, a, rmsnorm, dg, db);
    case ffi::DataType::BF16:
      return dz_f32 ? LaunchBwd<__nv_bfloat16, float>(stream, a, rmsnorm, dg, db)
                    : LaunchBwd<__nv_bfloat16, __nv_bfloat16>(stream, a, rmsnorm, dg, db);
    case ffi::DataType::F16:
      return dz_f32 ? LaunchBwd<__half, float>(stream, a, rmsnorm, dg, db)
                    : LaunchBwd<__half, __half>(stream, a, rmsnorm, dg, db);
    default: return ffi::Error::InvalidArgument("norm_bwd: x must be float32, bfloat16 or float16");
  }
}

}  // namespace

// Both allocate nothing (the backward's partial sums go to a workspace result), so XLA may capture them into a CUDA
// graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(NormFwdCudaHandler, NormFwdCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<ffi::AnyBuffer>()                     // x: f32/bf16/f16, rank >= 1
                                  .Arg<ffi::BufferR1<ffi::F32>>()            // gamma: (cols,)
                                  .Arg<ffi::BufferR0<ffi::F32>>()            // scale: multiplies y before an FP8 cast
                                  .Arg<ffi::BufferR1<ffi::F32>>()            // beta: (cols,), empty for RMSNorm
                                  .Ret<ffi::AnyBuffer>()                     // out: x's shape, f32/bf16/f16 or FP8
                                  .Ret<ffi::AnyBuffer>()                     // out_t: FP8 (cols, rows), or empty
                                  .Ret<ffi::AnyBuffer>()                     // amax: f32 max |y| (FP8), or empty
                                  .Ret<ffi::AnyBuffer>()                     // mean: f32 per row, empty for RMSNorm
                                  .Ret<ffi::AnyBuffer>()                     // rsigma: f32 per row
                                  .Attr<bool>("rmsnorm")                     // RMSNorm instead of LayerNorm
                                  .Attr<float>("epsilon")                    // added to the variance
                                  .Attr<bool>("zero_centered_gamma"),        // multiply by gamma + 1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NormBwdCudaHandler, NormBwdCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<ffi::AnyBuffer>()                     // dz: x's shape, x's type or f32
                                  .Arg<ffi::AnyBuffer>()                     // x: the forward input
                                  .Arg<ffi::AnyBuffer>()                     // rsigma: f32 per row
                                  .Arg<ffi::BufferR1<ffi::F32>>()            // gamma: (cols,)
                                  .Arg<ffi::AnyBuffer>()                     // mean: f32 per row, empty for RMSNorm
                                  .Ret<ffi::AnyBuffer>()                     // dx: x's shape and type
                                  .Ret<ffi::BufferR1<ffi::F32>>()            // dgamma: (cols,)
                                  .Ret<ffi::BufferR1<ffi::F32>>()            // dbeta: (cols,), empty for RMSNorm
                                  .Ret<ffi::AnyBuffer>()                     // workspace: f32 per-worker partial sums
                                  .Attr<bool>("rmsnorm")                     // RMSNorm instead of LayerNorm
                                  .Attr<bool>("zero_centered_gamma"),        // the forward multiplied by gamma + 1
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
