// CUDA handler for te_norm_fwd: LayerNorm/RMSNorm over the last dim (te_jax/ops/norm.py defines the math; this file
// computes exactly its elementwise part, and its sums in a fixed order). What it shares with norm_bwd.cu: norm.cuh.
//
// Forward, fast paths (cols % 8 == 0, 16-byte aligned rows): a row is taken by T threads (a power of two up to 32,
// or a multiple of 32), each with n chunks of 8 elements (RowPart), and NormRow computes it: float32 sums, each
// reduced by a warp butterfly and then the row's warps in order, so every thread of the row gets the same bits:
// LayerNorm's sum and sum of squares in one pass and one reduction, with the two-pass variance (the sum of squared
// deviations) for rows where the one-pass form could lose accuracy (OnePassVarianceHolds); RMSNorm's sum of squares.
// P rows share a block. Whole 16-bit rows without a staged transposed copy go through NormFwdRingKernel: resident
// blocks loop over the row groups, the next row copied into shared memory ahead (cp.async). Other rows go through
// NormFwdKernel, which holds a row in registers, chunk t + j * T of the row for thread t (consecutive threads read
// consecutive 16 bytes), its blocks looping the same way where there are more groups than resident blocks, a 16-bit
// row loaded one pass ahead. amax is reduced on the bit patterns of |y| and folded into the result with one
// atomicMax per block. Anything else goes through a one-row-per-block kernel that re-reads the row from global
// memory (L1/L2) for each pass.
// The transposed FP8 copy: when rows and cols are multiples of 16 (FP8 GEMM operands), a second kernel transposes the
// FP8 result in 128 x 128-byte tiles through shared memory (full-line loads and stores). Otherwise it is staged in
// the normalizing kernel: a block runs L passes of P rows (R = P * L rows, up to 64 KiB of FP8 bytes), then each
// thread writes the R bytes of one column of out_t with one store.
#include <cuda_pipeline.h>

#include "norm.cuh"

#include "te_jax/fp8_tile.cuh"

namespace te_jax {
namespace {

constexpr int kFwdBlock = 256;                 // forward: rows share a block up to this many threads
constexpr int kStageBytes = 64 * 1024;         // forward: FP8 bytes staged per block for the transposed copy
constexpr int kTile = 128;                     // FP8 transpose kernel: 128 x 128-byte tiles ...
constexpr int kTileThreads = 256;              // ... per block of this many threads

// ---- FP8 outputs and the normalized value -------------------------------------------------------------------------

template <__nv_fp8_interpretation_t kFmt>
struct Fp8 {};

// FP8 outputs: times scale, saturating, NaN for a non-finite y (Fp8Input), 8-byte stores (Store4: 4-byte). Store returns the FP8 bytes for the
// transposed copy.
template <__nv_fp8_interpretation_t kFmt>
struct Out<Fp8<kFmt>> {
  static constexpr bool kFp8 = true;
  __device__ __forceinline__ static uint2 Store(void* out, int64_t i, const float (&y)[kVec], float s) {
    uint2 q;
    q.x = CastScaled4<kFmt>(y, s);
    q.y = CastScaled4<kFmt>(y + 4, s);
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(out) + i) = q;
    return q;
  }
  __device__ __forceinline__ static void Store4(void* out, int64_t i, const float* y, float s) {
    *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(out) + i) = CastScaled4<kFmt>(y, s);
  }
  __device__ __forceinline__ static uint8_t StoreOne(void* out, int64_t i, float y, float s) {
    const uint8_t q = CastScaled<kFmt>(y, s);
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
  float inv_n;            // 1 / cols where cols is a power of two (exact), else 0: divide
  int threads_per_row;    // T
  int rows_per_pass;      // P
  int passes;             // L: the transposed copy stages R = P * L rows per block
  bool strided;           // without staging: pass l takes the rows of block blockIdx.x + l * gridDim.x
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

// Bytes per output element (the Fp8<kFmt> tags are empty types).
template <typename Tout>
constexpr int64_t kOutBytes = Out<Tout>::kFp8 ? 1 : sizeof(Tout);

// Rows of T threads per block of the fast forward kernels (P): as many as fill kFwdBlock threads, a power of two.
__host__ __device__ constexpr int FwdRowsPerBlock(int T) { return PowerOfTwoAtMost(kFwdBlock / T); }

// Resident blocks per SM the forward kernel is compiled for: 2 (at most 64 registers per thread, so 1024 threads per
// SM) where that does not spill; a float32 input with 4 chunks per thread (32 registers of data) keeps 1.
template <typename Tin, int kN>
constexpr int FwdMinBlocks() {
  return sizeof(Tin) == 4 && kN == 4 ? 1 : 2;
}

// sum / n, exactly: a product with 1 / n where n is a power of two (the same bits as the division), else the division.
__device__ __forceinline__ float DivN(float sum, const FwdArgs& a) {
  return a.inv_n != 0.0f ? __fmul_rn(sum, a.inv_n) : __fdiv_rn(sum, static_cast<float>(a.cols));
}

// LayerNorm's variance from one pass over the row: msq - mean^2 (mean = sum / n, msq = sum of squares / n, one row
// reduction of the two sums), trusted where |mean| <= sigma / 8. There the subtraction loses at most 1/64 of the
// result's bits to cancellation, and its error stays that of the two-pass form (measured in float32 emulation of
// these sums: rsigma within 2.4 units of roundoff, as the two-pass form's 2.1). Other rows (and rows holding inf or
// NaN) take the two-pass form, sum((x - mean)^2) / n, over the registers the row is held in.
__device__ __forceinline__ bool OnePassVarianceHolds(float mean, float var) {
  return 64.0f * __fmul_rn(mean, mean) <= var;
}

// This thread's part of a row of T threads, kN chunks of 8 elements. Contiguous chunks (kSplit false): chunk j is
// elements (t + j * T) * 8 .. + 7, there where j * T < valid (all kN in whole rows). Split chunks (kSplit true, whole
// rows only): chunk j is the two quads 2j and 2j + 1 of this thread, quad q being elements (t + q * T) * 4 .. + 3, so
// that each 16-byte load of 4 float32 parameters by a warp reads 512 contiguous bytes (with contiguous chunks the
// warp's 32 loads are 32 bytes apart: each 32-byte sector is read twice, half of it each time).
struct RowPart {
  int T;
  int t;
  int group;              // the row's index in the block (threadIdx.x / T)
  int valid;              // chunks - t
  int stride;             // T * 8: elements from one of this thread's chunks to the next (split: 2 quads)
  const float* gamma_t;   // gamma + this thread's first element
  const float* beta_t;    // beta + this thread's first element (LayerNorm)
  float scale;            // of the FP8 cast
};

template <typename Tout, bool kRms, bool kSplit>
__device__ __forceinline__ RowPart MakeRowPart(const FwdArgs& a, int T, int t, int group) {
  const int first = t * (kSplit ? 4 : kVec);
  return RowPart{T, t, group, a.cols / kVec - t, T * kVec, a.gamma + first, kRms ? nullptr : a.beta + first,
                 Out<Tout>::kFp8 ? *a.scale : 1.0f};
}

// One row from this thread's chunks chunk(j) (a Chunk<Tin>, asked for again in each pass over the row; chunks past
// the row read as zeros): the statistics (LayerNorm: the sum and the sum of squares in one row reduction, then the
// deviations where the one-pass variance does not hold; RMSNorm: the sum of squares), mean and rsigma (thread 0 of
// the row), the output chunks from out + first, amax folded into amax_bits; on_store(j, q) gets chunk j's FP8
// bytes. Every thread of the block calls it as often as the others (the row sums have barriers); a row past the
// last (row_ok false) stores nothing.
template <typename Tin, typename Tout, bool kRms, int kN, bool kWhole, bool kSplit, typename ChunkAt, typename OnStore>
__device__ __forceinline__ void NormRow(const FwdArgs& a, const RowPart& p, ChunkAt chunk, int64_t row, bool row_ok,
                                        int64_t first, float (*red)[2][kMaxWarps], int& slot, uint32_t& amax_bits,
                                        OnStore on_store) {
  using O = Out<Tout>;
  auto has = [&](int j) { return kWhole || j * p.T < p.valid; };
  const int T = p.T;
  const int half = kSplit ? p.stride / 2 : 4;  // elements from a chunk's first 4 to its last 4
  float mean = 0.0f, var = 0.0f;
  bool two_pass = true;  // RMSNorm's one pass is its sum of squares
  if constexpr (!kRms) {
    float s[2] = {0.0f, 0.0f};  // sum, sum of squares
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const Chunk<Tin> v = chunk(j);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float x = v.Get(i);
        s[0] += x;
        s[1] = fmaf(x, x, s[1]);
      }
    }
    RowSum(s, T, p.group, red[slot++ & 1]);
    mean = DivN(s[0], a);
    var = fmaf(-mean, mean, DivN(s[1], a));
    two_pass = !OnePassVarianceHolds(mean, var);
  }
  // Every thread of a row has the same statistics' bits, so a row decides as one; rows that share a warp (T < 32)
  // or a block with barriers in its row sums (T > 32, P > 1) take the second pass together, each keeping its own
  // one-pass variance where that holds.
  bool any_two_pass = two_pass;
  if constexpr (!kRms) {
    if (T < 32) {
      any_two_pass = __any_sync(0xffffffffu, two_pass);
    } else if (T > 32 && a.rows_per_pass > 1) {
      any_two_pass = __syncthreads_or(two_pass);
    }
  }
  if (any_two_pass) {
    float s2[1] = {0.0f};
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      if (has(j)) {
        const Chunk<Tin> v = chunk(j);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float d = v.Get(i) - mean;
          s2[0] = fmaf(d, d, s2[0]);
        }
      }
    }
    RowSum(s2, T, p.group, red[slot++ & 1]);
    if (two_pass) var = DivN(s2[0], a);
  }
  const float rsigma = __frsqrt_rn(var + a.epsilon);
  if (p.t == 0 && row_ok) {
    if constexpr (!kRms) a.mean[row] = mean;
    a.rsigma[row] = rsigma;
  }
  if (!row_ok) return;  // past the last row: nothing to store, nothing for amax
  void* dst = static_cast<uint8_t*>(a.out) + first * kOutBytes<Tout>;  // this thread's first output
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    if (!has(j)) continue;
    const Chunk<Tin> v = chunk(j);
    float y[kVec];
#pragma unroll
    for (int h = 0; h < kVec; h += 4) {  // parameters 4 at a time: 8 fewer live registers than all 8
      const int off = j * p.stride + (h / 4) * half;
      const float4 g4 = __ldg(reinterpret_cast<const float4*>(p.gamma_t + off));
      const float4 b4 = kRms ? float4{} : __ldg(reinterpret_cast<const float4*>(p.beta_t + off));
      const float g[4] = {g4.x, g4.y, g4.z, g4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) y[h + i] = Normalize<kRms>(v.Get(h + i), mean, rsigma, g[i], b[i]);
    }
    if constexpr (O::kFp8) amax_bits = FoldAbsMax8(amax_bits, y);
    if constexpr (kSplit) {
      O::Store4(dst, j * p.stride, y, p.scale);
      O::Store4(dst, j * p.stride + half, y + 4, p.scale);
    } else {
      on_store(j, O::Store(dst, j * p.stride, y, p.scale));
    }
  }
}

// Any 16-bit or float32 row of whole chunks, with or without the staged transposed copy: each thread holds its
// chunks in registers (a 16-bit row of a block that loops is loaded one pass ahead).
template <typename Tin, typename Tout, bool kRms, int kN>
__global__ void __launch_bounds__(kMaxBlock, FwdMinBlocks<Tin, kN>()) NormFwdKernel(FwdArgs a) {
  extern __shared__ __align__(16) uint8_t staged[];  // transposed copy: R rows x pitch FP8 bytes
  __shared__ __align__(16) float red[2][2][kMaxWarps];
  __shared__ uint32_t amax_scratch[kMaxWarps];
  using O = Out<Tout>;
  const int T = a.threads_per_row;
  // T is a power of two for every hidden size up to 4096 x kN (and 8192 at kN = 4): a mask and a shift then.
  const bool pow2_t = (T & (T - 1)) == 0;
  const int t = pow2_t ? threadIdx.x & (T - 1) : threadIdx.x % T;
  const int rr = pow2_t ? threadIdx.x >> (__ffs(T) - 1) : threadIdx.x / T;
  const RowPart p = MakeRowPart<Tout, kRms, false>(a, T, t, rr);
  const int pitch = kN * T * kVec;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * a.rows_per_pass * (a.strided ? 1 : a.passes);
  const int64_t step = static_cast<int64_t>(a.rows_per_pass) * (a.strided ? gridDim.x : 1);
  const bool stage = O::kFp8 && a.out_t != nullptr;
  uint32_t amax_bits = 0;
  int slot = 0;
  auto row_of = [&](int l) { return row0 + l * step + rr; };
  // This thread's first element of pass l's row (of row 0 for a row past the last, which is never read).
  auto first_of = [&](int l) {
    const int64_t row = row_of(l);
    return (row < a.rows ? row : 0) * a.cols + t * kVec;
  };
  // Chunks past the row (or of a row past the last) read as zeros: they add nothing to the sums and are excluded from
  // the deviations.
  auto load = [&](Chunk<Tin> (&v)[kN], int l) {
    const Tin* x_t = static_cast<const Tin*>(a.x) + first_of(l);
    const bool row_ok = row_of(l) < a.rows;
#pragma unroll
    for (int j = 0; j < kN; ++j) v[j].LoadIf(row_ok && j * T < p.valid, x_t + j * p.stride);
  };
  // 16-bit inputs of blocks that loop over several passes load the next pass's row while this one is reduced and
  // normalized (16 more registers of data at kN = 4, within the 64 of 4 resident blocks of 256 threads).
  constexpr bool kPrefetch = sizeof(Tin) == 2;
  Chunk<Tin> next[kPrefetch ? kN : 1];
  if constexpr (kPrefetch) load(next, 0);

  for (int l = 0; l < a.passes; ++l) {
    const int local = l * a.rows_per_pass + rr;
    const int64_t row = row_of(l);
    Chunk<Tin> v[kN];
    if constexpr (kPrefetch) {
#pragma unroll
      for (int j = 0; j < kN; ++j) v[j] = next[j];
      if (l + 1 < a.passes) load(next, l + 1);
    } else {
      load(v, l);
    }
    NormRow<Tin, Tout, kRms, kN, false, false>(
        a, p, [&](int j) { return v[j]; }, row, row < a.rows, first_of(l), red, slot, amax_bits,
        [&](int j, uint2 q) {
          if (O::kFp8 && stage) *reinterpret_cast<uint2*>(staged + local * pitch + (t + j * T) * kVec) = q;
        });
  }
  if constexpr (O::kFp8) {
    if (stage) {
      __syncthreads();
      WriteTransposed(staged, pitch, a.rows_per_pass * a.passes, a, row0);
    }
    BlockAmax(amax_bits, a.amax, amax_scratch);
  }
}

// Whole 16-bit rows (cols = kN * T * 8) without the staged transposed copy, the common hidden sizes, in split
// chunks (RowPart): the resident blocks loop over the groups of P rows (groups blockIdx.x, + gridDim.x, ..), and each
// thread copies its quads of its row of the next group into its own 8-byte slots of a two-stage shared-memory ring
// (cp.async: no barrier, and no registers held for the row in flight), reading them back in each pass over the row.
// Against NormFwdKernel: no bounds tests, no moves of a prefetched row, and parameter loads that read whole sectors.
// kT: T as a compile-time constant (0: T = a.threads_per_row), for the hidden sizes FP8 layers use most (LaunchRing):
// every offset within the row (parameters, ring slots, stores) is then an immediate of the instruction instead of an
// address computed per quad, as hidden-size-tuned norm kernels do.
template <typename Tin, typename Tout, bool kRms, int kN, int kT>
__global__ void __launch_bounds__(kMaxBlock, 2) NormFwdRingKernel(FwdArgs a) {
  static_assert(sizeof(Tin) == 2, "one 8-byte slot per quad");
  constexpr int kQuads = 2 * kN;
  extern __shared__ uint2 ring[];  // [stage][quad][thread]
  __shared__ __align__(16) float red[2][2][kMaxWarps];
  __shared__ uint32_t amax_scratch[kMaxWarps];
  const int T = kT > 0 ? kT : a.threads_per_row;
  const bool pow2_t = (T & (T - 1)) == 0;
  const int t = pow2_t ? threadIdx.x & (T - 1) : threadIdx.x % T;
  const int rr = pow2_t ? threadIdx.x >> (__ffs(T) - 1) : threadIdx.x / T;
  const RowPart p = MakeRowPart<Tout, kRms, true>(a, T, t, rr);
  const int rows = static_cast<int>(a.rows);  // <= 2^30 (LaunchFwd)
  constexpr int kP = kT > 0 ? FwdRowsPerBlock(kT) : 0;
  const int P = kT > 0 ? kP : a.rows_per_pass;
  const int threads = kT > 0 ? kT * kP : blockDim.x;
  const int groups = (rows + P - 1) / P;
  uint2* const mine = ring + threadIdx.x;
  auto at = [&](int stage, int q) { return mine + (stage * kQuads + q) * threads; };
  // Group g's row of this thread into `stage`, as one commit group (empty past the last row).
  auto fetch = [&](int g, int stage) {
    const int row = g * P + rr;
    if (g < groups && row < rows) {
      const Tin* src = static_cast<const Tin*>(a.x) + static_cast<int64_t>(row) * a.cols + t * 4;
#pragma unroll
      for (int q = 0; q < kQuads; ++q) __pipeline_memcpy_async(at(stage, q), src + q * (T * 4), sizeof(uint2));
    }
    __pipeline_commit();
  };
  uint32_t amax_bits = 0;
  int slot = 0, stage = 0;
  fetch(blockIdx.x, 0);
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {
    fetch(g + gridDim.x, stage ^ 1);  // into the stage this thread read in the previous iteration
    __pipeline_wait_prior(1);          // this group's row has landed
    const int row = g * P + rr;
    auto chunk = [&](int j) {
      const uint2 lo = *at(stage, 2 * j), hi = *at(stage, 2 * j + 1);
      Chunk<Tin> c;
      c.raw[0] = make_uint4(lo.x, lo.y, hi.x, hi.y);
      return c;
    };
    NormRow<Tin, Tout, kRms, kN, true, true>(a, p, chunk, row, row < rows,
                                             static_cast<int64_t>(row) * a.cols + t * 4, red, slot, amax_bits,
                                             [](int, uint2) {});
    stage ^= 1;
  }
  __pipeline_wait_prior(0);  // nothing in flight at exit (the last group is empty)
  if constexpr (Out<Tout>::kFp8) BlockAmax(amax_bits, a.amax, amax_scratch);
}

// Any shape: one row per block, each pass re-reading the row (from L1/L2), scalar accesses.
template <typename Tin, typename Tout, bool kRms>
__global__ void __launch_bounds__(kGenericThreads) NormFwdGenericKernel(FwdArgs a) {
  __shared__ __align__(16) float red[2][1][kMaxWarps];
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
    RowSum(s, blockDim.x, 0, red[0]);
    mean = s[0] / n;
  }
  float s2[1] = {0.0f};
  for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
    const float d = ToFloat(xr[c]) - mean;
    s2[0] = fmaf(d, d, s2[0]);
  }
  RowSum(s2, blockDim.x, 0, red[1]);
  const float rsigma = __frsqrt_rn(s2[0] / n + a.epsilon);
  if (threadIdx.x == 0) {
    if constexpr (!kRms) a.mean[row] = mean;
    a.rsigma[row] = rsigma;
  }
  uint32_t amax_bits = 0;
  for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
    const float y = Normalize<kRms>(ToFloat(xr[c]), mean, rsigma, a.gamma[c], kRms ? 0.0f : a.beta[c]);
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

// ---- launch policy ------------------------------------------------------------------------------------------------

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

// NormFwdRingKernel: as many blocks as the device holds at once (at most one per group of rows), each with its
// two-stage ring of 2 * kN 8-byte slots per thread. FP8 outputs of hidden 4096 and 8192 (kN = 4, T = 128 or 256) take
// the kernel compiled for their T: measured at (32768, 8192) bf16 -> E4M3 (benchmarks/DECISIONS.md).
template <typename Tin, typename Tout>
ffi::Error LaunchRing(cudaStream_t stream, const FwdArgs& a, bool rms, int n) {
  const int threads = a.rows_per_pass * a.threads_per_row;
  const int64_t groups = (a.rows + a.rows_per_pass - 1) / a.rows_per_pass;
  ffi::Error err = ffi::Error::Success();
  auto launch = [&](auto kernel, int chunks) {
    const size_t smem = static_cast<size_t>(2 * 2 * chunks) * sizeof(uint2) * threads;
    cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (status == cudaSuccess) {
      const int resident = ResidentBlocks(kernel, threads, smem);
      const int64_t blocks = resident > 0 ? std::min<int64_t>(groups, resident) : groups;
      status = LaunchWithSharedMemory(kernel, blocks, threads, smem, stream, a);
    }
    err = CudaError(status, "norm_fwd ring kernel launch");
  };
  DispatchBool(rms, [&](auto kRms) {
    constexpr bool kR = decltype(kRms)::value;
    if constexpr (Out<Tout>::kFp8) {
      if (n == 4 && a.threads_per_row == 128) return launch(NormFwdRingKernel<Tin, Tout, kR, 4, 128>, 4);
      if (n == 4 && a.threads_per_row == 256) return launch(NormFwdRingKernel<Tin, Tout, kR, 4, 256>, 4);
    }
    DispatchN<2, 4>(n, [&](auto kN) {
      constexpr int kChunks = decltype(kN)::value;
      launch(NormFwdRingKernel<Tin, Tout, kR, kChunks, 0>, kChunks);
    });
  });
  return err;
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
  a.rows_per_pass = FwdRowsPerBlock(shape.threads);
  a.passes = 1;
  if constexpr (sizeof(Tin) == 2) {
    // The ring kernel's row and group indices are 32-bit: at most 2^30 rows keep g * P + rr and g + gridDim.x in
    // range.
    if (a.out_t == nullptr && chunks == shape.n * shape.threads && a.rows <= (int64_t{1} << 30)) {
      return LaunchRing<Tin, Tout>(stream, a, rms, shape.n);
    }
  }
  size_t smem = 0;
  if (a.out_t != nullptr) {
    const int pitch = shape.n * shape.threads * kVec;
    const int staged_rows = std::max(a.rows_per_pass, std::min(16, PowerOfTwoAtMost(kStageBytes / pitch)));
    a.passes = staged_rows / a.rows_per_pass;
    smem = static_cast<size_t>(staged_rows) * pitch;
  }
  const int64_t rows_per_block = static_cast<int64_t>(a.rows_per_pass) * a.passes;
  int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  const int threads = a.rows_per_pass * shape.threads;
  ffi::Error err = ffi::Error::Success();
  DispatchBool(rms, [&](auto kRms) {
    auto launch = [&](auto kN) {
      auto kernel = NormFwdKernel<Tin, Tout, decltype(kRms)::value, decltype(kN)::value>;
      // Without staging: more blocks than fit on the device at once loop instead, each resident block taking every
      // gridDim.x-th group of P rows, so the per-block work (index setup, the amax atomic) is paid once per block and
      // 16-bit rows are loaded one pass ahead. Measured at (32768, 8192) bf16 -> E4M3 (before the prefetch): RMSNorm
      // 0.254 -> 0.236 ms; the LayerNorm kernel, then with two row reductions, 0.274 -> 0.281 ms.
      const int resident = a.out_t == nullptr ? ResidentBlocks(kernel, threads, smem) : 0;
      if (resident > 0 && blocks > resident) {
        a.strided = true;
        a.passes = static_cast<int>((blocks + resident - 1) / resident);
        blocks = resident;
      }
      err = CudaError(LaunchWithSharedMemory(kernel, blocks, threads, smem, stream, a), "norm_fwd kernel launch");
    };
    DispatchN<2, 4>(shape.n, launch);
  });
  return err;
}

// ---- handler ------------------------------------------------------------------------------------------------------

ffi::Error NormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::BufferR1<ffi::F32> gamma,
                       ffi::BufferR0<ffi::F32> scale, ffi::BufferR1<ffi::F32> beta, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> out_t, ffi::Result<ffi::AnyBuffer> amax,
                       ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rsigma, bool rmsnorm,
                       float epsilon) {
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
  a.inv_n = (cols & (cols - 1)) == 0 ? 1.0f / static_cast<float>(cols) : 0.0f;
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
  return WithFloatType(x.element_type(), "norm_fwd: x must be float32, bfloat16 or float16", with_input);
}

}  // namespace

// Allocates nothing: XLA may capture it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(NormFwdCudaHandler, NormFwdCuda,
                              NormFwdSignature(BindWithStream()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
