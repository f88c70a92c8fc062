"""How should the layers run on XLA CPU? A Python loop vs `lax.scan` over stacked params.

    python -m bench.tools.layer_loop [--layers 28] [--reps 5]

Times one T=1 decode step of the real target's weight matrices (random
values, Qwen2.5-Coder-1.5B shapes, fp32) both ways, inside a `while_loop`
as the decoder runs them, and reports ms/step, achieved GB/s and compile
time. Because of this measurement `jspec.model` never stacks the layers'
weights: a scan over stacked weights slices (copies) each layer's every
step. Its own loop over kernel-stored layers picks each layer's buffers in
place (`jspec.weights.pick`) instead (docs/decisions.md, "Layer loop").
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, NH, KH = 1536, 8960, 12 * 128, 2 * 128  # 1.5B: width, MLP, q width, kv width


def _layer(x, w):
  """x [1, D]; w: one layer's matrices. A T=1 step's weight reads, no attention."""
  q = x @ w["q"]
  k = x @ w["k"]
  v = x @ w["v"]
  h = x + (q + jnp.pad(k + v, ((0, 0), (0, NH - KH)))) @ w["o"]
  return h + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]


def _weights(layers: int) -> list[dict]:
  shapes = {"q": (D, NH), "k": (D, KH), "v": (D, KH), "o": (NH, D), "gate": (D, F),
            "up": (D, F), "down": (F, D)}
  key = jax.random.key(0)
  out = []
  for i in range(layers):
    ks = jax.random.split(jax.random.fold_in(key, i), len(shapes))
    out.append({n: 0.01 * jax.random.normal(k, s) for k, (n, s) in zip(ks, shapes.items())})
  return out


def _time(fn, args, steps: int, reps: int) -> tuple[float, float]:
  t0 = time.perf_counter()
  compiled = jax.jit(fn, static_argnums=2).lower(*args, steps).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) / steps)
  return float(np.median(times)), compile_s


def main(argv=None) -> int:
  """Runs both variants and prints (and returns as JSON on stdout) the figures.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    Exit status 0.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.layer_loop", description=__doc__)
  parser.add_argument("--layers", type=int, default=28)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args(argv)
  per_layer = _weights(args.layers)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
  nbytes = sum(a.nbytes for w in per_layer for a in w.values())
  x = jnp.ones((1, D), jnp.float32)

  def loop(ws, x, steps):
    def step(_, x):
      for w in ws:
        x = _layer(x, w)
      return x / jnp.linalg.norm(x)
    return jax.lax.fori_loop(0, steps, step, x)

  def scan(ws, x, steps):
    def step(_, x):
      x, _ = jax.lax.scan(lambda h, w: (_layer(h, w), None), x, ws)
      return x / jnp.linalg.norm(x)
    return jax.lax.fori_loop(0, steps, step, x)

  out = {"layers": args.layers, "weight_bytes": nbytes}
  for name, fn, ws in (("python_loop", loop, per_layer), ("scan", scan, stacked)):
    step_s, compile_s = _time(fn, (ws, x), args.steps, args.reps)
    out[name] = {"ms_per_step": 1000 * step_s, "gb_per_s": nbytes / step_s / 1e9,
                 "compile_s": compile_s}
    print(f"{name:12s} {1000 * step_s:7.1f} ms/step  {nbytes / step_s / 1e9:5.1f} GB/s  "
          f"compile {compile_s:5.1f} s", flush=True)
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
