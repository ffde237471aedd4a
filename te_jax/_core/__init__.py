"""Infrastructure under every other layer: loading the native extension modules, ``autocast``, the FP8 scaling
math, how an op becomes a JAX primitive, the shard_map helpers, and the one module that uses private JAX APIs."""
