// How the rotary-embedding handlers see their operands: x (B, S, H, D) or (S, B, H, D), and the float32 cos/sin
// tables (S, R/2) or (B, S, R/2). A "token" is one (b, s) position in x's storage order (b-major for BSHD,
// s-major for SBHD); its H heads of D features are contiguous, and the first R = 2 * half of each head rotate.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define TE_JAX_HOST_DEVICE __host__ __device__
#else
#define TE_JAX_HOST_DEVICE
#endif

namespace te_jax {

struct RopeView {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t heads = 0;
  int64_t dim = 0;       // D: features per head
  int64_t half = 0;      // R / 2: rotated pairs per head
  bool sbhd = false;     // x is (S, B, H, D)
  bool batched = false;  // the tables are (B, S, R/2)

  TE_JAX_HOST_DEVICE int64_t tokens() const { return batch * seq; }
  int64_t elements() const { return tokens() * heads * dim; }
  // The row of the tables that token t (in x's storage order) reads.
  TE_JAX_HOST_DEVICE int64_t TableRow(int64_t t) const {
    const int64_t b = sbhd ? t % batch : t / seq;
    const int64_t s = sbhd ? t / batch : t % seq;
    return batched ? b * seq + s : s;
  }
};

inline xla::ffi::ErrorOr<RopeView> MakeRopeView(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& cos,
                                                const xla::ffi::AnyBuffer& sin, bool sbhd) {
  using xla::ffi::Error;
  const auto xd = x.dimensions();
  const auto td = cos.dimensions();
  if (xd.size() != 4) return Error::InvalidArgument("rope: x must be (B, S, H, D) or (S, B, H, D)");
  if (cos.element_type() != xla::ffi::DataType::F32 || sin.element_type() != xla::ffi::DataType::F32) {
    return Error::InvalidArgument("rope: cos and sin must be float32");
  }
  const auto sd = sin.dimensions();
  if (td.size() != sd.size()) return Error::InvalidArgument("rope: cos and sin must have the same shape");
  for (size_t i = 0; i < td.size(); ++i) {
    if (td[i] != sd[i]) return Error::InvalidArgument("rope: cos and sin must have the same shape");
  }
  RopeView v;
  v.sbhd = sbhd;
  v.seq = sbhd ? xd[0] : xd[1];
  v.batch = sbhd ? xd[1] : xd[0];
  v.heads = xd[2];
  v.dim = xd[3];
  if (td.size() != 2 && td.size() != 3) {
    return Error::InvalidArgument("rope: the tables must be (S, R/2) or (B, S, R/2)");
  }
  v.batched = td.size() == 3;
  v.half = td[td.size() - 1];
  if (td[td.size() - 2] != v.seq || (v.batched && td[0] != v.batch)) {
    return Error::InvalidArgument("rope: the tables' batch and sequence dims must match x's");
  }
  if (v.half < 1 || 2 * v.half > v.dim) return Error::InvalidArgument("rope: the rotary dim R must be in [2, D]");
  return v;
}

// te_rope_fwd's and te_rope_bwd's FFI signature (the same) after the platform's context.
template <typename B>
auto RopeSignature(B b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // x (backward: the gradient): f32/bf16/f16, BSHD or SBHD
      .template Arg<xla::ffi::AnyBuffer>()                 // cos: f32 (S, R/2) or (B, S, R/2)
      .template Arg<xla::ffi::AnyBuffer>()                 // sin: f32, cos's shape
      .template Ret<xla::ffi::AnyBuffer>()                 // y: x rotated (backward: back), x's dtype and shape
      .template Attr<bool>("sbhd")                         // x is (S, B, H, D)
      .template Attr<bool>("interleaved");                 // pairs (2i, 2i+1), else (i, i + R/2)
}

}  // namespace te_jax
