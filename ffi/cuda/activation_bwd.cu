// CUDA handler for te_act_bwd: g * act'(x) (both halves' gradients for a gated pair) in float32, stored as FP8 (times
// scale, saturating, amax, optional transposed copy) or float32/bfloat16/float16, with optional dbias. The kernel:
// activation.cuh.
#include "activation.cuh"
#include "te_jax/workspace.h"

namespace te_jax {
namespace {

ffi::Error ActBwdCuda(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer x, ffi::BufferR0<ffi::F32> scale,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dx_t,
                      ffi::Result<ffi::BufferR0<ffi::F32>> amax, ffi::Result<ffi::AnyBuffer> dbias,
                      ffi::Result<ffi::AnyBuffer> workspace, int64_t act, bool gated, int64_t batch_ndim,
                      int64_t gate, float limit, float alpha, float glu_linear_offset) {
  auto view = CheckActivationBwd(g, x, *dx, *dx_t, *dbias, gated, batch_ndim);
  if (view.has_error()) return view.error();
  const ActivationView v = *view;
  const int64_t out_cols = v.halves() * v.cols;
  const bool want_dbias = dbias->element_count() > 0;
  const int64_t partial_rows = DbiasPartialRows(v);
  const WorkspaceSize need = ActBwdWorkspace(v);
  if (want_dbias && (workspace->element_type() != need.type ||
                     static_cast<int64_t>(workspace->element_count()) < need.count)) {
    return ffi::Error::InvalidArgument("activation: the dbias workspace must be f32[" + std::to_string(need.count) +
                                       "] (te_jax._te_cuda.act_bwd_workspace)");
  }
  if (auto err = Prologue(stream, amax); err.failure()) return err;
  if (v.in_elements() == 0) {
    if (want_dbias) {
      TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dbias->untyped_data(), 0, dbias->size_bytes(), stream),
                                  "dbias memset");
    }
    return ffi::Error::Success();
  }
  Params p{};
  p.x = x.untyped_data();
  p.g = g.untyped_data();
  p.scale = scale.typed_data();
  p.out = dx->untyped_data();
  p.out_t = dx_t->element_count() > 0 ? static_cast<uint8_t*>(dx_t->untyped_data()) : nullptr;
  p.amax = reinterpret_cast<unsigned*>(amax->typed_data());
  if (want_dbias) {
    p.dbias_partial = static_cast<float*>(workspace->untyped_data());
    p.dbias_done = reinterpret_cast<unsigned*>(p.dbias_partial + partial_rows * out_cols);
    p.dbias = static_cast<float*>(dbias->untyped_data());
  }
  p.act = ActParams{limit, alpha, glu_linear_offset};
  return Launch<true>(stream, v, x.element_type(), dx->element_type(), act, gate, p);
}

}  // namespace

// The dbias partials (dx's columns, both halves of a gated pair), then the counters: the handler's Params.
WorkspaceSize ActBwdWorkspace(const ActivationView& v) {
  return {DbiasPartialRows(v) * v.halves() * v.cols + DbiasCounters(v), ffi::DataType::F32};
}

// Allocates nothing (the dbias partials and counters go to a workspace result): XLA may capture it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ActBwdCudaHandler, ActBwdCuda,
                              ActAttrs(ActBwdOperands(BindWithStream())
                                           .Ret<ffi::AnyBuffer>()),  // workspace: ActBwdWorkspace, or empty
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
