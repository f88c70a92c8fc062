"""One block-kernel call for the MLP's gate and up projections instead of two: what it saves.

    python -m bench.tools.fuse_gate_up [--layers 28] [--dims 1536,8960] [--reps 25]

A decode step's products are bound by the bytes they read, yet the layer
matrices of the exact target read at about a quarter less than the head,
which is one call over 290 MB: each kernel call pays a start and an end
(the weight stream ramping up, the threads finishing unevenly). gate and up
read the same activations, so one call over both matrices' panels, one
after the other, halves those calls. This times one row through `--layers`
pairs of 4-bit block matrices (Q4_K's form: `weights.to_int4_blocks` of
random weights, D x F each) as two calls per layer and as one call over
the concatenated panels ("fused"), and as what the model runs: one
`jspec_gemm_blk_many` call over both matrices where they lie
(`weights.dot_many`, "many"), alternated call by call, in one process, and
checks that all give the same numbers. Prints one JSON object: the median
ms of each, GB/s of weight bytes, and the median paired ratios over
separate.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import weights


def fuse(gate: weights.Blocks, up: weights.Blocks) -> weights.Blocks:
  """gate's panels followed by up's: x @ [gate | up] in one call.

  Args:
    gate, up: `Blocks` of the same inputs, block size and storage.

  Returns:
    The `Blocks` of the concatenated matrix [D, 2F].
  """
  offset = None if gate.offset is None else jnp.concatenate([gate.offset, up.offset])
  return weights.Blocks(jnp.concatenate([gate.q, up.q]), jnp.concatenate([gate.scale, up.scale]),
                        offset)


def measure(layers: int, d: int, f: int, reps: int, seed: int = 0) -> dict:
  """Times `layers` gate/up pairs at one row, separately and fused, alternated.

  Args:
    layers: pairs of matrices (one per layer).
    d, f: the model width and the MLP width (each matrix D x F).
    reps: alternated timings of each.
    seed: of the random weights.

  Returns:
    {"separate_ms", "fused_ms", "many_ms", "separate_gbs", "fused_gbs", "many_gbs",
    "fused_over_separate", "many_over_separate" (medians of the paired ratios),
    "weight_bytes", "max_abs_diff" (of fused and of many against separate)}.
  """
  rng = np.random.default_rng(seed)

  def blocks():
    return weights.to_int4_blocks(weights.Dense(jnp.asarray(
        rng.standard_normal((d, f), np.float32) * 0.02)))

  gates = [blocks() for _ in range(layers)]
  ups = [blocks() for _ in range(layers)]
  fused = [fuse(g, u) for g, u in zip(gates, ups)]
  keep = min(d, f)

  def separate_fn(x, gates, ups):
    for g, u in zip(gates, ups):  # each layer's output feeds the next, as in a forward
      x = x + 1e-3 * (weights.dot(x, g)[:, :keep] * weights.dot(x, u)[:, :keep])
    return x

  def fused_fn(x, fused):
    for w in fused:
      h = weights.dot(x, w)
      x = x + 1e-3 * (h[:, :keep] * h[:, f:f + keep])
    return x

  def many_fn(x, gates, ups):
    for g, u in zip(gates, ups):
      gate, up = weights.dot_many(x, [g, u])
      x = x + 1e-3 * (gate[:, :keep] * up[:, :keep])
    return x

  runs = {"separate": (jax.jit(separate_fn), (gates, ups)), "fused": (jax.jit(fused_fn), (fused,)),
          "many": (jax.jit(many_fn), (gates, ups))}
  x = jnp.ones((1, d), jnp.float32)
  outs = {name: np.asarray(jax.block_until_ready(fn(x, *ws))) for name, (fn, ws) in runs.items()}
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(reps):
    for name, (fn, ws) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x, *ws))
      times[name].append(time.perf_counter() - t0)
  nbytes = sum(weights.nbytes(g) + weights.nbytes(u) for g, u in zip(gates, ups))
  got = {"weight_bytes": nbytes}
  for name in runs:
    got[f"{name}_ms"] = 1000 * float(np.median(times[name]))
    got[f"{name}_gbs"] = nbytes / float(np.median(times[name])) / 1e9
  for name in ("fused", "many"):
    got[f"{name}_over_separate"] = float(np.median(np.asarray(times[name])
                                                   / np.asarray(times["separate"])))
  got["max_abs_diff"] = max(float(np.max(np.abs(outs[name] - outs["separate"])))
                            for name in ("fused", "many"))
  return got


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Measures and prints (see the module docstring).

  Args:
    argv: command-line arguments.

  Returns:
    0.
  """
  ap = argparse.ArgumentParser(prog="python -m bench.tools.fuse_gate_up",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=28)
  ap.add_argument("--dims", default="1536,8960", help="D,F (default: the 1.5B target's)")
  ap.add_argument("--reps", type=int, default=25)
  args = ap.parse_args(argv)
  try:
    d, f = (int(v) for v in args.dims.split(","))
  except ValueError:
    ap.error(f"--dims {args.dims!r}: expected two comma-separated integers, D,F")
  if min(d, f, args.layers, args.reps) < 1 or d % 32 or f % 32:
    ap.error("--layers and --reps must be at least 1, and D and F multiples of 32")
  print(json.dumps(measure(args.layers, d, f, args.reps)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
