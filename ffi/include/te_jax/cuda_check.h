// Turn CUDA errors into XLA FFI errors; the start of every CUDA handler's FFI binding.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

inline xla::ffi::Error CudaError(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(what + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// Checks the error state after a kernel launch.
inline xla::ffi::Error LastCudaError(const std::string& what) { return CudaError(cudaGetLastError(), what); }

// A CUDA handler's binding: XLA's compute stream first, then the op's signature (the *_view.h headers).
inline auto BindWithStream() { return xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>(); }

}  // namespace te_jax

#define TE_JAX_CUDA_RETURN_IF_ERROR(expr, what)         \
  do {                                                  \
    auto _te_err = ::te_jax::CudaError((expr), (what)); \
    if (_te_err.failure()) return _te_err;              \
  } while (0)
