// The CUDA extension module: exports the FFI handlers as capsules keyed by target name, the library versions
// that `python -m te_jax.doctor` reports, and the kernels' geometry: the size of each handler's workspace result
// (te_jax/workspace.h), which te_jax/ops asks for instead of computing it, and the kernels' capacities (most parts,
// mask groups), which tests/test_geometry.py checks against the API's limits; and the scaling modes' table
// (te_jax/scaling_mode.h), checked against te_jax.ScalingMode.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "te_jax/activation_view.h"
#include "te_jax/gemm_batch.h"
#include "te_jax/gemm_plans.h"
#include "te_jax/quantize_view.h"
#include "te_jax/scaling_mode.h"
#include "te_jax/softmax_view.h"
#include "te_jax/workspace.h"

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace te_jax {
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeInterleavedCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeBlockCudaHandler);
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
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmCudaHandler);
}

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// A workspace as te_jax._core.native.workspace takes it: (elements, numpy dtype name).
nb::tuple Workspace(te_jax::WorkspaceSize w) {
  switch (w.type) {
    case xla::ffi::DataType::F32: return nb::make_tuple(w.count, "float32");
    case xla::ffi::DataType::U8: return nb::make_tuple(w.count, "uint8");
    default: throw std::logic_error("te_jax: a workspace of an unexpected type");
  }
}

// The value of a view that a handler would build, or the handler's error as a ValueError.
template <typename T>
T OrValueError(xla::ffi::ErrorOr<T> v) {
  if (v.has_error()) throw nb::value_error(v.error().message().c_str());
  return *v;
}
}  // namespace

NB_MODULE(_te_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["te_quantize_cuda"] = Capsule(te_jax::QuantizeCudaHandler);
    d["te_quantize_interleaved_cuda"] = Capsule(te_jax::QuantizeInterleavedCudaHandler);
    d["te_quantize_block_cuda"] = Capsule(te_jax::QuantizeBlockCudaHandler);
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
    d["te_grouped_gemm_cuda"] = Capsule(te_jax::GroupedGemmCudaHandler);
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
      d["batch"] = p.batch;
      d["lhs_dtype"] = p.lhs_type;
      d["rhs_dtype"] = p.rhs_type;
      d["out_dtype"] = p.out_type;
      d["fast_accum"] = p.fast_accum;
      d["candidates"] = p.candidates;
      d["chosen"] = p.chosen;
      d["deterministic"] = p.deterministic;
      d["captured"] = p.captured;
      plans.append(d);
    }
    return plans;
  });

  // ---- workspaces: (elements, dtype) of the result the handler checks and carves, for these operands/attributes ----
  m.def(
      "gemm_workspace",
      [](int parts) {
        if (parts < 1 || parts > te_jax::kMaxGemmParts) {
          throw nb::value_error(("gemm_workspace: parts must be in [1, " + std::to_string(te_jax::kMaxGemmParts) +
                                 "], got " + std::to_string(parts)).c_str());
        }
        return Workspace(te_jax::GemmWorkspace(parts));
      },
      nb::arg("parts"), "te_gemm_cuda's workspace for `parts` outputs.");
  m.def(
      "grouped_gemm_workspace",
      [](bool ragged, int64_t rows, int64_t k, int64_t n, int64_t tile, int out_bytes) {
        if (tile < 16 || tile % 16 != 0 || rows % tile != 0) {
          throw nb::value_error(("grouped_gemm_workspace: tile must be a multiple of 16 dividing rows = " +
                                 std::to_string(rows) + ", got " + std::to_string(tile)).c_str());
        }
        return Workspace(te_jax::GroupedGemmWorkspace(ragged, rows, k, n, tile, out_bytes));
      },
      nb::arg("ragged"), nb::arg("rows"), nb::arg("k"), nb::arg("n"), nb::arg("tile"), nb::arg("out_bytes"),
      "te_grouped_gemm_cuda's workspace (rows: the grouped M; k, n: the output's other dims).");
  m.def(
      "quantize_workspace",
      [](const std::vector<int64_t>& x_shape, int64_t batch_ndim) {
        return Workspace(te_jax::QuantizeWorkspace(OrValueError(te_jax::MakeQuantizeView(x_shape, batch_ndim))));
      },
      nb::arg("x_shape"), nb::arg("batch_ndim"),
      "te_quantize_cuda's dbias workspace (te_quantize_interleaved_cuda's: x_shape with the parts side by side).");
  m.def(
      "act_bwd_workspace",
      [](const std::vector<int64_t>& x_shape, bool gated, int64_t batch_ndim) {
        return Workspace(te_jax::ActBwdWorkspace(OrValueError(te_jax::MakeActivationView(x_shape, gated, batch_ndim))));
      },
      nb::arg("x_shape"), nb::arg("gated"), nb::arg("batch_ndim"), "te_act_bwd_cuda's dbias workspace.");
  m.def(
      "norm_bwd_workspace",
      [](const std::vector<int64_t>& x_shape, bool rmsnorm) {
        const int64_t cols = x_shape.empty() ? 0 : x_shape.back();  // the handler's view: CheckNormBwd
        if (cols < 1) throw nb::value_error("norm_bwd_workspace: x's last dim must be >= 1");
        int64_t rows = 1;
        for (size_t i = 0; i + 1 < x_shape.size(); ++i) rows *= x_shape[i];
        return Workspace(te_jax::NormBwdWorkspace(rows, cols, rmsnorm));
      },
      nb::arg("x_shape"), nb::arg("rmsnorm"), "te_norm_bwd_cuda's workspace.");

  // ---- capacities: the most the kernels take, at least the API's limits (tests/test_geometry.py) -----------------
  m.def("scaling_modes", &te_jax::scaling_mode_table,
        "(te_jax.ScalingMode's name, the kernels' number, block rows, block cols) of each mode (scaling_mode.h).");
  m.def("gemm_max_parts", []() { return te_jax::kMaxGemmParts; }, "te_gemm_cuda's most outputs (rhs parts).");
  m.def("quantize_interleaved_max_parts", []() { return te_jax::kMaxInterleavedParts; },
        "te_quantize_interleaved_cuda's most parts.");
  m.def("quantize_interleaved_max_cols", []() { return te_jax::kMaxInterleavedCols; },
        "te_quantize_interleaved_cuda's most columns of x (the parts side by side).");
  m.def("softmax_max_mask_groups", []() { return te_jax::kMaxMaskGroups; },
        "The softmax handlers' most mask groups (runs of leading dims the mask broadcasts or not).");
}
