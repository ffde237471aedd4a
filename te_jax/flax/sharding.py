"""The one documented way to shard te_jax's modules: Flax logical axis rules from the mesh axes a run uses."""

from __future__ import annotations

from collections.abc import Sequence

from te_jax.flax.params import ACT, ACT_EMBED, BATCH, EMBED, HEADS, HEAD_DIM, MLP, QKV, SEQ
from te_jax.modules.axes import EXPERT

__all__ = ["logical_axis_rules"]

MeshAxes = str | tuple[str, ...] | None


def _mesh_axes(*names: str | None) -> MeshAxes:
  """The mesh axes that are given, as Flax's rules spell them: None, one name, or a tuple of names."""
  present = tuple(n for n in names if n is not None)
  return None if not present else present[0] if len(present) == 1 else present


def logical_axis_rules(*, data: str | Sequence[str] | None = None, fsdp: str | None = None,
                       tensor: str | None = None, sequence_parallel: bool = False,
                       context: str | None = None, expert: str | None = None) -> list[tuple[str, MeshAxes]]:
  """The rule table that maps te_jax's logical axis names (``te_jax.flax.LOGICAL_AXES``) to the mesh axes of a run.

  Give each kind of parallelism the name of its mesh axis (None: not sharded that way). The table is a plain list of
  ``(logical name, mesh axes)`` pairs, as ``flax.linen.logical_axis_rules`` and ``nn.logical_to_mesh_sharding``
  take it, so it can be concatenated with a MaxText-style table of a model's own names.

  - parameters: the hidden size (``embed``) over ``fsdp`` (FSDP / ZeRO-3: the weights sharded, all-gathered where
    they are used, their gradients reduce-scattered); attention heads (``heads``) and the MLP's intermediate size
    (``mlp``) over ``tensor`` (Megatron's column- then row-parallel GEMMs); the head dim, the q/k/v packing and the
    gated pair (``kv``, ``qkv``, ``act``) never sharded; a mixture-of-experts block's experts (``expert``: the leading
    dim of ``MoEBlock``'s expert kernels) over ``expert``.
  - activations: the batch over ``data``, ``fsdp`` and ``expert`` together (every device holds tokens of its own); the residual stream's sequence axis (``seq``) over
    ``tensor`` with ``sequence_parallel`` (norms, dropout and residual adds on sequence shards, gathered before the
    attention and the MLP), or over ``context``; its hidden axis (``act_embed``) never sharded.

  Modules name their axes with ``logical_axes=True`` (``MultiHeadAttention``, ``LayerNormMLP``,
  ``TransformerLayer``) or with their ``*_axes`` attributes (``DenseGeneral``, ``LayerNormDenseGeneral``).

  >>> import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, te_jax, te_jax.flax as te_flax
  >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  >>> rules = te_flax.logical_axis_rules(data="data", tensor="model", sequence_parallel=True)
  >>> rules[:3]
  [('batch', 'data'), ('seq', 'model'), ('act_embed', None)]
  >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  >>> layer = te_flax.TransformerLayer(hidden_size=64, intermediate_dim=128, num_attention_heads=4,
  ...                                  layer_type="decoder", logical_axes=True)
  >>> x = jnp.ones((4, 16, 64))
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   boxed = layer.init(jax.random.key(0), x, deterministic=True)
  ...   shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  ...   variables = jax.device_put(nn.meta.unbox(boxed), shardings)
  ...   with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
  ...     y = jax.jit(lambda v, x: layer.apply(v, x, deterministic=True))(
  ...         variables, jax.device_put(x, NamedSharding(mesh, P("data", "model"))))
  >>> shardings["params"]["mlp"]["wi_kernel"].spec, y.sharding.spec
  (P(None, None, 'model'), P('data', 'model'))

  Args:
    data: the data-parallel mesh axis (or axes).
    fsdp: the mesh axis that shards the parameters (and the batch).
    tensor: the tensor-parallel mesh axis.
    sequence_parallel: shard the residual stream's sequence over ``tensor`` as well.
    context: the context-parallel mesh axis (the sequence sharded through the attention too; give the attention
      layers the same axis as ``context_parallel=`` so that they exchange keys and values between the shards).
    expert: the mesh axis that shards the experts of ``MoEBlock`` (expert parallelism's weights; the batch too).

  Returns:
    A list of ``(logical axis name, mesh axes)`` with one entry per name of ``LOGICAL_AXES``.

  Raises:
    ValueError: a mesh axis named twice, ``sequence_parallel`` without ``tensor``, or with ``context``.
  """
  data_axes = (data,) if data is None or isinstance(data, str) else tuple(data)
  named = [a for a in (*data_axes, fsdp, tensor, context, expert) if a is not None]
  for a in named:
    if not isinstance(a, str) or not a:
      raise ValueError(f"mesh axis names must be non-empty strings, got {a!r}")
  if len(set(named)) != len(named):
    raise ValueError(f"each mesh axis may serve one kind of parallelism, got data={data!r}, fsdp={fsdp!r}, "
                     f"tensor={tensor!r}, context={context!r}, expert={expert!r}")
  if sequence_parallel and tensor is None:
    raise ValueError("sequence_parallel=True shards the sequence over the tensor-parallel axis: give tensor=")
  if sequence_parallel and context is not None:
    raise ValueError("sequence_parallel=True and context= both shard the sequence; give one of them")
  rules = [
      (BATCH, _mesh_axes(*data_axes, fsdp, expert)),
      (SEQ, tensor if sequence_parallel else context),
      (ACT_EMBED, None),
      (EMBED, fsdp),
      (HEADS, tensor),
      (HEAD_DIM, None),
      (QKV, None),
      (MLP, tensor),
      (ACT, None),
      (EXPERT, expert),
  ]
  return rules
