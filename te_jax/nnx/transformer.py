"""NNX ``TransformerLayer``: self attention, optional cross attention and an MLP, each with dropout and a residual,
pre-LN (norms fused into the FP8 GEMMs after them) or post-LN, composed as te_jax.flax.TransformerLayer is (same
arguments, parameter tree and math). Masks follow Flax (True or nonzero = attend)
unless ``mask_convention="te"``."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.flax.params import ACT, EMBED, HEADS, MLP, Initializer, axes
from te_jax.modules.attention_cache import check_fits_cache, require_cache
from te_jax.nnx.attention import MultiHeadAttention, RelativePositionBiases
from te_jax.nnx.dense import DenseGeneral
from te_jax.nnx.layernorm import LayerNorm, LayerNormMLP
from te_jax.nnx.params import resolve_deterministic
from te_jax.ops.activation import activation
from te_jax.recipe import Recipe

__all__ = ["TransformerLayer"]


class TransformerLayer(nnx.Module):
  """One Transformer layer: self attention, (decoder) cross attention, MLP, each with dropout and a residual; see
  te_jax.flax.TransformerLayer for the arguments, which are the same here, constructed up front.

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> layer = te_nnx.TransformerLayer(64, 128, 4, rngs=nnx.Rngs(0))
  >>> layer(jnp.ones((2, 8, 64), jnp.bfloat16)).shape, layer.mlp.wi_kernel.shape
  ((2, 8, 64), (64, 1, 128))

  Decoding with the self attention's KV cache (``init_cache`` first):

  >>> layer = te_nnx.TransformerLayer(64, 128, 4, layer_type="decoder", enable_relative_embedding=True, decode=True,
  ...                                 rngs=nnx.Rngs(0))
  >>> layer.init_cache((2, 8, 64))
  >>> x = jnp.ones((2, 8, 64))
  >>> layer(x[:, :3]).shape, layer(x[:, 3:4]).shape, int(layer.self_attention.cache_index[...])
  ((2, 3, 64), (2, 1, 64), 4)

  Differences from linen: the cross attention of a decoder exists when ``cross_attention=True`` (linen creates it
  when ``init`` sees ``encoded``), and then every call takes ``encoded``; the KV cache is made by ``init_cache``
  (linen's by ``init`` with ``decode=True``). ``logical_axes=True`` puts the logical axis names on the parameters as
  ``out_sharding`` metadata; the residual stream's sharding constraint stays linen's.

  Args:
    hidden_size, intermediate_dim, num_attention_heads, and the keywords: te_jax.flax.TransformerLayer's attributes.
    cross_attention: a decoder's attention over ``encoded``.
    enable_relative_embedding: add T5 relative position biases (the ``relpos_bias`` RelativePositionBiases, with
      ``relative_embedding_buckets`` buckets and ``relative_embedding_max_distance``; bidirectional in an encoder)
      to the self attention's logits, as its post-scale bias; not with another ``self_attn_bias_type``.
    relative_embedding_buckets, relative_embedding_max_distance: those biases' buckets and max distance.
    decode: use and update the self attention's KV cache in every call (the call's ``decode`` takes precedence);
      call ``init_cache`` first. The relative biases and RoPE see the tokens at their positions in the cache.
    recipe: an FP8 recipe for every GEMM (and, with ``fp8_dpa=None``, the attention's FP8 choice), overriding
      autocast's.
    rngs: the ``params`` stream, and with dropout the ``dropout_rng_name`` stream.
  """

  def __init__(self, hidden_size: int = 512, intermediate_dim: int = 2048, num_attention_heads: int = 8, *,
               head_dim: int | None = None, num_gqa_groups: int | None = None, layer_type: str = "encoder",
               cross_attention: bool = False, self_attn_mask_type: str | None = None,
               self_attn_bias_type: str | None = None, enable_relative_embedding: bool = False,
               relative_embedding_buckets: int = 32, relative_embedding_max_distance: int = 128,
               norm_type: str = "layernorm", epsilon: float = 1e-6,
               zero_centered_gamma: bool = False, hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
               intermediate_dropout: float = 0.0, dropout_rng_name: str = "dropout",
               activation_type: Sequence[str] = ("gelu",), use_bias: bool = False,
               apply_residual_connection_post_layernorm: bool = False, output_layernorm: bool = False,
               enable_rotary_pos_emb: bool = False, rotary_base: float = 10000.0, rotary_percent: float = 1.0,
               rotary_interleaved: bool = False, window_size: tuple[int, int] | None = None,
               transpose_batch_sequence: bool = False,
               kernel_init: Initializer = nnx.initializers.variance_scaling(1.0, "fan_in", "normal"),
               deterministic: bool | None = None, dtype: Any = None, param_dtype: Any = jnp.float32,
               backend: str = "auto", logical_axes: bool = False, fp8_dpa: bool | None = None,
               mask_convention: str = "flax", context_parallel: str | None = None, cp_strategy: str = "all_gather",
               cp_load_balanced: bool = True, mesh: Any = None, decode: bool = False, recipe: Recipe | None = None,
               rngs: nnx.Rngs):
    if layer_type not in ("encoder", "decoder"):
      raise ValueError(f"layer_type must be one of ('encoder', 'decoder'), got {layer_type!r}")
    if cross_attention and layer_type != "decoder":
      raise ValueError("cross_attention=True is a decoder's: give layer_type='decoder'")
    if head_dim is None and hidden_size % num_attention_heads:
      raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_attention_heads={num_attention_heads}: "
                       "give head_dim")
    if apply_residual_connection_post_layernorm and output_layernorm:
      raise ValueError("apply_residual_connection_post_layernorm is a pre-LN option; output_layernorm=True is post-LN")
    if enable_relative_embedding and self_attn_bias_type not in (None, "post_scale_bias"):
      raise ValueError(f"enable_relative_embedding=True makes the relative biases the self attention's bias; "
                       f"self_attn_bias_type={self_attn_bias_type!r} asks for another")
    self.hidden_size, self.layer_type, self.hidden_dropout = hidden_size, layer_type, hidden_dropout
    self.transpose_batch_sequence = transpose_batch_sequence
    self.attention_dropout, self.intermediate_dropout = attention_dropout, intermediate_dropout
    self.post_residual, self.output_layernorm = apply_residual_connection_post_layernorm, output_layernorm
    self.dtype, self.param_dtype, self.deterministic = dtype, param_dtype, deterministic
    self.activation_type = tuple(activation_type)
    ax = functools.partial(axes, logical_axes)
    self.mask_type = self_attn_mask_type or ("causal" if layer_type == "decoder" else "padding")
    self.enable_relative_embedding = enable_relative_embedding
    if enable_relative_embedding:
      self.relpos_bias = RelativePositionBiases(relative_embedding_buckets, relative_embedding_max_distance,
                                                num_attention_heads, embedding_axes=ax(HEADS, None),
                                                dtype=jnp.float32, rngs=rngs)
      self_attn_bias_type = "post_scale_bias"
    mha = functools.partial(
        MultiHeadAttention, hidden_size, head_dim or hidden_size // num_attention_heads, num_attention_heads,
        num_gqa_groups=num_gqa_groups, attention_dropout=attention_dropout, dropout_rng_name=dropout_rng_name,
        input_layernorm=not output_layernorm, norm_type=norm_type, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, rotary_base=rotary_base, rotary_percent=rotary_percent,
        rotary_interleaved=rotary_interleaved, use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
        param_dtype=param_dtype, backend=backend, logical_axes=logical_axes, fp8_dpa=fp8_dpa, recipe=recipe,
        mask_convention=mask_convention, return_layernorm_output=apply_residual_connection_post_layernorm,
        transpose_batch_sequence=transpose_batch_sequence, rngs=rngs)
    # The mask type is the call's (padding without a mask is no mask): attention takes it per call, see __call__.
    self.self_attention = mha(attn_mask_type=self.mask_type, attn_bias_type=self_attn_bias_type,
                              enable_rotary_pos_emb=enable_rotary_pos_emb, window_size=window_size,
                              context_parallel=context_parallel, cp_strategy=cp_strategy,
                              cp_load_balanced=cp_load_balanced, mesh=mesh, decode=decode)
    norm = functools.partial(LayerNorm, hidden_size, norm_type=norm_type, epsilon=epsilon,
                             zero_centered_gamma=zero_centered_gamma, scale_axes=ax(EMBED), bias_axes=ax(EMBED),
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.cross_attention = cross_attention
    if cross_attention:
      self.encoder_decoder_attention = mha(attention_type="cross", attn_mask_type="padding")
      if output_layernorm:
        self.encoder_decoder_attention_layernorm = norm()
    if output_layernorm:
      self.self_attention_layernorm = norm()
      self.mlp_layernorm = norm()
      n_act = 2 if len(self.activation_type) == 2 else 1
      dense = functools.partial(DenseGeneral, use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
                                param_dtype=param_dtype, recipe=recipe, rngs=rngs)
      self.wi = dense(hidden_size, (n_act, intermediate_dim), kernel_axes=ax(EMBED, ACT, MLP), bias_axes=ax(ACT, MLP))
      self.wo = dense(intermediate_dim, hidden_size, kernel_axes=ax(MLP, EMBED), bias_axes=ax(EMBED))
      self.intermediate = nnx.Dropout(intermediate_dropout, rng_collection=dropout_rng_name,
                                      rngs=rngs if intermediate_dropout > 0 else None)
    else:
      self.mlp = LayerNormMLP(
          hidden_size, intermediate_dim, activation_type=self.activation_type,
          intermediate_dropout=intermediate_dropout, dropout_rng_name=dropout_rng_name, use_bias=use_bias,
          return_layernorm_output=apply_residual_connection_post_layernorm, norm_type=norm_type, epsilon=epsilon,
          zero_centered_gamma=zero_centered_gamma, kernel_init=kernel_init, wi_kernel_axes=ax(EMBED, ACT, MLP),
          wo_kernel_axes=ax(MLP, EMBED), wi_bias_axes=ax(ACT, MLP), wo_bias_axes=ax(EMBED),
          ln_scale_axes=ax(EMBED), ln_bias_axes=ax(EMBED), dtype=dtype, param_dtype=param_dtype, recipe=recipe,
          rngs=rngs)
    self.dropout = nnx.Dropout(hidden_dropout, rng_collection=dropout_rng_name,
                               rngs=rngs if hidden_dropout > 0 else None)

  @property
  def decode(self) -> bool:
    """Whether calls use the self attention's KV cache by default (the constructor's ``decode``)."""
    return self.self_attention.decode

  def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None) -> None:
    """Creates (or empties) the self attention's KV cache: see ``MultiHeadAttention.init_cache`` (``input_shape``:
    the inputs' shape at the full length the cache holds)."""
    self.self_attention.init_cache(input_shape, dtype)

  def _relative_bias(self, x, decode: bool):
    """The relative position biases of the self attention: over this input's positions, or when decoding, of the
    queries at the cache index over every key the cache holds."""
    seq_axis = 0 if self.transpose_batch_sequence else 1
    length, bidirectional = x.shape[seq_axis], self.layer_type == "encoder"
    if not decode:
      return self.relpos_bias(length, length, bidirectional=bidirectional)
    attn = self.self_attention
    cache_shape = attn.cached_key.shape
    return self.relpos_bias(length, cache_shape[1], bidirectional=bidirectional, q_offset=attn.cache_index[...])

  def _dropout_add(self, y, residual, deterministic: bool):
    return self.dropout(y, deterministic=deterministic).astype(residual.dtype) + residual

  def _residual_block(self, block, residual, deterministic: bool):
    """As te_jax.flax.TransformerLayer's: the residual added in the block's last GEMM where nothing comes between."""
    if self.post_residual:
      y, normalized = block(None)
      return self._dropout_add(y, normalized, deterministic)
    compute_dtype = jnp.dtype(self.dtype or jnp.result_type(residual.dtype, self.param_dtype))
    if (self.hidden_dropout == 0.0 or deterministic) and jnp.dtype(residual.dtype) == compute_dtype:
      return block(residual)
    return self._dropout_add(block(None), residual, deterministic)

  def _plain_mlp(self, x, deterministic: bool):
    h = self.wi(x)
    a = activation(h if len(self.activation_type) == 2 else h[..., 0, :], self.activation_type)
    return self.wo(self.intermediate(a, deterministic=deterministic))

  def __call__(self, inputs: jax.Array, encoded: jax.Array | None = None, attention_mask: jax.Array | None = None,
               encoder_decoder_mask: jax.Array | None = None, *, segment_ids=None,
               positions: jax.Array | None = None, deterministic: bool | None = None,
               decode: bool | None = None) -> jax.Array:
    """As te_jax.flax.TransformerLayer's call; ``decode`` (None: the constructor's) uses and updates the self
    attention's KV cache of ``init_cache``."""
    deterministic = resolve_deterministic(self, deterministic, hidden_dropout=self.hidden_dropout,
                                          attention_dropout=self.attention_dropout,
                                          intermediate_dropout=self.intermediate_dropout)
    if inputs.ndim != 3 or inputs.shape[-1] != self.hidden_size:
      raise ValueError(f"inputs must be 3-D with last dim hidden_size={self.hidden_size}, got shape {inputs.shape}")
    if (encoded is not None) != self.cross_attention:
      raise ValueError("encoded is given but the layer has no cross attention (cross_attention=False)"
                       if encoded is not None else "the layer has cross attention: pass encoded")
    mask_type = self.mask_type
    if mask_type in ("padding", "padding_causal") and attention_mask is None and segment_ids is None:
      mask_type = "no_mask" if mask_type == "padding" else "causal"
    attn = self.self_attention
    decode = attn.decode if decode is None else decode
    if decode:  # checked here, before the relative biases read the cache
      require_cache(attn.cache_index is not None)
      batch_first = (inputs.shape[1], inputs.shape[0]) if self.transpose_batch_sequence else inputs.shape[:2]
      check_fits_cache(attn.cached_key.shape, (*batch_first, attn.kv_heads, attn.head_dim), "inputs")
    x = inputs
    bias = self._relative_bias(x, decode) if self.enable_relative_embedding else None
    kw = dict(segment_ids=segment_ids, positions=positions, deterministic=deterministic, attn_mask_type=mask_type,
              decode=decode)
    x = self._residual_block(lambda r: attn(x, None, attention_mask, bias, residual=r, **kw), x, deterministic)
    if self.output_layernorm:
      x = self.self_attention_layernorm(x)
    if encoded is not None:
      cross = self.encoder_decoder_attention
      cross_type = "padding" if encoder_decoder_mask is not None else "no_mask"
      x = self._residual_block(lambda r: cross(x, encoded, encoder_decoder_mask, deterministic=deterministic,
                                               residual=r, attn_mask_type=cross_type), x, deterministic)
      if self.output_layernorm:
        x = self.encoder_decoder_attention_layernorm(x)
    if self.output_layernorm:
      x = self._dropout_add(self._plain_mlp(x, deterministic), x, deterministic)
      return self.mlp_layernorm(x)
    return self._residual_block(lambda r: self.mlp(x, deterministic=deterministic, residual=r), x, deterministic)
