// CPU handlers for te_softmax_fwd / te_softmax_bwd: the formulas of te_jax.ops.softmax, row by row, in float32.
// Sums are pairwise over blocks of 8 interleaved float32 accumulators (the order of a vectorized tree reduction), so
// their rounding error stays at the level of XLA's own reductions for long rows; exp is the C library's expf.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "te_jax/host_types.h"
#include "te_jax/softmax_view.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Element access of one dtype: element i as float32, and a float32 stored rounded to nearest even.
struct F32Io {
  static float Load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static void Store(void* p, int64_t i, float v) { static_cast<float*>(p)[i] = v; }
};

struct Bf16Io {
  static float Load(const void* p, int64_t i) { return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]); }
  static void Store(void* p, int64_t i, float v) {
    const uint32_t bits = FloatToBits(v);
    static_cast<uint16_t*>(p)[i] = std::isnan(v) ? static_cast<uint16_t>((bits >> 16) | 0x40u)  // quiet NaN
                                                 : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
};

struct F16Io {
  static float Load(const void* p, int64_t i) { return F16ToFloat(static_cast<const uint16_t*>(p)[i]); }
  static void Store(void* p, int64_t i, float v) {
    const _Float16 h = static_cast<_Float16>(v);  // round to nearest even, as XLA's convert
    std::memcpy(static_cast<uint16_t*>(p) + i, &h, sizeof(h));
  }
};

// Calls f(Io{}) for a float32, bfloat16 or float16 buffer type.
template <typename F>
ffi::Error WithIo(ffi::DataType t, F&& f) {
  switch (t) {
    case ffi::DataType::F32: return f(F32Io{});
    case ffi::DataType::BF16: return f(Bf16Io{});
    case ffi::DataType::F16: return f(F16Io{});
    default: return ffi::Error::InvalidArgument("softmax: operands must be float32, bfloat16 or float16");
  }
}

// The larger of a and b, NaN if either is NaN (as XLA's max).
float MaxNan(float a, float b) { return (a > b || a != a) ? a : b; }

// Sum of v[0..n): halves down to blocks of at most 64 elements, each summed in 8 interleaved accumulators, then
// added pairwise: an error of O(log n) roundings, not O(n).
float PairwiseSum(const float* v, int64_t n) {
  if (n > 64) {
    const int64_t half = (n / 2 + 7) / 8 * 8;
    return PairwiseSum(v, half) + PairwiseSum(v + half, n - half);
  }
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) acc[i % 8] += v[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

ffi::Error SoftmaxFwdCpu(ffi::AnyBuffer logits, ffi::BufferR0<ffi::S32> q_offset, ffi::AnyBuffer mask,
                         ffi::Result<ffi::AnyBuffer> y, int64_t kind, float scale) {
  if (kind < 0 || kind > 2) return ffi::Error::InvalidArgument("softmax: unknown kind");
  const bool masked = kind == static_cast<int64_t>(SoftmaxKind::kMasked);
  const bool causal = kind == static_cast<int64_t>(SoftmaxKind::kCausal);
  if (masked && mask.element_type() != ffi::DataType::PRED) {
    return ffi::Error::InvalidArgument("softmax: the mask must be bool");
  }
  auto view = MakeSoftmaxView(logits.dimensions(), mask.dimensions(), masked);
  if (view.has_error()) return view.error();
  const SoftmaxView v = *view;
  if (y->element_type() != logits.element_type() || y->element_count() != logits.element_count()) {
    return ffi::Error::InvalidArgument("softmax: y must have the logits' dtype and size");
  }
  const int64_t offset = *q_offset.typed_data();
  const uint8_t* mask_bytes = masked ? static_cast<const uint8_t*>(mask.untyped_data()) : nullptr;
  const void* x = logits.untyped_data();
  void* out = y->untyped_data();
  return WithIo(logits.element_type(), [&](auto io) {
    using Io = decltype(io);
    std::vector<float> z(static_cast<size_t>(v.cols));
    for (int64_t r = 0; r < v.rows; ++r) {
      const int64_t base = r * v.cols;
      const int64_t limit = v.Limit(r, causal, offset);
      const uint8_t* mrow = masked ? mask_bytes + v.MaskOffset(r) : nullptr;
      float m = kNegInf;
      for (int64_t j = 0; j < v.cols; ++j) {
        const bool out_of_row = j >= limit || (mrow != nullptr && mrow[j] != 0);
        z[j] = out_of_row ? kNegInf : Io::Load(x, base + j) * scale;
        m = MaxNan(m, z[j]);
      }
      const bool empty = m == kNegInf;  // every key masked: an all-zero row
      const float shift = empty ? 0.0f : m;
      for (int64_t j = 0; j < v.cols; ++j) z[j] = std::exp(z[j] - shift);
      const float rcp = empty ? 0.0f : 1.0f / PairwiseSum(z.data(), v.cols);
      for (int64_t j = 0; j < v.cols; ++j) Io::Store(out, base + j, z[j] * rcp);
    }
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::BufferR0<ffi::S32> q_offset,
                         ffi::Result<ffi::AnyBuffer> dx, bool causal, float scale) {
  auto view = MakeSoftmaxView(y.dimensions(), {}, false);
  if (view.has_error()) return view.error();
  const SoftmaxView v = *view;
  if (dy.element_type() != y.element_type() || dy.element_count() != y.element_count() ||
      dx->element_type() != y.element_type() || dx->element_count() != y.element_count()) {
    return ffi::Error::InvalidArgument("softmax: dy and dx must have y's dtype and size");
  }
  const int64_t offset = *q_offset.typed_data();
  const void* yp = y.untyped_data();
  const void* gp = dy.untyped_data();
  void* out = dx->untyped_data();
  return WithIo(y.element_type(), [&](auto io) {
    using Io = decltype(io);
    std::vector<float> prod(static_cast<size_t>(v.cols));
    for (int64_t r = 0; r < v.rows; ++r) {
      const int64_t base = r * v.cols;
      const int64_t limit = v.Limit(r, causal, offset);
      for (int64_t j = 0; j < limit; ++j) prod[j] = Io::Load(gp, base + j) * Io::Load(yp, base + j);
      const float s = PairwiseSum(prod.data(), limit);
      for (int64_t j = 0; j < limit; ++j) {
        Io::Store(out, base + j, (scale * Io::Load(yp, base + j)) * (Io::Load(gp, base + j) - s));
      }
      for (int64_t j = limit; j < v.cols; ++j) Io::Store(out, base + j, 0.0f);
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxFwdCpuHandler, SoftmaxFwdCpu, SoftmaxFwdSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBwdCpuHandler, SoftmaxBwdCpu, SoftmaxBwdSignature(ffi::Ffi::Bind()));

}  // namespace te_jax
