"""``python -m te_jax.compare``: see ``te_jax.compare.cli``."""

from te_jax.compare.cli import console_main

if __name__ == "__main__":
  console_main()
