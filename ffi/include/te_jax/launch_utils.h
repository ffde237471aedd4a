// Host-side helpers the CUDA launchers share: pointer alignment, the blocks a kernel keeps resident, and dispatch
// from run-time values to the template arguments of a kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

inline bool Aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// How many blocks of `kernel` (threads each, smem bytes of dynamic shared memory) the device holds at once, or 0 if
// the runtime cannot tell (the caller then launches one block per unit of work).
template <typename Kernel>
int ResidentBlocks(Kernel kernel, int threads, size_t smem) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();  // clear it: the launch that follows reports its own errors
    return 0;
  }
  return sms * per_sm;
}

// Calls f(std::true_type) or f(std::false_type).
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

// Returns f(float{}), f(__nv_bfloat16{}) or f(__half{}) for a float32, bfloat16 or float16 `type`; for any other
// type, an InvalidArgument error with the message `error`.
template <typename F>
xla::ffi::Error WithFloatType(xla::ffi::DataType type, const char* error, F&& f) {
  switch (type) {
    case xla::ffi::DataType::F32: return f(float{});
    case xla::ffi::DataType::BF16: return f(__nv_bfloat16{});
    case xla::ffi::DataType::F16: return f(__half{});
    default: return xla::ffi::Error::InvalidArgument(error);
  }
}

}  // namespace te_jax
