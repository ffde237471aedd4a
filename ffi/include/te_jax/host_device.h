// TE_JAX_HD: functions that the CPU handlers and the CUDA kernels share (inline on the host, forced inline on both
// sides under nvcc).
#pragma once

#if defined(__CUDACC__)
#define TE_JAX_HD __host__ __device__ __forceinline__
#else
#define TE_JAX_HD inline
#endif
