// CUDA handler for te_act_fwd: act(x), or f(a) * h(b) for a pair (f, h), in float32, stored as FP8 (times scale,
// saturating, amax, optional transposed copy) or float32/bfloat16/float16. The kernel: activation.cuh.
#include "activation.cuh"

namespace te_jax {
namespace {

ffi::Error ActFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::BufferR0<ffi::F32> scale,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_t,
                      ffi::Result<ffi::BufferR0<ffi::F32>> amax, int64_t act, bool gated, int64_t batch_ndim,
                      int64_t gate, float limit, float alpha, float glu_linear_offset) {
  auto view = MakeActivationView(x.dimensions(), gated, batch_ndim);
  if (view.has_error()) return view.error();
  if (auto err = CheckActivationOutputs(*out, *out_t, view->out_elements()); err.failure()) return err;
  if (auto err = Prologue(stream, amax); err.failure()) return err;
  if (view->out_elements() == 0) return ffi::Error::Success();
  Params p{};
  p.x = x.untyped_data();
  p.scale = scale.typed_data();
  p.out = out->untyped_data();
  p.out_t = out_t->element_count() > 0 ? static_cast<uint8_t*>(out_t->untyped_data()) : nullptr;
  p.amax = reinterpret_cast<unsigned*>(amax->typed_data());
  p.act = ActParams{limit, alpha, glu_linear_offset};
  return Launch<false>(stream, *view, x.element_type(), out->element_type(), act, gate, p);
}

}  // namespace

// Allocates nothing: XLA may capture it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ActFwdCudaHandler, ActFwdCuda,
                              ActAttrs(ActFwdOperands(BindWithStream())),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
