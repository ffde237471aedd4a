// What the cuBLASLt handlers (ffi/cuda/gemm.cc, ffi/cuda/grouped_gemm.cu) share: cuBLAS status codes as XLA FFI
// errors, XLA dtypes as cuBLASLt's, and the capture-mode guard around cuBLASLt calls that may allocate.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

inline xla::ffi::Error CublasError(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string("cuBLASLt: ") + what + ": status " + std::to_string(status));
}

// An XLA dtype as cuBLASLt's data type, or an error naming the op (`op`: "gemm", "grouped_gemm").
inline xla::ffi::ErrorOr<cudaDataType_t> CublasType(xla::ffi::DataType t, const char* op) {
  switch (t) {
    case xla::ffi::DataType::F32: return CUDA_R_32F;
    case xla::ffi::DataType::BF16: return CUDA_R_16BF;
    case xla::ffi::DataType::F16: return CUDA_R_16F;
    case xla::ffi::DataType::F8E4M3FN: return CUDA_R_8F_E4M3;
    case xla::ffi::DataType::F8E5M2: return CUDA_R_8F_E5M2;
    case xla::ffi::DataType::F4E2M1FN: return CUDA_R_4F_E2M1;
    default: return xla::ffi::Error::InvalidArgument(std::string(op) + ": unsupported data type");
  }
}

// While the stream is being captured into a CUDA graph, CUDA forbids this thread the calls that could synchronize
// implicitly (cudaMalloc, for one). Creating a handle or a plan touches no stream but may make such calls inside
// cuBLASLt, and the algorithm timing allocates and waits on its own stream, so the thread relaxes that rule around
// them, as CUDA's capture-mode API intends for libraries.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace te_jax

#define TE_JAX_CUBLAS_RETURN_IF_ERROR(expr, what)         \
  do {                                                    \
    auto _te_err = ::te_jax::CublasError((expr), (what)); \
    if (_te_err.failure()) return _te_err;                \
  } while (0)
