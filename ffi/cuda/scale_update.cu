// CUDA handler for te_scale_update: the delayed-scaling step of N tensors in one launch (te_jax/scaling.py defines
// the math and te_jax/ops/scale_update.py the reference this matches bit for bit).
//
// For tensor i: history_i' = [amax_i, history_i[:-1]]; a = max(history_i') or amax_i ("most_recent");
// scale_i' = fp8_max_i / a * 2^-margin where a > 0, a is finite and the quotient is finite and > 0, else scale_i.
// One block per tensor. Each output is its own XLA buffer, so a layer's update is one kernel, where the stacked
// jnp version is a concatenation, a reduction, a select and one slice copy per history.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "te_jax/cuda_check.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxTensors = 16;  // per launch; more are updated in several launches

struct ScaleUpdateArgs {
  const float* history[kMaxTensors];
  const float* scale[kMaxTensors];
  const float* amax[kMaxTensors];
  float* new_history[kMaxTensors];
  float* new_scale[kMaxTensors];
  float fp8_max[kMaxTensors];
  int64_t len;       // history length, the same for every tensor
  float margin_factor;  // 2^-margin, rounded to float
  bool most_recent;
};

// max as jnp.max computes it: a NaN anywhere gives NaN.
__device__ __forceinline__ float NanMax(float a, float b) { return (a > b || a != a) ? a : b; }

__global__ void __launch_bounds__(kThreads) ScaleUpdateKernel(ScaleUpdateArgs a) {
  const int i = blockIdx.x;
  const float amax = *a.amax[i];
  const float* h = a.history[i];
  float* out = a.new_history[i];
  float m = amax;
  for (int64_t j = threadIdx.x; j < a.len; j += kThreads) {
    const float v = j == 0 ? amax : h[j - 1];
    out[j] = v;
    m = NanMax(m, v);
  }
  if (a.most_recent) {
    m = amax;
  } else {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = NanMax(m, __shfl_xor_sync(0xffffffffu, m, o));
    __shared__ float warp_max[kThreads / 32];
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = NanMax(m, warp_max[w]);
  }
  if (threadIdx.x == 0) {
    const float q = a.fp8_max[i] / m * a.margin_factor;
    const bool ok = m > 0.0f && isfinite(m) && isfinite(q) && q > 0.0f;
    *a.new_scale[i] = ok ? q : *a.scale[i];
  }
}

// Operands: N histories, N scales, N amaxes; results: N histories, N scales.
ffi::Error ScaleUpdateCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           ffi::Span<const float> fp8_max, double margin, bool most_recent) {
  const size_t n = fp8_max.size();
  if (n == 0 || args.size() != 3 * n || rets.size() != 2 * n) {
    return ffi::Error::InvalidArgument("scale_update: N histories, scales and amaxes in, N histories and scales out");
  }
  ScaleUpdateArgs a{};
  // 2^-margin in double, rounded to float: the reference's jnp.float32(2.0 ** -margin), exact for integer margins.
  a.margin_factor = static_cast<float>(std::pow(2.0, -margin));
  a.most_recent = most_recent;
  a.len = -1;
  for (size_t start = 0; start < n; start += kMaxTensors) {
    const int count = static_cast<int>(std::min<size_t>(kMaxTensors, n - start));
    for (int k = 0; k < count; ++k) {
      const size_t i = start + k;
      auto h = args.get<ffi::AnyBuffer>(i);
      auto s = args.get<ffi::AnyBuffer>(n + i);
      auto m = args.get<ffi::AnyBuffer>(2 * n + i);
      auto nh = rets.get<ffi::AnyBuffer>(i);
      auto ns = rets.get<ffi::AnyBuffer>(n + i);
      if (h.has_error() || s.has_error() || m.has_error() || nh.has_error() || ns.has_error()) {
        return ffi::Error::InvalidArgument("scale_update: missing operand or result");
      }
      const int64_t len = static_cast<int64_t>(h->element_count());
      const bool f32 = h->element_type() == ffi::DataType::F32 && s->element_type() == ffi::DataType::F32 &&
                       m->element_type() == ffi::DataType::F32 && (*nh)->element_type() == ffi::DataType::F32 &&
                       (*ns)->element_type() == ffi::DataType::F32;
      if (!f32 || len < 1 || (a.len >= 0 && len != a.len) || s->element_count() != 1 || m->element_count() != 1 ||
          static_cast<int64_t>((*nh)->element_count()) != len || (*ns)->element_count() != 1) {
        return ffi::Error::InvalidArgument("scale_update: float32 histories of one length, float32 scalars");
      }
      a.len = len;
      a.history[k] = static_cast<const float*>(h->untyped_data());
      a.scale[k] = static_cast<const float*>(s->untyped_data());
      a.amax[k] = static_cast<const float*>(m->untyped_data());
      a.new_history[k] = static_cast<float*>((*nh)->untyped_data());
      a.new_scale[k] = static_cast<float*>((*ns)->untyped_data());
      a.fp8_max[k] = fp8_max[i];
    }
    ScaleUpdateKernel<<<count, kThreads, 0, stream>>>(a);
    TE_JAX_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "scale_update kernel launch");
  }
  return ffi::Error::Success();
}

}  // namespace

// Allocates nothing: XLA may capture it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaleUpdateCudaHandler, ScaleUpdateCuda,
                              BindWithStream()
                                  .RemainingArgs()                     // histories, scales, amaxes
                                  .RemainingRets()                     // new histories, new scales
                                  .Attr<ffi::Span<const float>>("fp8_max")  // per tensor
                                  .Attr<double>("margin")              // any float >= 0
                                  .Attr<bool>("most_recent"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
