"""examples/sharded_lm.py: its flags' checks, and a short FP8 run on 8 CPU devices with every kind of parallelism."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))  # as running the script does: it imports train_lm from beside it

import sharded_lm


@pytest.mark.parametrize("argv,match", [
    (["--dp", "2", "--tp", "2"], r"--dp 2 x --fsdp 1 x --tp 2 = 4 devices, but there are 8 \(jax.device_count\(\)\)"),
    (["--tp", "3"], r"--fsdp 1 x --tp 3 = 3 does not divide the 8 devices"),
    (["--cp", "2"], r"--cp 2: context parallelism is not available yet"),
    (["--dp", "8", "--sp"], r"--sp shards the sequence over the tensor-parallel axis: it needs --tp of 2 or more"),
    (["--tp", "8", "--sp", "--seq", "100"], r"--seq \(100\) must be a multiple of --tp \(with --sp\) \(8\)"),
    (["--dp", "8", "--batch", "4"], r"--batch \(4\) must be a multiple of --dp x --fsdp \(8\)"),
    (["--fp8", "--bf16"], r"not allowed with argument"),
])
def test_flags_are_checked(argv, match, capsys):
  with pytest.raises(SystemExit):
    sharded_lm.parse_args(argv)
  assert re.search(match, capsys.readouterr().err)


def test_data_parallelism_takes_the_devices_left():
  args = sharded_lm.parse_args(["--fsdp", "2", "--tp", "2", "--sp"])
  assert (args.dp, args.fsdp, args.tp, args.sp, args.fp8) == (2, 2, 2, True, True)


@pytest.mark.slow  # ~25 s on 2 cores: the compile of the sharded step, then 12 steps
def test_sharded_lm_trains_with_every_kind_of_parallelism():
  """dp2 x fsdp2 x tp2 + sequence parallelism under FP8 (delayed scaling) on 8 CPU devices: the loss falls from
  about ln(256) (uniform over bytes) and stays finite; so does the held-out loss."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  run = subprocess.run([sys.executable, str(EXAMPLES / "sharded_lm.py"), "--dp", "2", "--fsdp", "2", "--tp", "2",
                        "--sp", "--fp8", "--steps", "12", "--log-every", "4", "--seq", "64"],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "mesh dp 2 x fsdp 2 x tp 2 + sp; FP8 delayed" in run.stdout, run.stdout
  losses = [float(v) for v in re.findall(r"^step +\d+ +loss (\S+) ", run.stdout, re.MULTILINE)]
  held_out = float(re.search(r"^held-out loss (\S+)$", run.stdout, re.MULTILINE).group(1))
  assert len(losses) == 3 and all(math.isfinite(v) for v in [*losses, held_out]), run.stdout
  # Observed: 5.23, 4.52, 4.30 (means over 4 steps), held-out 4.14; the first mean starts near ln(256) = 5.55.
  assert losses[0] < math.log(256) + 0.1 and losses[2] < losses[1] < losses[0] - 0.3, losses
  assert held_out < losses[0], (held_out, losses)
