"""Primitive families, one per file: each holds the pure-jnp reference, the primitives and their rules."""
