// CUDA handler for te_norm_bwd: the gradients of LayerNorm/RMSNorm over the last dim (te_jax/ops/norm.py defines the
// math; this file computes exactly its elementwise part, and its sums in a fixed order). What it shares with
// norm_fwd.cu: norm.cuh.
//
// Backward: "workers" of T threads each own a fixed block of consecutive rows and a fixed set of columns. Per row they
// copy x and dz into a shared-memory ring (cp.async, one or two rows ahead of the row being reduced), reduce the two
// row sums like the forward, write dx, and accumulate dgamma (registers) and dbeta (shared memory) for their columns.
// Each worker then writes its partial sums as one row of the XLA-allocated workspace, and a column-sum kernel adds the
// partial rows in a fixed order: the same bits on every run.
#include <cuda_pipeline.h>

#include "norm.cuh"
#include "te_jax/workspace.h"

namespace te_jax {
namespace {

// Backward partial rows (BwdPartialRows): at least 256, and 2^20 / cols when more, which gives ~2^17 threads (8
// columns each) to fill the GPU when rows are short.
constexpr int kBwdMinPartials = 256;
constexpr int64_t kBwdPartialElems = 1 << 20;
constexpr int kColSumCols = 32;                // column-sum kernel: columns per block
constexpr int kColSumSlices = 8;               // ... and partial-row slices summed in parallel, then in order

// 8 float32 parameters (gamma), from L1: every row reads the same ones.
__device__ __forceinline__ void LoadParams(const float* p, float (&v)[kVec]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// ---- backward -----------------------------------------------------------------------------------------------------

struct BwdArgs {
  const void* dz;
  const void* x;
  const float* mean;  // LayerNorm only
  const float* rsigma;
  const float* gamma;
  const void* dres;  // a gradient added to dx (x's shape and type), or null
  void* dx;
  float* partial;     // [partial_rows][cols] dgamma partials, then (LayerNorm) as many dbeta partials
  int64_t rows;
  int cols;
  int threads_per_row;  // T
  int workers_per_block;
  int workers;
  int64_t partial_rows;  // the workspace's row count per parameter (>= workers)
  int64_t row_block;     // rows per worker
};

// Resident blocks per SM the backward kernel is compiled for: 2 (at most 64 registers per thread) for 16-bit x and
// dz with up to 2 chunks per thread, so that the 256 workers of a large input (512 threads each at hidden 8192) are
// resident at once on 132 SMs instead of running in two waves (before: 122 registers, one block per SM); otherwise
// 1. Shared memory does not cap this: since Volta the driver picks each kernel's shared-memory carveout to fit the
// resident blocks (NVIDIA's tuning guides, Volta and later).
template <typename T, typename Tdz, int kN>
constexpr int BwdMinBlocks() {
  return sizeof(T) == 2 && sizeof(Tdz) == 2 && kN <= 2 ? 2 : 1;
}

// One chunk per thread of 16-bit x and dz: the kernel holds the chunk, its gamma and (LayerNorm) its dbeta sums in
// registers, where 64 registers still leave no spills. Per row that saves the second ring read of x and dz, the
// second gamma load and the dbeta read-modify-write in shared memory: at hidden 4096 (the kernel is bound by
// instruction issue and the shared-memory pipe there, not by DRAM) 0.082 -> 0.076 ms for 8192 rows.
template <typename T, typename Tdz, int kN>
constexpr bool HoldsChunk() {
  return sizeof(T) == 2 && sizeof(Tdz) == 2 && kN == 1;
}

// Shared memory of the fast backward kernel, per thread: a ring of kStages rows of x and dz (the next rows are copied
// in with cp.async, 16 bytes per copy, each thread its own chunks, so no barrier, while the current row is reduced:
// kStages - 1 rows in flight), then (LayerNorm, unless HoldsChunk) the thread's dbeta accumulators, kept here rather
// than in registers so that 2 blocks of 512 threads fit an SM without spills. Three stages where the total stays within
// 96 KiB at 512 threads (two such blocks per SM), else two. With dres (kRes), its rows join the ring where a two-stage
// ring of the three still lets BwdMinBlocks blocks share an SM (kResRing); otherwise each thread loads its dres chunks
// from global memory in the normalize pass.
template <typename T, typename Tdz, bool kRms, bool kRes, int kN>
struct BwdSmem {
  static constexpr int kWx = Chunk<T>::kWords;    // uint4 per chunk of x (and of dres) ...
  static constexpr int kWdz = Chunk<Tdz>::kWords;  // ... and of dz
  static constexpr bool kDbRegs = !kRms && HoldsChunk<T, Tdz, kN>();
  static constexpr int kAcc = kRms || kDbRegs ? 0 : kN * kVec / 4;  // float4 dbeta accumulators per thread
  static constexpr bool kResRing =
      kRes && (2 * kN * (2 * kWx + kWdz) + kAcc) * 16 * kMaxBlock * BwdMinBlocks<T, Tdz, kN>() <= 224 * 1024;
  static constexpr int kWr = kResRing ? kWx : 0;
  static constexpr int kSlots = kN * (kWx + kWdz + kWr);  // uint4 per thread and stage: x's, dz's, dres's chunks
  static constexpr int kStages = (3 * kSlots + kAcc) * 16 * kMaxBlock <= 96 * 1024 ? 3 : 2;
  static constexpr size_t Bytes(int threads) {
    return static_cast<size_t>(kStages * kSlots + kAcc) * 16 * threads;
  }
};

template <typename T, typename Tdz, bool kRms, bool kRes, int kN>
__global__ void __launch_bounds__(kMaxBlock, BwdMinBlocks<T, Tdz, kN>()) NormBwdKernel(BwdArgs a) {
  using Smem = BwdSmem<T, Tdz, kRms, kRes, kN>;
  constexpr int kStages = Smem::kStages;
  constexpr int kSlots = Smem::kSlots;
  constexpr int kWx = Smem::kWx;
  constexpr int kWdz = Smem::kWdz;
  constexpr int kWr = Smem::kWr;
  extern __shared__ uint4 ring[];  // [stage][slot][thread], then the dbeta accumulators [k][thread]
  __shared__ __align__(16) float red[2][2][kMaxWarps];
  const int Tn = a.threads_per_row;
  const int t = threadIdx.x % Tn;
  const int group = threadIdx.x / Tn;  // this thread's worker in the block
  const int worker = blockIdx.x * a.workers_per_block + group;
  const int64_t first = worker * a.row_block;
  const int64_t end = min(first + a.row_block, a.rows);  // first >= rows for idle workers: no rows
  const int chunks = a.cols / kVec;
  const float n = static_cast<float>(a.cols);
  float4* db = reinterpret_cast<float4*>(ring + kStages * kSlots * blockDim.x) + threadIdx.x;  // db[k * blockDim.x]
  float dg[kN][kVec];
  float dbr[kN][kVec];  // the dbeta sums with Smem::kDbRegs
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) dg[j][i] = dbr[j][i] = 0.0f;
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
        for (int w = 0; w < kWdz; ++w) {
          __pipeline_memcpy_async(slot(i, kN * kWx + j * kWdz + w), dzs + w, sizeof(uint4));
        }
        if constexpr (Smem::kResRing) {
          const uint4* rs = reinterpret_cast<const uint4*>(static_cast<const T*>(a.dres) + row * a.cols + c * kVec);
#pragma unroll
          for (int w = 0; w < kWr; ++w) {
            __pipeline_memcpy_async(slot(i, kN * (kWx + kWdz) + j * kWr + w), rs + w, sizeof(uint4));
          }
        }
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
    // x and dz of chunk j, read from the ring in the first pass and again in the second (fewer registers than
    // holding them), unless HoldsChunk.
    constexpr bool kHold = HoldsChunk<T, Tdz, kN>();
    Chunk<T> xh[kN];
    Chunk<Tdz> dzh[kN];
    float gh[kN][kVec];
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
      Chunk<T>& xc = xh[j];
      Chunk<Tdz>& dzc = dzh[j];
      float(&g)[kVec] = gh[j];
      read(j, xc, dzc);
      LoadParams(a.gamma + c * kVec, g);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float xhat = kRms ? xc.Get(e) * rs : (xc.Get(e) - m) * rs;
        const float d = dzc.Get(e);
        const float dy = d * g[e];
        s[0] += dy;
        s[1] = fmaf(dy, xhat, s[1]);
        dg[j][e] = fmaf(d, xhat, dg[j][e]);
      }
      if constexpr (Smem::kDbRegs) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) dbr[j][e] += dzc.Get(e);
      } else if constexpr (!kRms) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float4& b = db[(2 * j + h) * blockDim.x];
          b = make_float4(b.x + dzc.Get(4 * h), b.y + dzc.Get(4 * h + 1), b.z + dzc.Get(4 * h + 2),
                          b.w + dzc.Get(4 * h + 3));
        }
      }
    }
    RowSum(s, Tn, group, red[red_slot++ & 1]);
    const float c1 = kRms ? 0.0f : s[0] / n;
    const float c2 = s[1] / n;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const int c = t + j * Tn;
      if (!ok || c >= chunks) continue;
      Chunk<T>& xc = xh[j];
      Chunk<Tdz>& dzc = dzh[j];
      float(&g)[kVec] = gh[j];
      if constexpr (!kHold) {
        read(j, xc, dzc);
        LoadParams(a.gamma + c * kVec, g);
      }
      float dx[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float xhat = kRms ? xc.Get(e) * rs : (xc.Get(e) - m) * rs;
        const float dy = dzc.Get(e) * g[e];
        dx[e] = ((dy - c1) - xhat * c2) * rs;
      }
      if constexpr (kRes) {
        Chunk<T> rc;
        if constexpr (Smem::kResRing) {
#pragma unroll
          for (int w = 0; w < kWr; ++w) rc.raw[w] = *slot(i, kN * (kWx + kWdz) + j * kWr + w);
        } else {
          rc.Load(static_cast<const T*>(a.dres) + row * a.cols + c * kVec);
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) dx[e] += rc.Get(e);
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
      if constexpr (Smem::kDbRegs) {
        pb[0] = make_float4(dbr[j][0], dbr[j][1], dbr[j][2], dbr[j][3]);
        pb[1] = make_float4(dbr[j][4], dbr[j][5], dbr[j][6], dbr[j][7]);
      } else {
        pb[0] = db[2 * j * blockDim.x];
        pb[1] = db[(2 * j + 1) * blockDim.x];
      }
    }
  }
}

// Any shape: one worker per block, each pass re-reading the row; the partial sums accumulate in the worker's own
// workspace rows (read-modify-write by the one thread that owns each column).
template <typename T, typename Tdz, bool kRms>
__global__ void __launch_bounds__(kGenericThreads) NormBwdGenericKernel(BwdArgs a) {
  __shared__ __align__(16) float red[2][2][kMaxWarps];
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
      const float xhat = (ToFloat(xs[row * a.cols + c]) - m) * rs;
      const float d = ToFloat(dzs[row * a.cols + c]);
      const float dy = d * a.gamma[c];
      s[0] += dy;
      s[1] = fmaf(dy, xhat, s[1]);
      pg[c] = fmaf(d, xhat, pg[c]);
      if constexpr (!kRms) pb[c] += d;
    }
    RowSum(s, blockDim.x, 0, red[slot++ & 1]);
    const float c1 = kRms ? 0.0f : s[0] / n;
    const float c2 = s[1] / n;
    for (int c = threadIdx.x; c < a.cols; c += blockDim.x) {
      const float xhat = (ToFloat(xs[row * a.cols + c]) - m) * rs;
      const float dy = ToFloat(dzs[row * a.cols + c]) * a.gamma[c];
      float dx = ((dy - c1) - xhat * c2) * rs;
      if (a.dres != nullptr) dx += ToFloat(static_cast<const T*>(a.dres)[row * a.cols + c]);
      Out<T>::StoreOne(a.dx, row * a.cols + c, dx, 1.0f);
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

template <typename T, typename Tdz>
ffi::Error LaunchBwd(cudaStream_t stream, BwdArgs a, bool rms, float* dgamma, float* dbeta) {
  const int chunks = a.cols / kVec;
  // Per thread: x, dz and the two accumulators; with a float32 operand at most 2 chunks, to stay within registers.
  static constexpr int kNs16[] = {1, 2, 4};
  static constexpr int kNs32[] = {1, 2};
  constexpr bool k32 = sizeof(T) == 4 || sizeof(Tdz) == 4;
  const bool aligned = Aligned(a.x, 16) && Aligned(a.dz, 16) && Aligned(a.dx, 16) && Aligned(a.gamma, 16) &&
                       Aligned(a.partial, 16) && Aligned(a.dres, 16);
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
    DispatchBool(rms, [&](auto kRms) { DispatchBool(a.dres != nullptr, [&](auto kRes) {
      auto launch = [&](auto kN) {
        constexpr int n = decltype(kN)::value;
        constexpr bool r = decltype(kRms)::value, res = decltype(kRes)::value;
        auto kernel = NormBwdKernel<T, Tdz, r, res, n>;
        const size_t smem = BwdSmem<T, Tdz, r, res, n>::Bytes(threads);
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
    }); });
  }
  if (err.failure()) return err;
  const dim3 grid((a.cols + kColSumCols - 1) / kColSumCols, rms ? 1 : 2);
  ColumnSumKernel<<<grid, kColSumCols * kColSumSlices, 0, stream>>>(a.partial, dgamma, dbeta, a.workers,
                                                                    a.partial_rows, a.cols);
  return LastCudaError("norm_bwd column-sum launch");
}

// ---- handler ------------------------------------------------------------------------------------------------------

// The workspace's rows per parameter: one per worker, at most one per row. cols >= 1.
int64_t BwdPartialRows(int64_t rows, int64_t cols) {
  return std::min(rows, std::max<int64_t>(kBwdMinPartials, kBwdPartialElems / cols));
}

ffi::Error NormBwdCuda(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer rsigma,
                       ffi::BufferR1<ffi::F32> gamma, ffi::AnyBuffer mean, ffi::AnyBuffer dres,
                       ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::BufferR1<ffi::F32>> dgamma, ffi::Result<ffi::BufferR1<ffi::F32>> dbeta,
                       ffi::Result<ffi::AnyBuffer> workspace, bool rmsnorm) {
  auto shape =
      CheckNormBwd(dz, x, rsigma, Count(gamma), mean, dres, *dx, Count(*dgamma), Count(*dbeta), rmsnorm);
  if (shape.has_error()) return shape.error();
  const int64_t rows = shape->rows, cols = shape->cols;
  if (cols > (1 << 30)) return ffi::Error::InvalidArgument("norm_bwd: x's last dim must be in [1, 2^30]");
  const bool dz_f32 = dz.element_type() == ffi::DataType::F32;
  const int64_t partial_rows = BwdPartialRows(rows, cols);
  const WorkspaceSize need = NormBwdWorkspace(rows, cols, rmsnorm);
  if (workspace->element_type() != need.type || Count(*workspace) != need.count) {
    return ffi::Error::InvalidArgument("norm_bwd: the workspace must be f32[" + std::to_string(need.count) +
                                       "] (te_jax._te_cuda.norm_bwd_workspace)");
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
  a.dres = Count(dres) == 0 ? nullptr : dres.untyped_data();
  a.dx = dx->untyped_data();
  a.partial = static_cast<float*>(workspace->untyped_data());
  a.rows = rows;
  a.cols = static_cast<int>(cols);
  a.partial_rows = partial_rows;
  float* dg = dgamma->typed_data();
  float* db = rmsnorm ? nullptr : dbeta->typed_data();
  return WithFloatType(x.element_type(), "norm_bwd: x must be float32, bfloat16 or float16", [&](auto t) {
    using T = decltype(t);
    return dz_f32 ? LaunchBwd<T, float>(stream, a, rmsnorm, dg, db) : LaunchBwd<T, T>(stream, a, rmsnorm, dg, db);
  });
}

}  // namespace

// dgamma's partial rows, then (LayerNorm) as many of dbeta: the handler's BwdArgs::partial.
WorkspaceSize NormBwdWorkspace(int64_t rows, int64_t cols, bool rmsnorm) {
  return {BwdPartialRows(rows, cols) * cols * (rmsnorm ? 1 : 2), ffi::DataType::F32};
}

// Allocates nothing (the partial sums go to a workspace result): XLA may capture it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(NormBwdCudaHandler, NormBwdCuda,
                              NormBwdAttrs(NormBwdOperands(BindWithStream())
                                               .Ret<ffi::AnyBuffer>()),  // workspace: NormBwdWorkspace
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
