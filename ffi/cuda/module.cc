// The CUDA extension module: exports the FFI handlers as capsules keyed by target name, and the library versions
// that `python -m te_jax.doctor` reports.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "te_jax/gemm_plans.h"

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace te_jax {
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeInterleavedCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActFwdCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActBwdCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NormFwdCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NormBwdCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RopeFwdCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RopeBwdCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ScaleUpdateCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxFwdCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxBwdCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmCudaHandler);
}

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_te_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["te_quantize_cuda"] = Capsule(te_jax::QuantizeCudaHandler);
    d["te_quantize_interleaved_cuda"] = Capsule(te_jax::QuantizeInterleavedCudaHandler);
    d["te_act_fwd_cuda"] = Capsule(te_jax::ActFwdCudaHandler);
    d["te_act_bwd_cuda"] = Capsule(te_jax::ActBwdCudaHandler);
    d["te_norm_fwd_cuda"] = Capsule(te_jax::NormFwdCudaHandler);
    d["te_norm_bwd_cuda"] = Capsule(te_jax::NormBwdCudaHandler);
    d["te_rope_fwd_cuda"] = Capsule(te_jax::RopeFwdCudaHandler);
    d["te_rope_bwd_cuda"] = Capsule(te_jax::RopeBwdCudaHandler);
    d["te_scale_update_cuda"] = Capsule(te_jax::ScaleUpdateCudaHandler);
    d["te_softmax_fwd_cuda"] = Capsule(te_jax::SoftmaxFwdCudaHandler);
    d["te_softmax_bwd_cuda"] = Capsule(te_jax::SoftmaxBwdCudaHandler);
    d["te_gemm_cuda"] = Capsule(te_jax::GemmCudaHandler);
    return d;
  });
  // The CUDA runtime this module was built with (static cudart), e.g. 13000.
  m.def("cuda_runtime_version", []() { return CUDART_VERSION; });
  // The driver's CUDA version, or 0 when no driver is installed.
  m.def("cuda_driver_version", []() {
    int v = 0;
    return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
  });
  // The cuBLASLt library loaded at run time, e.g. 131000.
  m.def("cublaslt_version", []() { return static_cast<int64_t>(cublasLtGetVersion()); });
  // te_gemm's cached plans, one dict per device and problem, with how its algorithm was chosen.
  m.def("gemm_plans", []() {
    nb::list plans;
    for (const te_jax::GemmPlanInfo& p : te_jax::GemmPlans()) {
      nb::dict d;
      d["device"] = p.device;
      d["m"] = p.m;
      d["n"] = p.n;
      d["k"] = p.k;
      d["parts"] = p.parts;
      d["lhs_dtype"] = p.lhs_type;
      d["rhs_dtype"] = p.rhs_type;
      d["out_dtype"] = p.out_type;
      d["fast_accum"] = p.fast_accum;
      d["candidates"] = p.candidates;
      d["chosen"] = p.chosen;
      d["captured"] = p.captured;
      plans.append(d);
    }
    return plans;
  });
}
