"""Two source trees of te_jax side by side: bit for bit the same training, and their speeds.

For a change that must not move any number (a refactor), run with the tree before it and the tree after it:

  pip install --no-deps --no-build-isolation --target build/ab/base_site <tree before>   # each tree installed
  pip install --no-deps --no-build-isolation --target build/ab/new_site .                 # into a directory
  python benchmarks/ab.py compare --base build/ab/base_site --new build/ab/new_site [--rounds 2]

Each tree runs in processes of its own, which import ``te_jax`` from its directory (``PYTHONPATH``, with an editable
install's import redirection removed, so that neither is the one installed in the environment). ``bits`` trains a few
te_jax modules five steps under each per-tensor recipe (delayed scaling, with a calibration pass first; current scaling; E4M3 delayed scaling with fast
accumulation) and records every output, loss, gradient (parameters and FP8 state) and the variables after the last
step; the two records must be equal bit for bit. The base tree's final variables are also saved with
``flax.serialization`` and the new tree restores them and applies its module to them: a checkpoint written before
the change loads after it and computes the same output. ``speed`` times the layers' training step (``jax.vjp`` of
``apply``, as ``bench_dense``, ``bench_layernorm_mlp`` and ``bench_transformer`` do; for ``te_jax.compare``'s LM,
its loss and gradients) in the trees alternately, ``--rounds`` times each, and prints each case's median time per
tree and their ratio (new / base) last. It also
compares the programs XLA compiled for each case (the optimized HLO, source locations left out): where they are the
same, a gap in time is the machine's noise, not the change's.

Shapes: small on a CPU (the bits), the benchmarks' shapes on a GPU (the GPT layer of ``bench_transformer``, the
LayerNormMLP of ``bench_layernorm_mlp``, the Dense of ``bench_dense``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


# ---- the child processes: one tree's te_jax ------------------------------------------------------------------------


def _recipes():
  import dataclasses  # noqa: PLC0415

  from te_jax import recipe  # noqa: PLC0415
  fast = recipe.MMParams(use_split_accumulator=False)
  return {
      "delayed": recipe.DelayedScaling(amax_history_len=4),
      "current": recipe.Float8CurrentScaling(),
      "delayed_e4m3_fast": dataclasses.replace(recipe.DelayedScaling(amax_history_len=4, fp8_format=recipe.Format.E4M3),
                                               fp8_gemm_dgrad=fast, fp8_gemm_wgrad=fast),
  }


def _models(hidden: int, mlp: int, heads: int):
  import jax.numpy as jnp  # noqa: PLC0415

  import te_jax.flax as te_flax  # noqa: PLC0415
  return {
      "dense": te_flax.DenseGeneral(hidden, dtype=jnp.bfloat16),
      "layernorm_dense": te_flax.LayerNormDenseGeneral(mlp, dtype=jnp.bfloat16),
      "layernorm_mlp": te_flax.LayerNormMLP(intermediate_dim=mlp, activation_type=("gelu",), dtype=jnp.bfloat16),
      "layernorm_mlp_swiglu": te_flax.LayerNormMLP(intermediate_dim=mlp, activation_type=("silu", "linear"),
                                                   dtype=jnp.bfloat16),
      "transformer": te_flax.TransformerLayer(hidden_size=hidden, intermediate_dim=mlp, num_attention_heads=heads,
                                              layer_type="decoder", activation_type=("gelu",), dtype=jnp.bfloat16),
  }


def _apply_kw(name: str) -> dict:
  return {"deterministic": True} if name == "transformer" else {}


def bits(out: pathlib.Path, load: pathlib.Path | None) -> None:
  """Trains every model five steps under every recipe; writes ``out``/bits.npz (and the checkpoints, or with
  ``load`` the outputs of this tree's modules applied to the checkpoints found there)."""
  import functools  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import serialization  # noqa: PLC0415
  from flax.training import train_state  # noqa: PLC0415

  import te_jax  # noqa: PLC0415
  import te_jax.flax as te_flax  # noqa: PLC0415

  record: dict[str, np.ndarray] = {}

  def put(prefix, tree):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      record[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)

  x = jax.random.normal(jax.random.key(0), (4, 32, 64), jnp.float32).astype(jnp.bfloat16)
  for model_name, model in _models(64, 128, 4).items():
    kw = _apply_kw(model_name)
    for recipe_name, rec in _recipes().items():
      key = f"{model_name}/{recipe_name}"
      loss = lambda variables, x: jnp.mean(jnp.square(model.apply(variables, x, **kw).astype(jnp.float32)))  # noqa: B023,E731
      with te_jax.autocast(enabled=True, recipe=rec):
        variables = model.init(jax.random.key(1), x, **kw)
        if te_jax.FP8_COLLECTION in variables:
          variables = te_flax.calibrate(loss, variables, x)
        state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))

        @jax.jit
        def step(state, x):
          value, grads = jax.value_and_grad(loss)(state.params, x)  # noqa: B023
          return state.apply_gradients(grads=grads), value, grads

        for i in range(5):
          state, value, grads = step(state, x)
          record[f"{key}/loss_{i}"] = np.asarray(value)
          put(f"{key}/grads_{i}", grads)
        put(f"{key}/final", state.params)
        apply = jax.jit(functools.partial(model.apply, **kw))
        record[f"{key}/apply"] = np.asarray(apply(state.params, x))
        ckpt = out / f"{model_name}-{recipe_name}.msgpack"
        if load is None:
          ckpt.write_bytes(serialization.to_bytes(state.params))
        else:  # the other tree's checkpoint, restored into this tree's variables
          saved = serialization.from_bytes(state.params, (load / ckpt.name).read_bytes())
          record[f"{key}/apply_loaded"] = np.asarray(apply(saved, x))
  np.savez(out / "bits.npz", **record)
  print(f"ab bits: {len(record)} arrays -> {out / 'bits.npz'}")


def _program_text(hlo: str) -> str:
  """Optimized HLO without what names the Python source (op metadata, the stack-frame tables)."""
  hlo = re.sub(r",? metadata=\{[^}]*\}", "", hlo)
  return re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*\n?", "", hlo, flags=re.M)


def _lm_case(gpu: bool):
  """The training step of ``te_jax.compare``'s LM (gpt-small on a GPU, tiny on a CPU): loss and gradients of the
  parameters and FP8 state at the preset's batch, as ``te_jax.compare`` trains it."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import te_jax  # noqa: PLC0415
  from te_jax.compare import lm  # noqa: PLC0415
  name = "gpt-small" if gpu else "tiny"
  preset = lm.PRESETS[name]
  model = lm.LM(**preset.model)
  tokens = jax.random.randint(jax.random.key(3), (preset.batch, preset.seq + 1), 0, lm.VOCAB)
  x, y = tokens[:, :-1], tokens[:, 1:]

  def lm_step(rec):
    def f(variables, x, y):
      with te_jax.autocast(enabled=True, recipe=rec):
        def loss(v):
          return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x), y).mean()
        return jax.value_and_grad(loss)(variables)
    return jax.jit(f)

  with te_jax.autocast(enabled=True, recipe=_recipes()["delayed"]):
    variables = jax.jit(model.init)(jax.random.key(0), x)
  return f"compare LM {name} ({preset.batch}, {preset.seq})", lm_step, (variables, x, jnp.asarray(y))


def speed(out: pathlib.Path, only: str = "") -> None:
  """The median ms of each case's training step (those whose name contains ``only``), as JSON in ``out``, and each
  case's compiled program (``programs.json``: their hashes; ``<case>.hlo``)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  sys.path.insert(0, str(HERE))
  import harness  # noqa: PLC0415

  gpu = jax.default_backend() == "gpu"
  shrink = 1 if gpu else 32
  cases = {  # (model, x shape, recipes)
      "GPT layer (4, 2048, 4096)": ("transformer", (4, 2048, 4096), 16384, 32),
      "LayerNormMLP (16384, 4096) -> 16384": ("layernorm_mlp", (1, 16384, 4096), 16384, 32),
      "Dense (16384, 8192) -> 8192": ("dense", (1, 16384, 8192), 8192, 32),
  }
  times, programs = {}, {}

  def record(case, ms, lowered):
    times[case] = ms
    hlo = _program_text(lowered.compile().as_text())
    programs[case] = hashlib.sha256(hlo.encode()).hexdigest()
    (out / f"{_slug(case)}.hlo").write_text(hlo)
    print(f"ab speed: {case}: {ms:.3f} ms", flush=True)

  for case, (name, shape, mlp, heads) in cases.items():
    b, s, h = shape[0], shape[1] // shrink, shape[2] // shrink
    model = _models(h if name != "dense" else mlp // shrink, mlp // shrink, max(heads // shrink, 1))[name]
    kx, kd, ki = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, (b, s, h), jnp.float32).astype(jnp.bfloat16)
    for recipe_name in ("delayed", "current"):
      if only not in f"{case} {recipe_name}":
        continue
      rec = _recipes()[recipe_name]
      fn = harness.layer_fwd_bwd(model, rec, **_apply_kw(name))
      out_shape = jax.eval_shape(lambda: model.init_with_output(ki, x, **_apply_kw(name))[0])  # noqa: B023
      dy = jax.random.normal(kd, out_shape.shape, jnp.float32).astype(jnp.bfloat16)
      variables, _ = harness.warm_layer(model, rec, fn, ki, x, dy, **_apply_kw(name))
      t = harness.time_calls(fn, variables, x, dy, runs=20 if gpu else 3, batch=5 if gpu else 1, warmup=2)
      record(f"{case} {recipe_name}", t.ms, fn.lower(variables, x, dy))
  case, lm_step, args = _lm_case(gpu)
  for recipe_name in ("delayed", "current"):
    if only not in f"{case} {recipe_name}":
      continue
    fn = lm_step(_recipes()[recipe_name])
    t = harness.time_calls(fn, *args, runs=20 if gpu else 3, batch=5 if gpu else 1, warmup=2)
    record(f"{case} {recipe_name}", t.ms, fn.lower(*args))
  (out / "speed.json").write_text(json.dumps(times))
  (out / "programs.json").write_text(json.dumps(programs))


# ---- the parent: both trees ----------------------------------------------------------------------------------------


def _child(site: pathlib.Path, *args: str) -> None:
  env = {**os.environ, "PYTHONPATH": str(site.resolve()), _SITE: str(site.resolve())}
  subprocess.run([sys.executable, str(HERE / "ab.py"), *args], env=env, check=True)


_SITE = "TE_JAX_AB_SITE"


def _use_site() -> None:
  """In a child: ``te_jax`` from its directory, not from an editable install (whose finder comes first)."""
  site = os.environ.get(_SITE)
  if site:
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_")]
    import te_jax  # noqa: PLC0415
    if not pathlib.Path(te_jax.__file__).resolve().is_relative_to(site):
      raise SystemExit(f"ab: te_jax came from {te_jax.__file__}, not from {site}")


def compare(base: pathlib.Path, new: pathlib.Path, out: pathlib.Path, rounds: int, skip_speed: bool,
            skip_bits: bool = False, only: str = "") -> int:
  dirs = {"base": out / "base", "new": out / "new"}
  for d in dirs.values():
    d.mkdir(parents=True, exist_ok=True)
  lines, ok = ([], True) if skip_bits else _compare_bits(base, new, dirs)
  if not skip_speed:
    lines += _compare_speed(base, new, dirs, rounds, only, out)
  print("\n".join(lines))
  (out / "ab.txt").write_text("\n".join(lines) + "\n")
  return 0 if ok else 1


def _compare_bits(base: pathlib.Path, new: pathlib.Path, dirs: dict) -> tuple[list[str], bool]:
  import numpy as np  # noqa: PLC0415

  _child(base, "bits", "--out", str(dirs["base"]))
  _child(new, "bits", "--out", str(dirs["new"]), "--load", str(dirs["base"]))
  a, b = np.load(dirs["base"] / "bits.npz"), np.load(dirs["new"] / "bits.npz")
  differ = [k for k in a.files if k not in b.files or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or a[k].tobytes() != b[k].tobytes()]
  missing = [k for k in b.files if k not in a.files and not k.endswith("/apply_loaded")]
  loaded = [k for k in b.files if k.endswith("/apply_loaded")]
  wrong_load = [k for k in loaded if b[k].tobytes() != a[k.replace("/apply_loaded", "/apply")].tobytes()]
  lines = [f"bits: {len(a.files)} arrays, {len(differ)} differ, {len(missing)} only in the new tree; "
           f"{len(loaded)} checkpoints of the base tree restored, {len(wrong_load)} computing another output"]
  lines += [f"  differs: {k}" for k in (differ + missing + wrong_load)[:20]]
  return lines, not (differ or missing or wrong_load)


def _compare_speed(base: pathlib.Path, new: pathlib.Path, dirs: dict, rounds: int, only: str,
                   out: pathlib.Path) -> list[str]:
  """The speed table. Its last column says whether the two trees' compiled programs are the same; where they
  differ, whether each tree's own program differs from round to round too (XLA's autotuning picks by measured
  time), and a diff of the two programs' first round goes into ``programs_diff.txt``."""
  import difflib  # noqa: PLC0415

  runs = {"base": [], "new": []}
  for r in range(rounds):
    for name, tree in (("base", base), ("new", new)):
      d = dirs[name] / f"speed_{r}"
      d.mkdir(exist_ok=True)
      _child(tree, "speed", "--out", str(d), "--only", only)
      runs[name].append(json.loads((d / "speed.json").read_text()))
  programs = {n: [json.loads((dirs[n] / f"speed_{r}" / "programs.json").read_text()) for r in range(rounds)]
              for n in dirs}
  lines = [f"| case | base ms | new ms | new / base | compiled program |  ({rounds} rounds each, alternating; "
           "medians)"]
  diffs = []
  for case in runs["base"][0]:
    ms = {n: statistics.median(r[case] for r in runs[n]) for n in runs}
    if programs["base"][0][case] == programs["new"][0][case]:
      same = "the same"
    else:
      unstable = [n for n in dirs if len({p[case] for p in programs[n]}) > 1]
      same = "differs" + (f" (and {' and '.join(unstable)} from round to round)" if unstable else "")
      slug = _slug(case)
      text = {n: (dirs[n] / "speed_0" / f"{slug}.hlo").read_text().splitlines() for n in dirs}
      diffs += [f"=== {case}"] + list(difflib.unified_diff(text["base"], text["new"], "base", "new", n=1,
                                                            lineterm=""))[:200]
    lines.append(f"| {case} | {ms['base']:.3f} | {ms['new']:.3f} | {ms['new'] / ms['base']:.4f} | {same} |")
  (out / "programs_diff.txt").write_text("\n".join(diffs) + "\n")
  return lines


def _slug(case: str) -> str:
  return re.sub(r"[^A-Za-z0-9]+", "_", case)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("compare", help="both trees: bits, checkpoints, speed")
  p.add_argument("--base", type=pathlib.Path, required=True, help="the directory the base tree is installed in")
  p.add_argument("--new", type=pathlib.Path, required=True, help="the directory the new tree is installed in")
  p.add_argument("--out", type=pathlib.Path, default=HERE.parent / "build" / "ab")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--no-speed", action="store_true")
  p.add_argument("--no-bits", action="store_true")
  p.add_argument("--only", default="", help="time only the cases whose name contains this")
  p = sub.add_parser("bits", help="this process's te_jax: the training record")
  p.add_argument("--out", type=pathlib.Path, required=True)
  p.add_argument("--load", type=pathlib.Path)
  p = sub.add_parser("speed", help="this process's te_jax: the step times")
  p.add_argument("--out", type=pathlib.Path, required=True)
  p.add_argument("--only", default="")
  args = parser.parse_args()
  _use_site()
  if args.cmd == "bits":
    bits(args.out, args.load)
    return 0
  if args.cmd == "speed":
    speed(args.out, args.only)
    return 0
  return compare(args.base, args.new, args.out, args.rounds, args.no_speed, args.no_bits, args.only)


if __name__ == "__main__":
  sys.exit(main())
