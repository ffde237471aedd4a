"""The framework-neutral bodies of te_jax's modules: each module's options, parameter declarations, shape checks,
math and sharding, written once against a ``Scope`` (``te_jax.modules.scope``) that ``te_jax.flax`` (linen) and
``te_jax.nnx`` (NNX) implement with their framework's variables, so that their modules are thin wrappers."""
