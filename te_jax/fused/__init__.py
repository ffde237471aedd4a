"""Differentiable ops built from several primitives (``te_jax.ops``), each a ``custom_vjp`` whose forward and
backward run FP8 GEMMs under ``te_jax.autocast``, with their delayed-scaling state passed in and returned as its
gradient: ``dense``, ``layernorm_dense``, ``layernorm_mlp``; and ``dot_product_attention`` and, over a sequence
sharded across devices, ``context_parallel_attention``. ``linear`` holds the FP8 GEMM pieces they share. The public
functions are re-exported by ``te_jax``."""
