// CUDA handler for te_grouped_gemm (te_jax/ops/grouped_gemm.py): the grouped GEMMs of a mixture-of-experts layer
// through cuBLASLt, with the group sizes read on the device only, so that a CUDA graph of the step replays any
// routing.
//
// The rows (tokens) are cut into tiles of `tile` rows, and every group's size must be a multiple of the tile (the
// Python side lays the groups out so: te_jax.fused.grouped_dense pads them); each tile then belongs to one group or
// to none (past the groups). A small kernel reads the sizes and writes, per tile, the A, B and D pointers of its GEMM
// (and, contracting, its alpha and beta), which cuBLASLt reads in pointer-array mode:
//
// - rows grouped: lhs (M, K), rhs (G, N, K), out (M, N): tile c's rows of out = tile c's rows of lhs . rhs[g]^T,
//   every tile in one pointer-array launch. cuBLASLt has no per-batch scale in this mode (its alpha vectors answer
//   NOT_SUPPORTED with FP8 on Hopper), so FP8 products come out unscaled (`unscaled`): the caller multiplies each row
//   by its group's two reciprocal scales, in the elementwise pass that follows anyway.
// - ragged contracting: lhs (K, M), rhs (N, M), out (G, K, N) float32: out[g] = sum over g's tiles of lhs[:, tile] .
//   rhs[:, tile]^T, one launch per tile (a pointer array of one, device alpha and beta), accumulated in place in
//   float32 (beta 1 after the group's first tile), alpha the product of the group's two reciprocal scales. Each
//   launch reads and writes the whole (K, N) matrix, so small tiles are slow: a grouped kernel keeping the sum on
//   chip is what this form wants.
//
// A tile past the groups computes into a scratch output in the workspace. A fill kernel writes zeros where no tile
// writes (rows past the groups; an empty group's matrix), and NaN over the whole output where the sizes are no
// grouping at all (a negative size, a sum past M, a size that is not a multiple of the tile): the reference's NaN
// for invalid traced sizes, loud where a silent misgrouping would be wrong.
//
// Both operands K-major (cuBLASLt's only FP8 layout, "TN"): FP8 (E4M3 or E5M2, not both E5M2), or both bfloat16 /
// float16 / float32. cuBLASLt's plan (descriptor, layouts, the heuristic's first algorithm) is built once per
// device and problem; each call only looks it up.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "te_jax/cublaslt_util.h"
#include "te_jax/cuda_check.h"
#include "te_jax/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

// cuBLASLt's share of the workspace, as te_gemm's.
constexpr size_t kCublasBytes = 32u << 20;
constexpr int kSetupThreads = 256;
constexpr int kMaxGroups = 1024;  // group offsets held in the setup kernel's shared memory

size_t RoundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// The workspace's parts, in bytes from its start: cuBLASLt's, the pointer arrays (A, B, D per tile), the alphas and
// betas (one float each per tile) and the invalid-sizes flag, then the scratch output of the tiles past the groups.
struct Carve {
  size_t pointers, scalars, scratch, total;
};

Carve CarveWorkspace(int64_t tiles, int64_t scratch_bytes) {
  Carve c{};
  c.pointers = kCublasBytes;
  c.scalars = c.pointers + RoundUp(3 * 8 * tiles, 256);
  c.scratch = c.scalars + RoundUp(2 * 4 * tiles + 4, 256);
  c.total = c.scratch + RoundUp(scratch_bytes, 256);
  return c;
}

// cuBLASLt's type of an operand or output: the GEMM's types less FP4, which no grouped form takes.
ffi::ErrorOr<cudaDataType_t> CudaType(ffi::DataType t) {
  if (t == ffi::DataType::F4E2M1FN) return ffi::Error::InvalidArgument("grouped_gemm: unsupported data type");
  return CublasType(t, "grouped_gemm");
}

struct SetupArgs {
  const int32_t* sizes;
  int groups;
  const float* lhs_scale;  // reciprocal scales: one per group, or one for all (per_group false)
  const float* rhs_scale;
  bool lhs_per_group, rhs_per_group;
  int64_t rows, tile, tiles;
  bool ragged;
  // Rows grouped: A = rhs + g * a_group, B = lhs + c * b_tile, D = out + c * d_tile.
  // Ragged contracting: A = rhs + c * a_tile, B = lhs + c * b_tile, D = out + g * d_group.
  const char* a;
  const char* b;
  char* d;
  int64_t a_step, b_step, d_step;  // bytes: per group for A (rows grouped) or D (ragged), else per tile
  char* scratch;
  const void** a_ptrs;
  const void** b_ptrs;
  void** d_ptrs;
  float* alpha;
  float* beta;
  int* invalid;  // written: whether the sizes are no grouping of the rows into whole tiles
};

// One block: the group offsets in shared memory, then each thread a strided share of the tiles.
__global__ void __launch_bounds__(kSetupThreads) SetupTiles(SetupArgs s) {
  __shared__ int64_t ends[kMaxGroups];
  __shared__ int bad;
  if (threadIdx.x == 0) {
    int64_t end = 0;
    int b = 0;
    for (int g = 0; g < s.groups; ++g) {
      const int32_t n = s.sizes[g];
      if (n < 0 || n % s.tile != 0) b = 1;
      end += n < 0 ? 0 : n;
      ends[g] = end;
    }
    if (end > s.rows) b = 1;
    bad = b;
    *s.invalid = b;
  }
  __syncthreads();
  const int64_t total = ends[s.groups - 1];
  for (int64_t c = threadIdx.x; c < s.tiles; c += blockDim.x) {
    const int64_t row = c * s.tile;
    int g = -1;
    if (!bad && row < total) {
      int lo = 0, hi = s.groups - 1;  // the first group whose end is past row
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (ends[mid] > row) hi = mid; else lo = mid + 1;
      }
      g = lo;
    }
    const int gs = g < 0 ? 0 : g;
    if (s.ragged) {
      s.a_ptrs[c] = s.a + c * s.a_step;
      s.b_ptrs[c] = s.b + c * s.b_step;
      s.d_ptrs[c] = g < 0 ? s.scratch : s.d + gs * s.d_step;
      const int64_t start = gs == 0 ? 0 : ends[gs - 1];
      s.beta[c] = (g < 0 || row == start) ? 0.0f : 1.0f;
    } else {
      s.a_ptrs[c] = s.a + gs * s.a_step;
      s.b_ptrs[c] = s.b + c * s.b_step;
      s.d_ptrs[c] = g < 0 ? s.scratch : s.d + c * s.d_step;
      s.beta[c] = 0.0f;
    }
    s.alpha[c] = s.lhs_scale[s.lhs_per_group ? gs : 0] * s.rhs_scale[s.rhs_per_group ? gs : 0];  // ragged only
  }
}

template <typename T>
__device__ T FillValue(bool nan) {
  return static_cast<T>(nan ? NAN : 0.0f);
}

// Zeros where no tile writes (rows past the groups; empty groups' matrices), NaN everywhere for invalid sizes.
// Rows grouped: block (x, y) covers row tile x's columns y * 256 * 4...; ragged: block x covers group x / per of
// out's (K, N) matrix in chunks. Each block exits at once where its region is written by a GEMM.
template <typename T>
__global__ void FillUnwritten(T* out, const int32_t* sizes, int groups, const int* invalid, bool ragged,
                              int64_t rows, int64_t cols, int64_t group_elems) {
  const bool nan = *invalid != 0;
  if (!ragged) {
    int64_t total = 0;
    for (int g = 0; g < groups; ++g) total += sizes[g] < 0 ? 0 : sizes[g];
    const int64_t first = nan ? 0 : total;  // rows from here on
    const int64_t row = blockIdx.x;
    if (row < first || row >= rows) return;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) out[row * cols + j] = FillValue<T>(nan);
    return;
  }
  const int64_t per = (group_elems + 4095) / 4096;  // blocks per group
  const int g = static_cast<int>(blockIdx.x / per);
  if (g >= groups || (!nan && sizes[g] != 0)) return;
  const int64_t start = (blockIdx.x % per) * 4096, end = start + 4096 < group_elems ? start + 4096 : group_elems;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) out[g * group_elems + i] = FillValue<T>(nan);
}

using PlanKey = std::tuple<int, bool, int64_t, int64_t, int64_t, int64_t, int, int, int, bool, int64_t>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    for (auto l : {a, b, d}) if (l) cublasLtMatrixLayoutDestroy(l);
  }
};

struct Cache {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

Cache& GetCache() {
  static Cache* cache = new Cache();  // never destroyed: handles must outlive every executable
  return *cache;
}

// One tile's GEMM in cuBLAS's column-major terms: D (m x n) = A^T (m x k) . B (k x n), A (k x m, ld lda) and B
// (k x n, ld ldb) K-major, D ld m; a pointer array of `batch` (rows grouped: every tile, host alpha 1 and beta 0) or
// of one (ragged contracting: device alpha and beta).
struct Shape {
  int64_t m, n, k, lda, ldb, batch;
};

ffi::ErrorOr<Plan*> GetPlan(cublasLtHandle_t handle, Cache& cache, int device, bool ragged, const Shape& s,
                            cudaDataType_t a_type, cudaDataType_t b_type, cudaDataType_t d_type, bool fast_accum) {
  const PlanKey key{device, ragged, s.m, s.n, s.k, s.lda, a_type, b_type, d_type, fast_accum, s.batch};
  auto it = cache.plans.find(key);
  if (it != cache.plans.end()) return it->second.get();
  auto plan = std::make_unique<Plan>();
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "grouped_gemm desc");
  const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)),
                            "grouped_gemm TRANSA");
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)),
                            "grouped_gemm TRANSB");
  if (ragged) {
    const int32_t mode = CUBLASLT_POINTER_MODE_DEVICE;
    TE_JAX_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof(mode)),
        "grouped_gemm POINTER_MODE");
  }
  const bool fp8 = a_type == CUDA_R_8F_E4M3 || a_type == CUDA_R_8F_E5M2;
  if (fp8) {
    const int8_t fast = fast_accum ? 1 : 0;
    TE_JAX_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
        "grouped_gemm FAST_ACCUM");
  }
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->a, a_type, s.k, s.m, s.lda), "grouped_gemm layout A");
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, b_type, s.k, s.n, s.ldb), "grouped_gemm layout B");
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->d, d_type, s.m, s.n, s.m), "grouped_gemm layout D");
  const uint32_t batch_mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
  const int32_t count = static_cast<int32_t>(s.batch);
  for (cublasLtMatrixLayout_t layout : {plan->a, plan->b, plan->d}) {
    TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &batch_mode,
                                                               sizeof(batch_mode)),
                              "grouped_gemm BATCH_MODE");
    TE_JAX_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
        "grouped_gemm BATCH_COUNT");
  }
  cublasLtMatmulPreference_t pref;
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref), "grouped_gemm preference");
  const size_t ws = kCublasBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d, plan->d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    return ffi::Error::InvalidArgument("grouped_gemm: cuBLASLt has no algorithm for m=" + std::to_string(s.m) +
                                       " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) +
                                       " in pointer-array mode (batch " + std::to_string(s.batch) + ")");
  }
  plan->algo = result.algo;
  Plan* raw = plan.get();
  cache.plans.emplace(key, std::move(plan));
  return raw;
}

template <typename T>
void LaunchFill(void* out, const int32_t* sizes, int groups, const int* invalid, bool ragged, int64_t rows,
                int64_t cols, int64_t group_elems, cudaStream_t stream) {
  const int64_t blocks = ragged ? groups * ((group_elems + 4095) / 4096) : rows;
  if (blocks > 0) {
    FillUnwritten<T><<<blocks, 256, 0, stream>>>(static_cast<T*>(out), sizes, groups, invalid, ragged, rows, cols,
                                                 group_elems);
  }
}

ffi::Error GroupedGemmCuda(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::F32> lhs_scale_inv,
                           ffi::Buffer<ffi::F32> rhs_scale_inv, ffi::Result<ffi::AnyBuffer> workspace,
                           ffi::Result<ffi::AnyBuffer> out, bool ragged, int64_t tile, bool fast_accum) {
  const auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  const int groups = static_cast<int>(group_sizes.element_count());
  if (groups < 1 || groups > kMaxGroups) {
    return ffi::Error::InvalidArgument("grouped_gemm: between 1 and " + std::to_string(kMaxGroups) + " groups");
  }
  int64_t rows, k_dim, n_dim;  // the grouped M, the output's other two dims
  if (ragged) {                // lhs (K, M), rhs (N, M), out (G, K, N) float32
    if (ld.size() != 2 || rd.size() != 2 || ld[1] != rd[1] || od.size() != 3 || od[0] != groups || od[1] != ld[0] ||
        od[2] != rd[0] || out->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("grouped_gemm: ragged contracting needs lhs (K, M), rhs (N, M), out (G, K, N)"
                                         " float32");
    }
    rows = ld[1], k_dim = ld[0], n_dim = rd[0];
  } else {  // lhs (M, K), rhs (G, N, K), out (M, N)
    if (ld.size() != 2 || rd.size() != 3 || rd[0] != groups || rd[2] != ld[1] || od.size() != 2 || od[0] != ld[0] ||
        od[1] != rd[1]) {
      return ffi::Error::InvalidArgument("grouped_gemm: needs lhs (M, K), rhs (G, N, K), out (M, N)");
    }
    rows = ld[0], k_dim = ld[1], n_dim = rd[1];
  }
  if (tile < 16 || tile % 16 != 0 || rows % tile != 0) {
    return ffi::Error::InvalidArgument("grouped_gemm: tile must be a multiple of 16 dividing M = " +
                                       std::to_string(rows) + ", got " + std::to_string(tile));
  }
  const int64_t lsc = lhs_scale_inv.element_count(), rsc = rhs_scale_inv.element_count();
  if ((lsc != 1 && lsc != groups) || (rsc != 1 && rsc != groups)) {
    return ffi::Error::InvalidArgument("grouped_gemm: scales are one per group or one for all");
  }
  auto a_type = CudaType(rhs.element_type()), b_type = CudaType(lhs.element_type());
  auto d_type = CudaType(out->element_type());
  if (a_type.has_error()) return a_type.error();
  if (b_type.has_error()) return b_type.error();
  if (d_type.has_error()) return d_type.error();
  const int64_t tiles = rows / tile;
  const size_t out_bytes = ffi::ByteWidth(out->element_type());
  const int64_t scratch_bytes = ragged ? k_dim * n_dim * 4 : tile * n_dim * static_cast<int64_t>(out_bytes);
  const Carve carve = CarveWorkspace(tiles, scratch_bytes);
  if (workspace->size_bytes() < carve.total) {
    return ffi::Error::InvalidArgument("grouped_gemm: workspace of " + std::to_string(workspace->size_bytes()) +
                                       " bytes, needs " + std::to_string(carve.total));
  }
  char* ws = static_cast<char*>(workspace->untyped_data());
  float* scalars = reinterpret_cast<float*>(ws + carve.scalars);
  int* invalid = reinterpret_cast<int*>(scalars + 2 * tiles);
  const void** ptrs = reinterpret_cast<const void**>(ws + carve.pointers);
  const size_t lw = ffi::ByteWidth(lhs.element_type()), rw = ffi::ByteWidth(rhs.element_type());
  SetupArgs s{};
  s.sizes = group_sizes.typed_data();
  s.groups = groups;
  s.lhs_scale = lhs_scale_inv.typed_data();
  s.rhs_scale = rhs_scale_inv.typed_data();
  s.lhs_per_group = lsc == groups && groups > 1;
  s.rhs_per_group = rsc == groups && groups > 1;
  s.rows = rows, s.tile = tile, s.tiles = tiles, s.ragged = ragged;
  s.a = static_cast<const char*>(rhs.untyped_data());
  s.b = static_cast<const char*>(lhs.untyped_data());
  s.d = static_cast<char*>(out->untyped_data());
  if (ragged) {
    s.a_step = tile * rw, s.b_step = tile * lw, s.d_step = k_dim * n_dim * 4;
  } else {
    s.a_step = n_dim * k_dim * rw, s.b_step = tile * k_dim * lw, s.d_step = tile * n_dim * out_bytes;
  }
  s.scratch = ws + carve.scratch;
  s.a_ptrs = ptrs, s.b_ptrs = ptrs + tiles, s.d_ptrs = const_cast<void**>(ptrs + 2 * tiles);
  s.alpha = scalars, s.beta = scalars + tiles;
  s.invalid = invalid;
  SetupTiles<<<1, kSetupThreads, 0, stream>>>(s);
  TE_JAX_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "grouped_gemm setup");
  const int64_t group_elems = k_dim * n_dim;
  switch (out->element_type()) {
    case ffi::DataType::F32:
      LaunchFill<float>(s.d, s.sizes, groups, invalid, ragged, rows, n_dim, group_elems, stream);
      break;
    case ffi::DataType::BF16:
      LaunchFill<__nv_bfloat16>(s.d, s.sizes, groups, invalid, ragged, rows, n_dim, group_elems, stream);
      break;
    case ffi::DataType::F16:
      LaunchFill<__half>(s.d, s.sizes, groups, invalid, ragged, rows, n_dim, group_elems, stream);
      break;
    default: return ffi::Error::InvalidArgument("grouped_gemm: out must be float32, bfloat16 or float16");
  }
  TE_JAX_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "grouped_gemm fill");
  if (k_dim == 0 || n_dim == 0 || tiles == 0) return ffi::Error::Success();

  int device;
  TE_JAX_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  // Column-major per tile: rows grouped, D (N x tile) = A^T (rhs[g]: K x N) . B (lhs tile: K x tile); ragged,
  // D (N x K) = A^T (rhs tile: tile x N, ld M) . B (lhs tile: tile x K, ld M).
  const Shape shape =
      ragged ? Shape{n_dim, k_dim, tile, rows, rows, 1} : Shape{n_dim, tile, k_dim, k_dim, k_dim, tiles};
  Cache& cache = GetCache();
  std::lock_guard<std::mutex> lock(cache.mu);
  cublasLtHandle_t handle;
  Plan* plan;
  {
    RelaxedCapture relaxed;
    auto h = cache.handles.find(device);
    if (h == cache.handles.end()) {
      TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&handle), "grouped_gemm create handle");
      cache.handles.emplace(device, handle);
    } else {
      handle = h->second;
    }
    auto got = GetPlan(handle, cache, device, ragged, shape, *a_type, *b_type, *d_type, fast_accum);
    if (got.has_error()) return got.error();
    plan = *got;
  }
  if (!ragged) {  // every tile at once, unscaled
    const float one = 1.0f, zero = 0.0f;
    TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(handle, plan->desc, &one, s.a_ptrs, plan->a, s.b_ptrs, plan->b, &zero,
                                             s.d_ptrs, plan->d, s.d_ptrs, plan->d, &plan->algo, ws, kCublasBytes,
                                             stream),
                              "grouped_gemm matmul");
    return ffi::Error::Success();
  }
  for (int64_t c = 0; c < tiles; ++c) {
    TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(handle, plan->desc, s.alpha + c, s.a_ptrs + c, plan->a, s.b_ptrs + c,
                                             plan->b, s.beta + c, s.d_ptrs + c, plan->d, s.d_ptrs + c, plan->d,
                                             &plan->algo, ws, kCublasBytes, stream),
                              "grouped_gemm matmul");
  }
  return ffi::Error::Success();
}

}  // namespace

WorkspaceSize GroupedGemmWorkspace(bool ragged, int64_t rows, int64_t k, int64_t n, int64_t tile, int out_bytes) {
  const int64_t tiles = tile > 0 ? rows / tile : 0;
  const int64_t scratch = ragged ? k * n * 4 : tile * n * out_bytes;
  return {static_cast<int64_t>(CarveWorkspace(tiles, scratch).total), ffi::DataType::U8};
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmCudaHandler, GroupedGemmCuda,
                              BindWithStream()
                                  .Arg<ffi::AnyBuffer>()           // lhs: (M, K); ragged (K, M)
                                  .Arg<ffi::AnyBuffer>()           // rhs: (G, N, K); ragged (N, M)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // group_sizes: (G,)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lhs_scale_inv: (G,) or (1,)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // rhs_scale_inv: (G,) or (1,)
                                  .Ret<ffi::AnyBuffer>()           // workspace: u8[GroupedGemmWorkspace(...)]
                                  .Ret<ffi::AnyBuffer>()           // out: (M, N); ragged (G, K, N) float32
                                  .Attr<bool>("ragged_contracting")
                                  .Attr<int64_t>("tile")           // rows per tile; every group a multiple of it
                                  .Attr<bool>("fast_accum"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
