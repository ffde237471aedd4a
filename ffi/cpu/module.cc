// The CPU extension module: exports the FFI handlers as capsules, keyed by target name, and the capacity of the
// handlers that tests/test_geometry.py checks against the API's limits, and the scaling modes' table
// (te_jax/scaling_mode.h), checked against te_jax.ScalingMode. The CPU handlers take no workspace.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "te_jax/scaling_mode.h"
#include "te_jax/softmax_view.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace te_jax {
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActFwdCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ActBwdCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NormFwdCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NormBwdCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RopeFwdCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RopeBwdCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxFwdCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SoftmaxBwdCpuHandler);
}

NB_MODULE(_te_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["te_quantize_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::QuantizeCpuHandler));
    d["te_act_fwd_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::ActFwdCpuHandler));
    d["te_act_bwd_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::ActBwdCpuHandler));
    d["te_norm_fwd_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::NormFwdCpuHandler));
    d["te_norm_bwd_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::NormBwdCpuHandler));
    d["te_rope_fwd_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::RopeFwdCpuHandler));
    d["te_rope_bwd_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::RopeBwdCpuHandler));
    d["te_softmax_fwd_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::SoftmaxFwdCpuHandler));
    d["te_softmax_bwd_cpu"] = nb::capsule(reinterpret_cast<void*>(te_jax::SoftmaxBwdCpuHandler));
    return d;
  });
  m.def("scaling_modes", &te_jax::scaling_mode_table,
        "(te_jax.ScalingMode's name, the kernels' number, block rows, block cols) of each mode (scaling_mode.h).");
  m.def("softmax_max_mask_groups", []() { return te_jax::kMaxMaskGroups; },
        "The softmax handlers' most mask groups (runs of leading dims the mask broadcasts or not).");
}
