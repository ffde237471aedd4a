"""FP8 recipes: immutable, hashable, validated descriptions of how tensors are scaled and cast.

A recipe is part of ``autocast``'s state and therefore of jax's jit cache key: changing it retraces.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax.numpy as jnp

__all__ = ["Format", "MMParams", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "NVFP4BlockScaling"]


class Format(enum.Enum):
  """Which FP8 formats the forward and backward passes use.

  ``E4M3``: E4M3 everywhere. ``HYBRID``: E4M3 for forward tensors (inputs, weights) and E5M2, with its wider
  range, for gradients.
  """

  E4M3 = "E4M3"
  HYBRID = "HYBRID"

  @property
  def fwd_dtype(self):
    return jnp.dtype(jnp.float8_e4m3fn)

  @property
  def bwd_dtype(self):
    return jnp.dtype(jnp.float8_e5m2 if self is Format.HYBRID else jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class MMParams:
  """How one of a layer's three FP8 GEMMs (forward, dgrad, wgrad) accumulates.

  Attributes:
    use_split_accumulator: accumulate in full float32 precision. False selects Hopper's FP8 fast accumulation
      (cuBLASLt's ``CUBLASLT_MATMUL_DESC_FAST_ACCUM``): the tensor cores' partial sums are promoted to float32 less
      often, which is a few percent faster and less accurate over long contractions (the benchmarks report both).
      Transformer Engine's default, kept here: fast for the forward GEMM, full for dgrad and wgrad.
  """

  use_split_accumulator: bool = True

  def __post_init__(self):
    _check_flag("use_split_accumulator", self.use_split_accumulator)


def _check_gemm_params(recipe) -> None:
  for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
    value = getattr(recipe, name)
    if not isinstance(value, MMParams):
      raise ValueError(f"{name} must be a te_jax.recipe.MMParams, got {value!r}")


def _check_format(value) -> None:
  if not isinstance(value, Format):
    raise ValueError(f"fp8_format must be a te_jax.recipe.Format, got {value!r}")


def _check_flag(name: str, value) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be a bool, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """Per-tensor scaling from the amax history of earlier steps (Transformer Engine's default recipe).

  Each FP8 tensor keeps an amax history; the scale used at a step comes from the history up to the step before,
  so the cast needs no extra pass over the tensor. The state lives in the module's FP8 variable collection.

  >>> from te_jax import recipe
  >>> recipe.DelayedScaling(amax_history_len=16).amax_compute_algo
  'max'

  Attributes:
    margin: the scale leaves ``2**margin`` of headroom: ``scale = fp8_max / (amax * 2**margin)``; any finite value
      >= 0, an int or a float (as in Transformer Engine).
    fp8_format: ``Format.HYBRID`` (E4M3 forward, E5M2 gradients) or ``Format.E4M3``.
    amax_history_len: how many steps of amax each tensor remembers.
    amax_compute_algo: ``"max"`` over the history, or ``"most_recent"``.
    fp8_dpa: also run dot-product attention's forward in FP8 (cuDNN FP8 flash attention, per-tensor current
      scaling of q, k, v), in the attention modules whose configuration it supports (``te_jax.attention_backend``
      with ``fp8=True`` says why not); elsewhere attention stays in the input precision.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: the accumulation of the forward, input-gradient and
      weight-gradient GEMMs (``MMParams``).
  """

  margin: float = 0
  fp8_format: Format = Format.HYBRID
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  fp8_dpa: bool = False
  fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
  fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

  def __post_init__(self):
    if (not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or not math.isfinite(self.margin)
        or self.margin < 0):
      raise ValueError(f"margin must be a finite number >= 0 (an int or a float), got {self.margin!r}")
    _check_format(self.fp8_format)
    if not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len, bool) or (
        self.amax_history_len < 1):
      raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
    if self.amax_compute_algo not in ("max", "most_recent"):
      raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")
    _check_flag("fp8_dpa", self.fp8_dpa)
    _check_gemm_params(self)


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
  """Per-tensor scaling from the amax of the tensor itself, computed just before its cast (two passes, no state).

  Attributes:
    fp8_format: ``Format.HYBRID`` (E4M3 forward, E5M2 gradients) or ``Format.E4M3``.
    fp8_dpa: FP8 attention forward, as in ``DelayedScaling``.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: the GEMMs' accumulation, as in ``DelayedScaling``.
  """

  fp8_format: Format = Format.HYBRID
  fp8_dpa: bool = False
  fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
  fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

  def __post_init__(self):
    _check_format(self.fp8_format)
    _check_flag("fp8_dpa", self.fp8_dpa)
    _check_gemm_params(self)


class _BlockScaled:
  """What the block-scaled recipes share: attention stays in the input precision (no FP8 attention, ``fp8_dpa``)."""

  fp8_dpa = False  # a class attribute, not a field: not an option of these recipes


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_BlockScaled):
  """Block scaling (DeepSeek-V3, arXiv 2412.19437 §3.3): activations and gradients scaled per 1 x 128 tile of a row,
  weights per 128 x 128 block, each scale from its block's own amax. No state, so it works under ``nn.scan``, remat
  and every sharding (a block never straddles a shard: the ops raise where one would).

  On Hopper (compute capability 9.0) the GEMMs run natively through cuBLASLt's block-scaled FP8 kernels; elsewhere they
  dequantize into bfloat16 (``python -m te_jax.doctor`` says which).

  >>> from te_jax import recipe
  >>> recipe.Float8BlockScaling().fp8_format.name
  'E4M3'

  Attributes:
    fp8_format: ``Format.E4M3`` (E4M3 everywhere, DeepSeek-V3's and Transformer Engine's default for this recipe) or
      ``Format.HYBRID`` (E5M2 gradients).
    power_of_two_scales: round each scale down to a power of two, so that scaling and dequantization are exact
      (Transformer Engine's default); False keeps float32 scales.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: the GEMMs' accumulation (``MMParams``); full precision for all
      three by default.
  """

  fp8_format: Format = Format.E4M3
  power_of_two_scales: bool = True
  fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

  def __post_init__(self):
    _check_format(self.fp8_format)
    _check_flag("power_of_two_scales", self.power_of_two_scales)
    _check_gemm_params(self)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_BlockScaled):
  """MXFP8 (OCP Microscaling Formats v1.0): every tensor scaled per 1 x 32 elements of a row by a power of two (an
  E8M0 scale), each direction of a tensor (the GEMM operand and its transposed copy) with its own scales. No state.

  Native GEMMs need compute capability 10.x (Blackwell); on Hopper the quantize is native and the GEMM dequantizes
  into bfloat16 ("emulated": its numerics, not its speed).

  >>> from te_jax import recipe
  >>> recipe.MXFP8BlockScaling().fp8_format.name
  'E4M3'

  Attributes:
    fp8_format: ``Format.E4M3`` (the default) or ``Format.HYBRID`` (E5M2 gradients).
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: the GEMMs' accumulation (``MMParams``).
  """

  fp8_format: Format = Format.E4M3
  fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

  def __post_init__(self):
    _check_format(self.fp8_format)
    _check_gemm_params(self)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(_BlockScaled):
  """NVFP4 (NVIDIA's recipe, arXiv 2509.25149): E2M1 values, an E4M3 scale per 1 x 16 elements of a row and a float32
  scale per tensor. No state.

  Weights are scaled per 16 x 16 block (``weight_block_2d``), so that a weight and its transpose hold the same
  values; the gradients round stochastically (``stochastic_rounding``); the weight-gradient GEMM's operands (the
  transposed input and output gradient, contracted over the tokens) pass through a random Hadamard transform over
  blocks of 16 tokens first (``random_hadamard_transform``), which spreads outliers across each block and cancels in
  the product. Native GEMMs need compute capability 10.x; on Hopper the GEMM dequantizes into bfloat16 ("emulated").

  >>> from te_jax import recipe
  >>> recipe.NVFP4BlockScaling().stochastic_rounding
  True

  Attributes:
    weight_block_2d: 16 x 16 blocks for weights (else 1 x 16, as for the other tensors).
    stochastic_rounding: round gradients stochastically (unbiased), the rest to nearest.
    random_hadamard_transform: transform the weight-gradient GEMM's operands by a 16 x 16 Hadamard matrix with
      random signs (fixed by ``hadamard_seed``) over blocks of tokens.
    hadamard_seed: the seed of the transform's random signs.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: the GEMMs' accumulation (``MMParams``).
  """

  weight_block_2d: bool = True
  stochastic_rounding: bool = True
  random_hadamard_transform: bool = True
  hadamard_seed: int = 0
  fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

  def __post_init__(self):
    for name in ("weight_block_2d", "stochastic_rounding", "random_hadamard_transform"):
      _check_flag(name, getattr(self, name))
    if not isinstance(self.hadamard_seed, int) or isinstance(self.hadamard_seed, bool) or self.hadamard_seed < 0:
      raise ValueError(f"hadamard_seed must be an int >= 0, got {self.hadamard_seed!r}")
    _check_gemm_params(self)


Recipe = DelayedScaling | Float8CurrentScaling | Float8BlockScaling | MXFP8BlockScaling | NVFP4BlockScaling
