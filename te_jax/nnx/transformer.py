"""NNX ``TransformerLayer``: self attention, optional cross attention and an MLP, each with dropout and a residual,
pre-LN (norms fused into the FP8 GEMMs after them) or post-LN, composed as te_jax.flax.TransformerLayer is (same
arguments, parameter tree and math). Masks follow Flax (True or nonzero = attend)
unless ``mask_convention="te"``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.modules.axes import Initializer
from te_jax.modules.transformer import TransformerLayerOptions, transformer_layer, transformer_layer_params
from te_jax.nnx.params import resolve_deterministic
from te_jax.nnx.scope import NnxKVCache, NnxScope
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
  ``out_sharding`` metadata and, under Flax's logical axis rules, shards the residual stream and the projections as
  linen's does (sequence and tensor parallelism).

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
               zero_centered_gamma: bool = False, hidden_dropout: float = 0.0, hidden_dropout_dims: Sequence[int] = (),
               drop_path: float = 0.0, attention_dropout: float = 0.0,
               intermediate_dropout: float = 0.0, intermediate_dropout_dims: Sequence[int] = (),
               dropout_rng_name: str = "dropout",
               activation_type: Sequence[str] = ("gelu",), activation_params: Mapping[str, float] | None = None,
               use_bias: bool = False,
               apply_residual_connection_post_layernorm: bool = False, post_layernorm: bool = False,
               output_layernorm: bool = False, scale_attn_logits: bool = True, softmax_type: str = "vanilla",
               enable_rotary_pos_emb: bool = False, rotary_base: float = 10000.0, rotary_percent: float = 1.0,
               rotary_interleaved: bool = False, fuse_qkv_params: bool = True,
               window_size: tuple[int, int] | None = None,
               transpose_batch_sequence: bool = False,
               kernel_init: Initializer = nnx.initializers.variance_scaling(1.0, "fan_in", "normal"),
               deterministic: bool | None = None, dtype: Any = None, param_dtype: Any = jnp.float32,
               backend: str = "auto", logical_axes: bool = False, fp8_dpa: bool | None = None,
               mask_convention: str = "flax", context_parallel: str | None = None, cp_strategy: str = "all_gather",
               cp_load_balanced: bool = True, mesh: Any = None, decode: bool = False, recipe: Recipe | None = None,
               rngs: nnx.Rngs):
    self.options = nnx.static(TransformerLayerOptions(
        hidden_size=hidden_size, intermediate_dim=intermediate_dim, num_attention_heads=num_attention_heads,
        head_dim=head_dim, num_gqa_groups=num_gqa_groups, layer_type=layer_type,
        self_attn_mask_type=self_attn_mask_type, self_attn_bias_type=self_attn_bias_type,
        enable_relative_embedding=enable_relative_embedding, relative_embedding_buckets=relative_embedding_buckets,
        relative_embedding_max_distance=relative_embedding_max_distance, norm_type=norm_type, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, hidden_dropout=hidden_dropout,
        hidden_dropout_dims=hidden_dropout_dims, drop_path=drop_path, attention_dropout=attention_dropout,
        intermediate_dropout=intermediate_dropout, intermediate_dropout_dims=intermediate_dropout_dims,
        dropout_rng_name=dropout_rng_name,
        activation_type=activation_type, activation_params=activation_params, use_bias=use_bias,
        apply_residual_connection_post_layernorm=apply_residual_connection_post_layernorm,
        post_layernorm=post_layernorm, output_layernorm=output_layernorm, scale_attn_logits=scale_attn_logits,
        softmax_type=softmax_type,
        enable_rotary_pos_emb=enable_rotary_pos_emb, rotary_base=rotary_base,
        rotary_percent=rotary_percent, rotary_interleaved=rotary_interleaved, fuse_qkv_params=fuse_qkv_params,
        window_size=window_size,
        transpose_batch_sequence=transpose_batch_sequence, kernel_init=kernel_init, dtype=dtype,
        param_dtype=param_dtype, backend=backend, logical_axes=logical_axes, fp8_dpa=fp8_dpa,
        mask_convention=mask_convention, context_parallel=context_parallel, cp_strategy=cp_strategy,
        cp_load_balanced=cp_load_balanced, mesh=mesh, recipe=recipe))
    if cross_attention and layer_type != "decoder":
      raise ValueError("cross_attention=True is a decoder's: give layer_type='decoder'")
    self.cross_attention, self.deterministic = cross_attention, deterministic
    transformer_layer_params(NnxScope(self, rngs), self.options, cross_attention, decode)

  @property
  def decode(self) -> bool:
    """Whether calls use the self attention's KV cache by default (the constructor's ``decode``)."""
    return self.self_attention.decode

  def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None) -> None:
    """Creates (or empties) the self attention's KV cache: see ``MultiHeadAttention.init_cache`` (``input_shape``:
    the inputs' shape at the full length the cache holds)."""
    self.self_attention.init_cache(input_shape, dtype)

  def __call__(self, inputs: jax.Array, encoded: jax.Array | None = None, attention_mask: jax.Array | None = None,
               encoder_decoder_mask: jax.Array | None = None, *, segment_ids=None,
               positions: jax.Array | None = None, deterministic: bool | None = None,
               decode: bool | None = None) -> jax.Array:
    """As te_jax.flax.TransformerLayer's call; ``decode`` (None: the constructor's) uses and updates the self
    attention's KV cache of ``init_cache``."""
    o = self.options
    deterministic = resolve_deterministic(self, deterministic, hidden_dropout=o.hidden_dropout, drop_path=o.drop_path,
                                          attention_dropout=o.attention_dropout,
                                          intermediate_dropout=o.intermediate_dropout)
    if (encoded is not None) != self.cross_attention:
      raise ValueError("encoded is given but the layer has no cross attention (cross_attention=False)"
                       if encoded is not None else "the layer has cross attention: pass encoded")
    decode = self.decode if decode is None else decode
    return transformer_layer(NnxScope(self), o, inputs, encoded, attention_mask, encoder_decoder_mask,
                             segment_ids=segment_ids, positions=positions, deterministic=deterministic, decode=decode,
                             cache=NnxKVCache(self.self_attention) if decode else None)
