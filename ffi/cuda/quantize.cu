// CUDA handlers for te_quantize: saturating FP8 cast of x * scale (NaN for a non-finite x: Fp8Input in fp8_tile.cuh)
// and amax = max|x| in one pass over x, with the transposed FP8 copy (for Hopper's K-major FP8 GEMMs) and the column
// sums (dbias) fused in when asked for.
//
// Fast path (cols % 8 == 0, and rows % 8 == 0 when transposing): one 256-thread block per 128x128 tile. Each
// thread loads 8 rows x 8 elements (16-byte loads, all in flight before the first use), writes the row-major FP8
// bytes straight out (8-byte stores, coalesced), and parks them in shared memory. For the transposed copy each
// thread then reads an 8x8 byte block back, transposes it in registers (byte permutes) and writes 8 rows of 8
// bytes of qt, again coalesced. Shared memory is XOR-swizzled by row group so that both phases are free of bank
// conflicts. Any other shape goes through a 32x32-tile kernel with scalar accesses.
//
// te_quantize_interleaved reads x from 2-4 arrays ("parts") whose column chunks interleave into x's rows (the
// gradients of q, k and v sliced from a heads-major (H, 3, D) projection, quantized as that projection's output
// gradient): the same kernels, each thread finding its column's part once.
//
// amax is reduced on the bit patterns of |x| (unsigned max): exact, order independent, and a NaN anywhere gives a
// NaN amax, as jnp.max does. dbias is deterministic: per-tile column partials, then a fixed-order column sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "te_jax/cuda_check.h"
#include "te_jax/vec_load.cuh"
#include "te_jax/fp8_tile.cuh"
#include "te_jax/launch_utils.h"
#include "te_jax/quantize_view.h"
#include "te_jax/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Fast path geometry.
constexpr int kTile = 128;                               // tile rows = tile cols
constexpr int kVec = 8;                                  // elements per thread access
constexpr int kChunksPerRow = kTile / kVec;              // 16
constexpr int kRowsPerPass = kThreads / kChunksPerRow;   // 16
constexpr int kRowsPerThread = kTile / kRowsPerPass;     // 8
// Resident blocks per SM for the fast path: 4 (32 warps, so at most 64 registers per thread) where that fits without
// spilling; the float32-input, dbias and interleaved variants hold more per thread and keep 3 (at most 80 registers).
template <typename T, bool kDbias, bool kInterleaved>
constexpr int FastBlocksPerSm() {
  return sizeof(T) == 2 && !kDbias && !kInterleaved ? 4 : 3;
}
// Generic path geometry.
constexpr int kSmallTile = 32;

// Where the kernels read x (batch, rows, cols): one array, or `parts` arrays of (batch, rows, part_cols) whose
// column chunks of `group` interleave into x's columns: x's column c is column (c / (group * parts)) * group +
// c % group of part (c / group) % parts.
template <typename T>
struct Source {
  const T* part[kMaxInterleavedParts];
  int parts;
  int64_t group;
  int64_t part_cols;  // cols / parts: the row stride of every part

  // Row 0 of x's column c in batch element b; the rows that follow are part_cols apart. With parts, cols < 2^31
  // (checked by the handler): 32-bit divisions, which need no call and few registers.
  __device__ __forceinline__ const T* Column(int64_t b, int64_t rows, int64_t c) const {
    const T* base = part[0];
    int64_t offset = c;
    if (parts > 1) {
      const uint32_t g = static_cast<uint32_t>(group);
      const uint32_t chunk = static_cast<uint32_t>(c) / g;
      const uint32_t n = static_cast<uint32_t>(parts);
      base = part[chunk % n];
      offset = static_cast<int64_t>((chunk / n) * g + static_cast<uint32_t>(c) % g);
    }
    return base + b * rows * part_cols + offset;
  }
};

// 8 output bytes; the kernel never reads them back.
__device__ __forceinline__ void StoreOut(uint8_t* p, uint2 v) { *reinterpret_cast<uint2*>(p) = v; }

template <typename T, __nv_fp8_interpretation_t kFmt, bool kTranspose, bool kDbias, bool kInterleaved>
__global__ void __launch_bounds__(kThreads, FastBlocksPerSm<T, kDbias, kInterleaved>())
    CastTransposeKernel(const Source<T> x, const float* __restrict__ scale_ptr, uint8_t* __restrict__ q,
                        uint8_t* __restrict__ qt, const TransposedRows trows, unsigned* __restrict__ amax,
                        float* __restrict__ dbias_partial, int64_t rows, int64_t cols, int64_t tiles_m,
                        int64_t tiles_n) {
  __shared__ uint2 tile[kTranspose ? kTile : 1][kChunksPerRow];
  __shared__ float col_sums[kDbias ? kWarps : 1][kTile];
  __shared__ uint32_t amax_scratch[kWarps];

  const int64_t t = blockIdx.x;
  const int64_t b = t / (tiles_m * tiles_n);
  const int64_t tm = (t / tiles_n) % tiles_m;
  const int64_t tn = t % tiles_n;
  const int64_t row0 = tm * kTile;
  const int64_t col0 = tn * kTile;
  const int chunk = threadIdx.x % kChunksPerRow;
  const int rsub = threadIdx.x / kChunksPerRow;
  const int64_t col = col0 + chunk * kVec;
  const bool col_ok = col < cols;
  const T* xc = !col_ok ? nullptr : kInterleaved ? x.Column(b, rows, col) : x.part[0] + b * rows * cols + col;
  const int64_t stride = kInterleaved ? x.part_cols : cols;
  uint8_t* qb = q + b * rows * cols;
  const float scale = *scale_ptr;

  Chunk<T> in[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = row0 + rsub + i * kRowsPerPass;
    if (col_ok && r < rows) {
      in[i].Load(xc + r * stride);
    } else {
      in[i].Zero();  // zeros leave amax and dbias unchanged
    }
  }

  uint32_t amax_bits = 0;
  float dsum[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) dsum[j] = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    float f[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      f[j] = in[i].Get(j);
      if constexpr (kDbias) dsum[j] += f[j];
    }
    amax_bits = FoldAbsMax8(amax_bits, f);
    uint2 packed;
    packed.x = CastScaled4<kFmt>(f, scale);
    packed.y = CastScaled4<kFmt>(f + 4, scale);
    const int lr = rsub + i * kRowsPerPass;
    const int64_t r = row0 + lr;
    if (col_ok && r < rows) StoreOut(qb + r * cols + col, packed);
    if constexpr (kTranspose) tile[lr][chunk ^ ((lr / 8) % kChunksPerRow)] = packed;
  }

  if constexpr (kTranspose) {
    __syncthreads();
    const int g = threadIdx.x % kChunksPerRow;  // tile rows 8g .. 8g+7
    const int h = threadIdx.x / kChunksPerRow;  // tile cols 8h .. 8h+7
    uint2 v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = tile[8 * g + i][h ^ g];
    const int64_t qr = row0 + 8 * g;  // position along a qt row
    const int64_t c_base = col0 + 8 * h;
    if (qr < rows && c_base < cols) {
      // The 8 columns are in one chunk of the row map (its group is a multiple of 8 here): consecutive rows of qt.
      uint8_t* qtb = qt + b * rows * cols + trows.Row(c_base) * rows;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        StoreOut(qtb + j * rows + qr, TransposedRow(v, j));
      }
    }
  }

  if constexpr (kDbias) {
    // Lanes l and l + 16 of a warp hold the same columns; then the 8 warps are summed in a fixed order.
#pragma unroll
    for (int j = 0; j < kVec; ++j) dsum[j] += __shfl_xor_sync(0xffffffffu, dsum[j], 16);
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 < 16) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) col_sums[warp][chunk * kVec + j] = dsum[j];
    }
    __syncthreads();
    if (threadIdx.x < kTile && col0 + threadIdx.x < cols) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += col_sums[w][threadIdx.x];
      dbias_partial[(b * tiles_m + tm) * cols + col0 + threadIdx.x] = s;
    }
  }
  BlockAmax(amax_bits, amax, amax_scratch);
}

// Any shape: 32x32 tiles, a (32, 8) thread block, one element per access.
template <typename T, __nv_fp8_interpretation_t kFmt, bool kTranspose, bool kDbias>
__global__ void __launch_bounds__(kThreads)
    CastTransposeGenericKernel(const Source<T> x, const float* __restrict__ scale_ptr, uint8_t* __restrict__ q,
                               uint8_t* __restrict__ qt, const TransposedRows trows, unsigned* __restrict__ amax,
                               float* __restrict__ dbias_partial, int64_t rows, int64_t cols, int64_t tiles_m,
                               int64_t tiles_n) {
  __shared__ uint8_t tile[kSmallTile][kSmallTile + 1];
  __shared__ float col_sums[kWarps][kSmallTile];
  __shared__ uint32_t amax_scratch[kWarps];

  const int64_t t = blockIdx.x;
  const int64_t b = t / (tiles_m * tiles_n);
  const int64_t tm = (t / tiles_n) % tiles_m;
  const int64_t tn = t % tiles_n;
  const int64_t row0 = tm * kSmallTile;
  const int64_t col0 = tn * kSmallTile;
  const int tx = threadIdx.x % kSmallTile;
  const int ty = threadIdx.x / kSmallTile;  // 0 .. 7, also the warp index
  const float scale = *scale_ptr;

  uint32_t amax_bits = 0;
  float dsum = 0.0f;
  const int64_t c = col0 + tx;
  const T* xc = c < cols ? x.Column(b, rows, c) : nullptr;
  for (int i = 0; i < kSmallTile / kWarps; ++i) {
    const int lr = ty + i * kWarps;
    const int64_t r = row0 + lr;
    if (r < rows && c < cols) {
      const float f = ToFloat(xc[r * x.part_cols]);
      amax_bits = max(amax_bits, __float_as_uint(f) & 0x7FFFFFFFu);
      if constexpr (kDbias) dsum += f;
      const uint8_t bits = CastScaled<kFmt>(f, scale);
      q[(b * rows + r) * cols + c] = bits;
      if constexpr (kTranspose) tile[lr][tx] = bits;
    }
  }
  if constexpr (kTranspose) {
    __syncthreads();
    for (int i = 0; i < kSmallTile / kWarps; ++i) {
      const int lc = ty + i * kWarps;
      const int64_t c2 = col0 + lc;
      const int64_t r2 = row0 + tx;
      if (c2 < cols && r2 < rows) qt[(b * cols + trows.Row(c2)) * rows + r2] = tile[tx][lc];
    }
  }
  if constexpr (kDbias) {
    col_sums[ty][tx] = dsum;
    __syncthreads();
    if (ty == 0 && c < cols) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += col_sums[w][tx];
      dbias_partial[(b * tiles_m + tm) * cols + c] = s;
    }
  }
  BlockAmax(amax_bits, amax, amax_scratch);
}

// x as a handler received it: `count` parts of (batch, rows, cols / count) with interleaved column chunks of
// `group` (one part, group = cols, for te_quantize).
struct Parts {
  const void* data[kMaxInterleavedParts] = {};
  int count = 1;
  int64_t group = 1;
};

template <typename T, __nv_fp8_interpretation_t kFmt>
ffi::Error Launch(cudaStream_t stream, const QuantizeView& v, const Parts& parts, const TransposedRows& trows,
                  const float* scale, void* q, void* qt, unsigned* amax, float* dbias, float* workspace) {
  Source<T> src{};
  bool aligned = true;
  for (int p = 0; p < parts.count; ++p) {
    src.part[p] = static_cast<const T*>(parts.data[p]);
    aligned = aligned && Aligned(parts.data[p], 16);
  }
  src.parts = parts.count;
  src.group = parts.group;
  src.part_cols = v.cols / parts.count;
  const bool transpose = qt != nullptr;
  // A chunk of kVec columns must come from one part.
  const bool whole_chunks = (parts.count == 1 || parts.group % kVec == 0) && (trows.parts == 1 || trows.group % 8 == 0);
  const bool fast = v.cols % kVec == 0 && whole_chunks && (!transpose || v.rows % 8 == 0) && aligned &&
                    Aligned(q, 8) && (!transpose || Aligned(qt, 8));
  const int tile = fast ? kTile : kSmallTile;
  const int64_t tiles_m = (v.rows + tile - 1) / tile;
  const int64_t tiles_n = (v.cols + tile - 1) / tile;
  const int64_t blocks = v.batch * tiles_m * tiles_n;
  DispatchBool(transpose, [&](auto kT) {
    DispatchBool(dbias != nullptr, [&](auto kD) {
      constexpr bool kTr = decltype(kT)::value, kDb = decltype(kD)::value;
      auto kernel = !fast                ? CastTransposeGenericKernel<T, kFmt, kTr, kDb>
                    : parts.count == 1 ? CastTransposeKernel<T, kFmt, kTr, kDb, false>
                                         : CastTransposeKernel<T, kFmt, kTr, kDb, true>;
      kernel<<<blocks, kThreads, 0, stream>>>(src, scale, static_cast<uint8_t*>(q), static_cast<uint8_t*>(qt), trows,
                                              amax, workspace, v.rows, v.cols, tiles_m, tiles_n);
    });
  });
  TE_JAX_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "quantize kernel launch");
  if (dbias != nullptr) {
    const int threads = 256;
    const int64_t grid = (v.cols + threads - 1) / threads;
    ColumnSumKernel<<<grid, threads, 0, stream>>>(workspace, dbias, v.batch * tiles_m, v.cols);
    TE_JAX_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "dbias column-sum launch");
  }
  return ffi::Error::Success();
}

// What te_quantize and te_quantize_interleaved share once x's view, type and parts are known.
ffi::Error QuantizeParts(cudaStream_t stream, const QuantizeView& view, ffi::DataType x_type, const Parts& parts,
                         const TransposedRows& trows, ffi::BufferR0<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> q,
                         ffi::Result<ffi::AnyBuffer> qt, ffi::Result<ffi::BufferR0<ffi::F32>> amax,
                         ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace) {
  const bool want_t = qt->element_count() > 0;
  const bool want_dbias = dbias->element_count() > 0;
  if (static_cast<int64_t>(q->element_count()) != view.size()) {
    return ffi::Error::InvalidArgument("quantize: q must hold as many elements as x");
  }
  if (want_t && static_cast<int64_t>(qt->element_count()) != view.size()) {
    return ffi::Error::InvalidArgument("quantize: qt must be empty or hold as many elements as x");
  }
  if (want_dbias && (dbias->element_type() != ffi::DataType::F32 ||
                     static_cast<int64_t>(dbias->element_count()) != view.cols)) {
    return ffi::Error::InvalidArgument("quantize: dbias must be empty or f32[cols]");
  }
  const WorkspaceSize need = QuantizeWorkspace(view);
  if (want_dbias && (workspace->element_type() != need.type ||
                     static_cast<int64_t>(workspace->element_count()) < need.count)) {
    return ffi::Error::InvalidArgument("quantize: the dbias workspace must be f32[" + std::to_string(need.count) +
                                       "] (te_jax._te_cuda.quantize_workspace)");
  }
  auto* amax_ptr = reinterpret_cast<unsigned*>(amax->typed_data());
  TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(amax_ptr, 0, sizeof(float), stream), "amax memset");
  if (view.size() == 0) {
    if (want_dbias) {
      TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dbias->untyped_data(), 0, dbias->size_bytes(), stream),
                                  "dbias memset");
    }
    return ffi::Error::Success();
  }
  float* ws = want_dbias ? static_cast<float*>(workspace->untyped_data()) : nullptr;
  void* qt_ptr = want_t ? qt->untyped_data() : nullptr;
  float* db_ptr = want_dbias ? static_cast<float*>(dbias->untyped_data()) : nullptr;
  const float* s = scale.typed_data();

  auto with_format = [&](auto dummy) -> ffi::Error {
    using T = decltype(dummy);
    switch (q->element_type()) {
      case ffi::DataType::F8E4M3FN:
        return Launch<T, __NV_E4M3>(stream, view, parts, trows, s, q->untyped_data(), qt_ptr, amax_ptr, db_ptr, ws);
      case ffi::DataType::F8E5M2:
        return Launch<T, __NV_E5M2>(stream, view, parts, trows, s, q->untyped_data(), qt_ptr, amax_ptr, db_ptr, ws);
      default:
        return ffi::Error::InvalidArgument("quantize: q must be float8_e4m3fn or float8_e5m2");
    }
  };
  return WithFloatType(x_type, "quantize: x must be float32, bfloat16 or float16", with_format);
}

ffi::Error QuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::BufferR0<ffi::F32> scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                        ffi::Result<ffi::BufferR0<ffi::F32>> amax, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> workspace, int64_t batch_ndim, int64_t t_parts,
                        int64_t t_group) {
  auto view = MakeQuantizeView(x.dimensions(), batch_ndim);
  if (view.has_error()) return view.error();
  auto trows = MakeTransposedRows(view->cols, t_parts, t_group);
  if (trows.has_error()) return trows.error();
  Parts parts;
  parts.data[0] = x.untyped_data();
  parts.group = view->cols;
  return QuantizeParts(stream, *view, x.element_type(), parts, *trows, scale, q, qt, amax, dbias, workspace);
}

ffi::Error QuantizeInterleavedCuda(cudaStream_t stream, ffi::BufferR0<ffi::F32> scale, ffi::RemainingArgs args,
                                   ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                                   ffi::Result<ffi::BufferR0<ffi::F32>> amax, ffi::Result<ffi::AnyBuffer> dbias,
                                   ffi::Result<ffi::AnyBuffer> workspace, int64_t batch_ndim, int64_t group) {
  const int count = static_cast<int>(args.size());
  if (count < 1 || count > kMaxInterleavedParts) {
    return ffi::Error::InvalidArgument("quantize_interleaved: takes 1 to " + std::to_string(kMaxInterleavedParts) +
                                       " parts");
  }
  Parts parts;
  parts.count = count;
  parts.group = group;
  auto first = args.get<ffi::AnyBuffer>(0);
  if (first.has_error()) return first.error();
  for (int p = 0; p < count; ++p) {
    auto part = args.get<ffi::AnyBuffer>(p);
    if (part.has_error()) return part.error();
    if (part->element_type() != first->element_type() || part->dimensions().size() != first->dimensions().size() ||
        !std::equal(part->dimensions().begin(), part->dimensions().end(), first->dimensions().begin())) {
      return ffi::Error::InvalidArgument("quantize_interleaved: the parts must have one shape and dtype");
    }
    parts.data[p] = part->untyped_data();
  }
  auto view = MakeQuantizeView(first->dimensions(), batch_ndim);
  if (view.has_error()) return view.error();
  if (group < 1 || view->cols % group != 0) {
    return ffi::Error::InvalidArgument("quantize_interleaved: group must divide the parts' last dim");
  }
  if (view->cols * count > kMaxInterleavedCols) {
    return ffi::Error::InvalidArgument("quantize_interleaved: x's rows must be shorter than 2^31 elements");
  }
  view->cols *= count;
  return QuantizeParts(stream, *view, first->element_type(), parts, TransposedRows{1, 1, view->cols}, scale, q, qt,
                       amax, dbias, workspace);
}

}  // namespace

// One partial row per 32-row tile bounds both kernels' needs (the fast path's tiles are 128 rows).
WorkspaceSize QuantizeWorkspace(const QuantizeView& v) {
  return {v.batch * ((v.rows + kSmallTile - 1) / kSmallTile) * v.cols, ffi::DataType::F32};
}

// Allocate nothing (the dbias partials go to a workspace result), so XLA may capture them into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeCudaHandler, QuantizeCuda,
                              QuantizeAttrs(QuantizeOperands(BindWithStream())
                                                .Ret<ffi::AnyBuffer>()),  // workspace: QuantizeWorkspace, or empty
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeInterleavedCudaHandler, QuantizeInterleavedCuda,
                              QuantizeResults(BindWithStream()
                                                  .Arg<ffi::BufferR0<ffi::F32>>()  // scale
                                                  .RemainingArgs())                // the parts of x
                                  .Ret<ffi::AnyBuffer>()  // workspace: QuantizeWorkspace, or empty
                                  .Attr<int64_t>("batch_ndim")
                                  .Attr<int64_t>("group"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
