// CUDA handlers for te_softmax_fwd / te_softmax_bwd: the formulas of te_jax.ops.softmax, in float32.
//
// Rows up to kMaxRegisterCols (8192) elements are held in registers: T threads per row (a power of two, 8..256),
// each owning C <= 4 chunks of 8 consecutive elements, chunk k of thread t at column 8 (k T + t), so that the T
// threads of a row read consecutive 16-byte words. The row is read once and written once: the forward reduces the
// max (warp butterfly, then the row's warps through shared memory), exponentiates in place, reduces the sum and
// scales; the backward reduces sum(dy * y) and writes dx. 256-thread blocks hold 256 / T rows. T is the smallest
// power of two with C <= 4, so a 2048-element row is 64 threads x 4 chunks (32 float32 registers of row data). The
// butterfly gives every thread of a row the same bits of the max and the sum.
//
// Longer rows take a 512-thread block each and re-read the row from global memory (L2) in each pass: max, sum,
// write forward; sum, write backward.
//
// Loads are 16-byte vectors (vec_load.cuh's Chunk) when the row length is a multiple of 8 and the buffers are
// aligned, scalar and bounds-checked otherwise. The mask is read as bytes (8 per chunk, one 8-byte load when
// aligned) at the row that te_jax/softmax_view.h's index math gives: a broadcast mask is never materialized. The
// causal kinds read only keys j <= i (and write zeros beyond). exp is ex2.approx of (z - m) * log2(e): the argument
// z - m is formed first, exactly as the reference does, so its rounding error does not grow with the logits'
// magnitude; ex2.approx's own error is ~2 float32 ulps, within the tolerance rule of te_jax/ops/softmax.py.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "te_jax/cuda_check.h"
#include "te_jax/launch_utils.h"
#include "te_jax/softmax_view.h"
#include "te_jax/vec_load.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr int kVec = 8;                 // elements per chunk
constexpr int kBlock = 256;             // threads per block of the register kernels
constexpr int kMaxChunks = 4;           // chunks per thread in the register kernels
constexpr int kMaxRowThreads = 256;     // threads per row in the register kernels
constexpr int64_t kMaxRegisterCols = int64_t{kVec} * kMaxChunks * kMaxRowThreads;  // 8192
constexpr int kLongThreads = 512;       // threads per row (= per block) for longer rows
constexpr float kLog2e = 1.4426950408889634f;
// The forward kernels declare 2 resident blocks per SM in their launch bounds (at most 128 and 64 registers): they
// use 40-70 and 48, but without the hint ptxas spilled 4-8 bytes in two variants (f32 64 x 4, the bf16 long row).
constexpr int kFwdMinBlocks = 2;

struct Params {
  const void* a;          // forward: logits; backward: dy
  const void* b;          // backward: y
  const uint8_t* mask;    // forward, kind masked: bool bytes; else null
  const int32_t* q_offset;
  void* out;              // y (forward) or dx (backward)
  SoftmaxView view;
  float scale;
  bool causal;
  bool vec;               // cols % 8 == 0 and 16-byte aligned buffers: 16-byte accesses for whole chunks
  bool mask_vec;          // cols % 8 == 0 and an 8-byte aligned mask: 8-byte mask loads
};

// The larger of a and b, NaN if either is NaN (as XLA's max): one instruction on sm_80+.
__device__ __forceinline__ float MaxNan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// How many of the 8 elements of chunk `col` lie before `limit` (0..8): per-element tests in 32-bit arithmetic.
__device__ __forceinline__ int Valid(int64_t col, int64_t limit) {
  const int64_t n = limit - col;
  return n <= 0 ? 0 : n >= kVec ? kVec : static_cast<int>(n);
}

__device__ __forceinline__ float Exp(float d) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d * kLog2e));
  return r;
}

// Chunk `col` (8 elements) of a row: 16-byte loads when whole and vector-accessible; else elements [col, limit).
template <typename T>
__device__ __forceinline__ void LoadChunk(Chunk<T>& c, const T* row, int64_t col, int64_t limit, int64_t cols,
                                          bool vec) {
  if (vec && col + kVec <= cols) {
    c.Load(row + col);
  } else {
    c.Zero();
    T* e = reinterpret_cast<T*>(c.raw);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (col + j < limit) e[j] = row[col + j];
    }
  }
}

// The 8 mask bytes of chunk `col` as a 64-bit word (byte j nonzero: element j masked); bytes past cols read 0.
__device__ __forceinline__ uint64_t LoadMask(const uint8_t* mrow, int64_t col, int64_t cols, bool vec) {
  if (vec && col + kVec <= cols) return *reinterpret_cast<const uint64_t*>(mrow + col);
  uint64_t bits = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    if (col + j < cols) bits |= static_cast<uint64_t>(mrow[col + j]) << (8 * j);
  }
  return bits;
}

template <typename T>
__device__ __forceinline__ void StoreChunk(T* row, int64_t col, int64_t cols, bool vec, const float (&y)[kVec]) {
  if (vec && col + kVec <= cols) {
    T h[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = FromFloat<T>(y[j]);
#pragma unroll
    for (int w = 0; w < static_cast<int>(sizeof(T)) * kVec / 16; ++w) {
      reinterpret_cast<uint4*>(row + col)[w] = reinterpret_cast<const uint4*>(h)[w];
    }
  } else {
#pragma unroll  // unrolled, so that y stays in registers
    for (int j = 0; j < kVec; ++j) {
      if (col + j < cols) row[col + j] = FromFloat<T>(y[j]);
    }
  }
}

// z = scale * x of a chunk, -inf where masked or at/after the first `valid` elements.
template <typename T>
__device__ __forceinline__ void Logits(const Chunk<T>& c, uint64_t mbits, int valid, float scale, float (&z)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const bool out = j >= valid || ((mbits >> (8 * j)) & 0xFFu) != 0;
    z[j] = out ? -INFINITY : c.Get(j) * scale;
  }
}

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return MaxNan(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Reduces v over the kT threads of this thread's row (rows are consecutive groups of kT threads of the block):
// a butterfly within the warp, then, for kT > 32, the row's warps in order through `buf` (one float per warp of the
// block). Every thread of the row gets the same bits. Every thread of the block must call it.
template <int kT, typename Op>
__device__ __forceinline__ float RowReduce(float v, Op op, float* buf) {
  constexpr int kWidth = kT < 32 ? kT : 32;
#pragma unroll
  for (int o = kWidth / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if constexpr (kT > 32) {
    constexpr int kWarpsPerRow = kT / 32;
    const int warp = threadIdx.x / 32;
    __syncthreads();  // the previous reduction's reads of buf are done
    if (threadIdx.x % 32 == 0) buf[warp] = v;
    __syncthreads();
    const int first = warp / kWarpsPerRow * kWarpsPerRow;
    v = buf[first];
#pragma unroll
    for (int w = 1; w < kWarpsPerRow; ++w) v = op(v, buf[first + w]);
  }
  return v;
}

// ---- rows in registers -----------------------------------------------------------------------------------------

template <typename T, int kT, int kC>
__global__ void __launch_bounds__(kBlock, kFwdMinBlocks) SoftmaxFwdKernel(const Params p) {
  __shared__ float buf[kBlock / 32];
  const int t = threadIdx.x % kT;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / kT) + threadIdx.x / kT;
  const SoftmaxView& v = p.view;
  const int64_t cols = v.cols;
  // Past the last row: no loads or stores, but the thread still takes part in the reductions.
  const uint32_t row32 = static_cast<uint32_t>(row);  // rows < 2^31 (Launch checks)
  const int64_t limit = row < v.rows ? v.Limit(row32, p.causal, *p.q_offset) : 0;
  const T* x = static_cast<const T*>(p.a) + row * cols;
  const uint8_t* mrow = p.mask != nullptr && row < v.rows ? p.mask + v.MaskOffset(row32) : nullptr;

  Chunk<T> raw[kC];
  uint64_t mbits[kC];
#pragma unroll
  for (int k = 0; k < kC; ++k) {
    const int64_t col = static_cast<int64_t>(k * kT + t) * kVec;
    mbits[k] = 0;
    if (col < limit) {
      LoadChunk(raw[k], x, col, limit, cols, p.vec);
      if (mrow != nullptr) mbits[k] = LoadMask(mrow, col, cols, p.mask_vec);
    } else {
      raw[k].Zero();  // every element is past the limit: -inf below
    }
  }
  float z[kC][kVec];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kC; ++k) {
    const int64_t col = static_cast<int64_t>(k * kT + t) * kVec;
    Logits(raw[k], mbits[k], Valid(col, limit), p.scale, z[k]);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = MaxNan(m, z[k][j]);
  }
  m = RowReduce<kT>(m, MaxOp{}, buf);
  const bool empty = m == -INFINITY;  // every key masked: an all-zero row
  const float shift = empty ? 0.0f : m;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kC; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      z[k][j] = Exp(z[k][j] - shift);
      s += z[k][j];
    }
  }
  s = RowReduce<kT>(s, SumOp{}, buf);
  if (row >= v.rows) return;
  const float rcp = empty ? 0.0f : __frcp_rn(s);
  T* y = static_cast<T*>(p.out) + row * cols;
#pragma unroll
  for (int k = 0; k < kC; ++k) {
    const int64_t col = static_cast<int64_t>(k * kT + t) * kVec;
    if (col >= cols) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) z[k][j] *= rcp;
    StoreChunk(y, col, cols, p.vec, z[k]);
  }
}

template <typename T, int kT, int kC>
__global__ void __launch_bounds__(kBlock) SoftmaxBwdKernel(const Params p) {
  __shared__ float buf[kBlock / 32];
  const int t = threadIdx.x % kT;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / kT) + threadIdx.x / kT;
  const SoftmaxView& v = p.view;
  const int64_t cols = v.cols;
  const int64_t limit = row < v.rows ? v.Limit(static_cast<uint32_t>(row), p.causal, *p.q_offset) : 0;
  const T* dy = static_cast<const T*>(p.a) + row * cols;
  const T* y = static_cast<const T*>(p.b) + row * cols;

  Chunk<T> g[kC], yv[kC];
#pragma unroll
  for (int k = 0; k < kC; ++k) {
    const int64_t col = static_cast<int64_t>(k * kT + t) * kVec;
    if (col < limit) {
      LoadChunk(g[k], dy, col, limit, cols, p.vec);
      LoadChunk(yv[k], y, col, limit, cols, p.vec);
    } else {
      g[k].Zero();
      yv[k].Zero();
    }
  }
  float s = 0.0f;
  int valid[kC];
#pragma unroll
  for (int k = 0; k < kC; ++k) {
    valid[k] = Valid(static_cast<int64_t>(k * kT + t) * kVec, limit);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (j < valid[k]) s += g[k].Get(j) * yv[k].Get(j);  // a whole-chunk load may read past a causal limit
    }
  }
  s = RowReduce<kT>(s, SumOp{}, buf);
  if (row >= v.rows) return;
  T* dx = static_cast<T*>(p.out) + row * cols;
#pragma unroll
  for (int k = 0; k < kC; ++k) {
    const int64_t col = static_cast<int64_t>(k * kT + t) * kVec;
    if (col >= cols) continue;
    float d[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      d[j] = j < valid[k] ? (p.scale * yv[k].Get(j)) * (g[k].Get(j) - s) : 0.0f;
    }
    StoreChunk(dx, col, cols, p.vec, d);
  }
}

// ---- longer rows: one block per row, passes over global memory -------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kLongThreads, kFwdMinBlocks) SoftmaxFwdLongKernel(const Params p) {
  __shared__ float buf[kLongThreads / 32];
  const int64_t row = blockIdx.x;
  const SoftmaxView& v = p.view;
  const int64_t cols = v.cols;
  const int64_t limit = v.Limit(static_cast<uint32_t>(row), p.causal, *p.q_offset);
  const T* x = static_cast<const T*>(p.a) + row * cols;
  const uint8_t* mrow = p.mask != nullptr ? p.mask + v.MaskOffset(static_cast<uint32_t>(row)) : nullptr;
  auto logits = [&](int64_t col, float (&z)[kVec]) {
    Chunk<T> c;
    uint64_t mbits = 0;
    if (col < limit) {
      LoadChunk(c, x, col, limit, cols, p.vec);
      if (mrow != nullptr) mbits = LoadMask(mrow, col, cols, p.mask_vec);
    } else {
      c.Zero();
    }
    Logits(c, mbits, Valid(col, limit), p.scale, z);
  };
  const int64_t step = int64_t{kLongThreads} * kVec;
  float m = -INFINITY;
  for (int64_t col = threadIdx.x * kVec; col < limit; col += step) {
    float z[kVec];
    logits(col, z);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = MaxNan(m, z[j]);
  }
  m = RowReduce<kLongThreads>(m, MaxOp{}, buf);
  const bool empty = m == -INFINITY;
  const float shift = empty ? 0.0f : m;
  float s = 0.0f;
  for (int64_t col = threadIdx.x * kVec; col < limit; col += step) {
    float z[kVec];
    logits(col, z);
#pragma unroll
    for (int j = 0; j < kVec; ++j) s += Exp(z[j] - shift);
  }
  s = RowReduce<kLongThreads>(s, SumOp{}, buf);
  const float rcp = empty ? 0.0f : __frcp_rn(s);
  T* y = static_cast<T*>(p.out) + row * cols;
  for (int64_t col = threadIdx.x * kVec; col < cols; col += step) {
    float z[kVec];
    logits(col, z);
#pragma unroll
    for (int j = 0; j < kVec; ++j) z[j] = Exp(z[j] - shift) * rcp;
    StoreChunk(y, col, cols, p.vec, z);
  }
}

template <typename T>
__global__ void __launch_bounds__(kLongThreads) SoftmaxBwdLongKernel(const Params p) {
  __shared__ float buf[kLongThreads / 32];
  const int64_t row = blockIdx.x;
  const SoftmaxView& v = p.view;
  const int64_t cols = v.cols;
  const int64_t limit = v.Limit(static_cast<uint32_t>(row), p.causal, *p.q_offset);
  const T* dy = static_cast<const T*>(p.a) + row * cols;
  const T* y = static_cast<const T*>(p.b) + row * cols;
  const int64_t step = int64_t{kLongThreads} * kVec;
  float s = 0.0f;
  for (int64_t col = threadIdx.x * kVec; col < limit; col += step) {
    Chunk<T> g, yv;
    LoadChunk(g, dy, col, limit, cols, p.vec);
    LoadChunk(yv, y, col, limit, cols, p.vec);
    const int valid = Valid(col, limit);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (j < valid) s += g.Get(j) * yv.Get(j);
    }
  }
  s = RowReduce<kLongThreads>(s, SumOp{}, buf);
  T* dx = static_cast<T*>(p.out) + row * cols;
  for (int64_t col = threadIdx.x * kVec; col < cols; col += step) {
    float d[kVec];
    if (col < limit) {
      Chunk<T> g, yv;
      LoadChunk(g, dy, col, limit, cols, p.vec);
      LoadChunk(yv, y, col, limit, cols, p.vec);
      const int valid = Valid(col, limit);
#pragma unroll
      for (int j = 0; j < kVec; ++j) d[j] = j < valid ? (p.scale * yv.Get(j)) * (g.Get(j) - s) : 0.0f;
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) d[j] = 0.0f;
    }
    StoreChunk(dx, col, cols, p.vec, d);
  }
}

// ---- launch ----------------------------------------------------------------------------------------------------

// Calls f(T{}, integral_constant<kT>, integral_constant<kC>) for the register path's configuration of `cols`:
// kT the smallest power of two >= 8 with kC = ceil(chunks / kT) <= 4, kC rounded up to 1, 2 or 4.
template <typename F>
ffi::Error WithRowShape(int64_t cols, F&& f) {
  const int64_t chunks = (cols + kVec - 1) / kVec;
  int threads = 8;
  while (threads < kMaxRowThreads && int64_t{threads} * kMaxChunks < chunks) threads *= 2;
  const int64_t per_thread = (chunks + threads - 1) / threads;
  const int c = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : 4;
  auto with_c = [&](auto kt) -> ffi::Error {
    switch (c) {
      case 1: return f(kt, std::integral_constant<int, 1>{});
      case 2: return f(kt, std::integral_constant<int, 2>{});
      default: return f(kt, std::integral_constant<int, 4>{});
    }
  };
  switch (threads) {
    case 8: return with_c(std::integral_constant<int, 8>{});
    case 16: return with_c(std::integral_constant<int, 16>{});
    case 32: return with_c(std::integral_constant<int, 32>{});
    case 64: return with_c(std::integral_constant<int, 64>{});
    case 128: return with_c(std::integral_constant<int, 128>{});
    default: return with_c(std::integral_constant<int, 256>{});
  }
}

template <bool kBwd, typename T>
ffi::Error LaunchTyped(cudaStream_t stream, const Params& p) {
  const int64_t rows = p.view.rows, cols = p.view.cols;
  if (cols > kMaxRegisterCols) {
    auto kernel = kBwd ? SoftmaxBwdLongKernel<T> : SoftmaxFwdLongKernel<T>;
    kernel<<<static_cast<unsigned>(rows), kLongThreads, 0, stream>>>(p);
    return CudaError(cudaGetLastError(), "softmax kernel launch");
  }
  return WithRowShape(cols, [&](auto kt, auto kc) -> ffi::Error {
    constexpr int kT = decltype(kt)::value;
    constexpr int kC = decltype(kc)::value;
    constexpr int kRowsPerBlock = kBlock / kT;
    auto kernel = kBwd ? SoftmaxBwdKernel<T, kT, kC> : SoftmaxFwdKernel<T, kT, kC>;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(p);
    return CudaError(cudaGetLastError(), "softmax kernel launch");
  });
}

template <bool kBwd>
ffi::Error Launch(cudaStream_t stream, ffi::DataType type, Params p) {
  if (p.view.rows == 0 || p.view.cols == 0) return ffi::Error::Success();
  if (p.view.rows > 0x7FFFFFFF) return ffi::Error::InvalidArgument("softmax: more than 2^31 - 1 rows");
  p.vec = p.view.cols % kVec == 0 && Aligned(p.a, 16) && (p.b == nullptr || Aligned(p.b, 16)) && Aligned(p.out, 16);
  p.mask_vec = p.view.cols % kVec == 0 && p.mask != nullptr && Aligned(p.mask, 8);
  return WithFloatType(type, "softmax: operands must be float32, bfloat16 or float16",
                       [&](auto t) { return LaunchTyped<kBwd, decltype(t)>(stream, p); });
}

ffi::Error SoftmaxFwdCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::BufferR0<ffi::S32> q_offset,
                          ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> y, int64_t kind, float scale) {
  if (kind < 0 || kind > 2) return ffi::Error::InvalidArgument("softmax: unknown kind");
  const bool masked = kind == static_cast<int64_t>(SoftmaxKind::kMasked);
  if (masked && mask.element_type() != ffi::DataType::PRED) {
    return ffi::Error::InvalidArgument("softmax: the mask must be bool");
  }
  auto view = MakeSoftmaxView(logits.dimensions(), mask.dimensions(), masked);
  if (view.has_error()) return view.error();
  if (y->element_type() != logits.element_type() || y->element_count() != logits.element_count()) {
    return ffi::Error::InvalidArgument("softmax: y must have the logits' dtype and size");
  }
  Params p{};
  p.a = logits.untyped_data();
  p.mask = masked ? static_cast<const uint8_t*>(mask.untyped_data()) : nullptr;
  p.q_offset = q_offset.typed_data();
  p.out = y->untyped_data();
  p.view = *view;
  p.scale = scale;
  p.causal = kind == static_cast<int64_t>(SoftmaxKind::kCausal);
  return Launch<false>(stream, logits.element_type(), p);
}

ffi::Error SoftmaxBwdCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::BufferR0<ffi::S32> q_offset,
                          ffi::Result<ffi::AnyBuffer> dx, bool causal, float scale) {
  auto view = MakeSoftmaxView(y.dimensions(), {}, false);
  if (view.has_error()) return view.error();
  if (dy.element_type() != y.element_type() || dy.element_count() != y.element_count() ||
      dx->element_type() != y.element_type() || dx->element_count() != y.element_count()) {
    return ffi::Error::InvalidArgument("softmax: dy and dx must have y's dtype and size");
  }
  Params p{};
  p.a = dy.untyped_data();
  p.b = y.untyped_data();
  p.q_offset = q_offset.typed_data();
  p.out = dx->untyped_data();
  p.view = *view;
  p.scale = scale;
  p.causal = causal;
  return Launch<true>(stream, y.element_type(), p);
}

}  // namespace

// Both allocate nothing: XLA may capture them into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxFwdCudaHandler, SoftmaxFwdCuda,
                              SoftmaxFwdSignature(BindWithStream()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBwdCudaHandler, SoftmaxBwdCuda,
                              SoftmaxBwdSignature(BindWithStream()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
