"""BF16 against FP8, side by side: ``python -m te_jax.compare`` on the embedded byte-level LM, or
``te_jax.compare.run(model_fn, batches, ...)`` on your own Flax model. Both runs start from the same parameters and
see the same batches; the report has losses, speed, memory and per-layer FP8 health, with plots.

The top layer of te_jax: it uses ``te_jax.flax`` and everything below.
"""

from te_jax.compare.api import RECIPES as RECIPES
from te_jax.compare.api import run as run
from te_jax.compare.cli import main as main
from te_jax.compare.health import fp8_shares as fp8_shares
from te_jax.compare.lm import LM as LM
from te_jax.compare.lm import PRESETS as PRESETS
from te_jax.compare.report import PLOTS as PLOTS

__all__ = ["LM", "PLOTS", "PRESETS", "RECIPES", "fp8_shares", "main", "run"]
