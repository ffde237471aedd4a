// Host-side facts about XLA FFI buffers that the CPU and CUDA handlers both check.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

inline bool IsFp8(xla::ffi::DataType t) {
  return t == xla::ffi::DataType::F8E4M3FN || t == xla::ffi::DataType::F8E5M2;
}

// element_count() as a signed count, to compare with dims.
template <typename B>
int64_t Count(const B& b) {
  return static_cast<int64_t>(b.element_count());
}

// The last dim (0 for a scalar).
inline int64_t Cols(const xla::ffi::AnyBuffer& x) {
  auto dims = x.dimensions();
  return dims.size() == 0 ? 0 : dims.back();
}

}  // namespace te_jax
