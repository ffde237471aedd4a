"""Every CUDA kernel of te_jax, run at small and odd shapes, for NVIDIA compute-sanitizer.

Not a pytest file: a program that ``scripts/gpu_check.sh sanitize`` runs under each compute-sanitizer tool (memcheck,
initcheck, racecheck, synccheck), with the tool's kernel filter on te_jax's own kernels (cuBLASLt and cuDNN kernels
run uninstrumented; they are NVIDIA's to check). Each case compiles one small program, runs it once and checks that
it finished; the sanitizer reports what the kernels did wrong on the way. So that the tools see real buffers:

- ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``: every XLA buffer its own cudaMalloc, so an access past a buffer's end is
  outside any allocation (with JAX's pooled allocator it would land in a neighbour) and initcheck tracks each buffer;
- ``--xla_gpu_enable_command_buffer=``: no CUDA graphs, so each kernel is launched as itself;
- ``--xla_gpu_autotune_level=0``: no autotuning launches of XLA's own kernels.

  XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \\
    compute-sanitizer --tool memcheck --kernel-name kns=te_jax python tests/sanitize_kernels.py

initcheck runs with ``--check-api-memory-access no``: its host-API check flags XLA's device-to-device copies of
buffers written by host-to-device transfers it does not track; whether a te_jax kernel leaves part of an output
unwritten is what ``--poison`` checks instead, by the bytes. racecheck skips the GEMMs (``--skip gemm``): cuBLASLt's
Hopper kernels raise a hardware exception the tool cannot handle, and te_jax's batched-GEMM pointer kernel uses no
shared memory.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from te_jax import QuantizedTensor, ScalingMode
from te_jax.ops import (activation, gemm, norm, quantize, quantize_block, quantize_interleaved, rope, scale_update,
                        softmax)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Odd sizes (a single row, primes, not multiples of the tiles) beside aligned ones.
SHAPES = ((1, 16), (7, 48), (33, 80), (128, 256), (257, 528))


def _x(shape, dtype=jnp.bfloat16, seed=0, fn=None):
  """A random input, made and converted on the host (``fn`` applied there too), then transferred: initcheck sees the
  transfer write it. (An input computed by an XLA kernel would read as uninitialized: the tools instrument te_jax's
  kernels only, so the writes of XLA's go untracked.)"""
  x = np.random.default_rng(seed).standard_normal(shape, np.float32)
  return jnp.asarray(np.asarray(x if fn is None else fn(x), dtype))


def cases():
  """(name, function, arguments): one of each kernel's configurations per shape."""
  s = jnp.float32(2.0)
  for m, n in SHAPES:
    x, g = _x((m, n)), _x((m, n), seed=1)
    yield f"quantize {m}x{n}", lambda x: quantize.quantize(x, s, E4M3), (x,)
    yield f"quantize+T+dbias {m}x{n} e5m2", lambda x: quantize.quantize(x, s, E5M2, transpose=True, dbias=True), (x,)
    for mode, kw in ((ScalingMode.BLOCK_1X128, {}), (ScalingMode.BLOCK_128X128, dict(dtype=E5M2)),
                     (ScalingMode.MXFP8_1X32, {}), (ScalingMode.NVFP4_1X16, dict(key=jax.random.key(m))),
                     (ScalingMode.NVFP4_1X16, dict(block_2d=True))):
      yield (f"quantize_block {mode.name}{' ' + ','.join(kw) if kw else ''} +T {m}x{n}",
             lambda x, mode=mode, kw=kw: quantize_block.quantize_block(x, mode, with_transposed=True, **kw), (x,))
    yield (f"quantize_interleaved {m}x{n}",
           lambda a, b: quantize_interleaved.quantize_interleaved([a, b], s, group=n, transpose=True), (x, g))
    for act in (("gelu",), ("silu", "linear")):
      xa = _x((m, 2, n)) if len(act) == 2 else x
      yield f"act fwd {'+'.join(act)} {m}x{n}", lambda xa, act=act: activation.activation_fwd(
          xa, act, dtype=E4M3, scale=s, transpose=True), (xa,)
      yield f"act bwd {'+'.join(act)} {m}x{n}", lambda g, xa, act=act: activation.activation_bwd(
          g, xa, act, dtype=E5M2, scale=s, transpose=True, dbias=True), (g, xa)
    gamma, beta = _x((n,), jnp.float32, 2), _x((n,), jnp.float32, 3)
    for kind in ("layernorm", "rmsnorm"):
      b = beta if kind == "layernorm" else None
      yield f"{kind} fwd fp8 {m}x{n}", lambda x, gm, b=b, kind=kind: norm.norm_fwd(
          x, gm, b, norm_type=kind, dtype=E4M3, scale=s, transpose=True), (x, gamma)

      def fwd_bwd(x, gm, dz, b=b, kind=kind):
        out = norm.norm_fwd(x, gm, b, norm_type=kind)
        return norm.norm_bwd(dz, x, out.mean, out.rsigma, gm, norm_type=kind, dres=dz)

      yield f"{kind} fwd+bwd {m}x{n}", fwd_bwd, (x, gamma, g)
  for b, h, t, k in ((1, 1, 1, 1), (2, 3, 17, 33), (2, 4, 128, 128), (1, 2, 5, 4099)):
    logits, dy = _x((b, h, t, k)), _x((b, h, t, k), seed=4)
    mask = jnp.asarray(np.random.default_rng(5).random((b, 1, t, k)) < 0.3)
    for kind in softmax.SOFTMAX_KINDS:
      if kind == "causal" and t != k:
        continue
      args = (logits, mask) if kind == "masked" else (logits,)

      def fwd_bwd(logits, *mask, kind=kind, dy=dy):
        y = softmax.softmax_fwd(logits, *mask, kind=kind, scale_factor=0.5)
        return softmax.softmax_bwd(dy, y, kind=kind, scale_factor=0.5)

      yield f"softmax {kind} {b}x{h}x{t}x{k}", fwd_bwd, args
  for bsz, seq, heads, dim in ((1, 1, 1, 2), (2, 17, 3, 64), (2, 128, 8, 128)):
    x = _x((bsz, seq, heads, dim))
    freqs = np.asarray(rope.rope_frequencies(seq, dim))
    cos, sin = jnp.asarray(np.cos(freqs)), jnp.asarray(np.sin(freqs))  # on the host, as _x's inputs
    for interleaved in (False, True):
      yield (f"rope fwd+bwd {bsz}x{seq}x{heads}x{dim}{' interleaved' if interleaved else ''}",
             lambda x, i=interleaved: rope.rope_bwd(rope.rope_fwd(x, cos, sin, interleaved=i), cos, sin,
                                                     interleaved=i), (x,))
  for length, count in ((1, 1), (16, 3), (1024, 37)):
    histories = tuple(_x((length,), jnp.float32, i, fn=np.abs) for i in range(count))
    yield (f"scale_update {count} x {length}", lambda *h: scale_update.scale_update(
        h, [jnp.float32(1.0)] * len(h), [jnp.float32(3.0)] * len(h), [448.0, 57344.0] * (len(h) // 2) + [448.0] * (
            len(h) % 2)), histories)
  for m, k, n in ((16, 16, 16), (48, 80, 32), (256, 512, 128)):
    a, w = _x((m, k)), _x((k, n), seed=6)
    yield f"gemm bf16 {m}x{k}x{n}", lambda a, w: gemm.gemm(a, w.T), (a, w)
    qa, qw = quantize.quantize(a, s, E4M3).out, quantize.quantize(w, s, E4M3, transpose=True).out
    yield f"gemm fp8 {m}x{k}x{n} (+ bias, residual)", lambda qa, qwt, bias, res: gemm.gemm(
        QuantizedTensor(qa, 1 / s), QuantizedTensor(qwt, 1 / s), bias=bias, residual=res), (
        qa.data, qw.data_t, _x((n,)), _x((m, n), seed=7))
    parts = 2
    if n % (16 * parts):
      continue
    qp = quantize.quantize(w, s, E4M3, transpose=True, transpose_parts=(parts, n // parts)).out
    yield f"gemm fp8 {m}x{k}x{n} in {parts} parts (batched)", lambda qa, qwt: gemm.gemm(
        QuantizedTensor(qa, 1 / s), QuantizedTensor(qwt, 1 / s), rhs_parts=True), (qa.data, qp.data_t)


def _poison(byte: int) -> None:
  """Fills 256 MiB of device memory with ``byte`` and frees it: the next buffers come from that memory."""
  jax.block_until_ready(jnp.full((256 << 20,), byte, jnp.uint8)).delete()


def _bytes(out) -> list[bytes]:
  return [np.asarray(o).tobytes() for o in jax.tree.leaves(out)]


def main() -> int:
  """``--skip NAME`` (repeatable) leaves out the cases whose name starts with NAME; ``--poison`` runs each case after
  filling the memory its buffers will take with 0x00 and then with 0xFF bytes, and fails unless the outputs are the
  same bytes: an output element the kernels leave unwritten shows as a difference."""
  args = sys.argv[1:]
  skip = tuple(args[i + 1] for i, a in enumerate(args) if a == "--skip")
  poison = "--poison" in args
  if jax.default_backend() != "gpu":
    print("sanitize_kernels: no GPU: nothing to check", file=sys.stderr)
    return 1
  t0, count, bad = time.time(), 0, 0
  for name, fn, fargs in cases():
    if name.startswith(skip):
      continue
    f = jax.jit(fn)
    if poison:
      jax.block_until_ready(f(*fargs))  # compiled, its constants placed
      outs = []
      for byte in (0x00, 0xFF):
        _poison(byte)
        outs.append(_bytes(f(*fargs)))
      ok = outs[0] == outs[1]
    else:
      out = jax.block_until_ready(f(*fargs))
      ok = all(bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))) for o in jax.tree.leaves(out)
               if o.dtype not in (E4M3, E5M2) and o.size)
    bad += not ok
    print(f"{name}: {'ok' if ok else 'UNWRITTEN BYTES' if poison else 'NOT FINITE'}", flush=True)
    count += 1
  print(f"sanitize_kernels: {count} cases in {time.time() - t0:.0f} s, {bad} failed")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
