"""Is the one-row block kernel bound by memory or by its own instructions? The same calls, read from memory and from cache.

    python -m bench.tools.kernel_rate [--dims 1536,8960] [--cached-outputs 4096] [--reps 15]
        [--forms 4bit,int8,q4k,q4k_float] [--rows 1] [--any-order]

A decode step multiplies one row by every weight once, so its kernels
should read at the memory bandwidth. The exact target's 4-bit matrices
(gate and up, Q4_K two q to a byte) read at less. This times one row
through chains of one-row `weights.dot` calls of one stored form in one
process, alternated rep by rep. The forms:

  4bit        q two to a byte with a float32 scale and offset per 32
              (`weights.to_int4_blocks`);
  int8        q a byte each with a scale per 32 (`weights.to_int8_blocks`);
  q4k         Q4_K's numbers as a GGUF file defines them (a float16 d and
              dmin per 256, 6-bit sc and m per 32), stored as jspec stores
              them: q two to a byte, the scales factored
              (`cpu_kernels.pack_factored`);
  q4k_float   the same numbers with float32 scales and offsets;
  q6k         Q6_K's numbers (a float16 d per 256, an int8 sc per 16, q in
              [-32, 31]) as jspec stores them: a byte per q, the scales
              factored;
  bf16        the weights rounded to bfloat16, as a bfloat16 checkpoint's
              are stored (`weights.to_bf16_panels`).

The chains:

  stream  --layers distinct [D, F] matrices (the real layer's shape), one
          call each: every weight comes from memory, as in a decode step;
  cached  one [D, --cached-outputs] matrix small enough for the two cores'
          caches, called --calls times: the weights come from cache, so the
          rate is the kernel's own (its instructions), plus a call's fixed
          cost, which weighs on narrow calls: hence 4096 outputs by default
          (docs/decisions-compact.md, "The Zen 5 host").

For each it prints the median ms per call, weights per ns and GB/s of
weight bytes (q, scales, offsets). Where stream's weights/ns is well below
cached's, memory bounds the call; where they are close, the kernel's own
instructions do, and a faster memory would not help.

--rows times calls of several rows too (a verify, a batch's step, a prefill
chunk), under "FORM@M" for M rows (M = 1 keeps "FORM"); there
"macs_per_ns" (rows x weights per ns) is the rate to hold against the
host's multiply-add rate (`bench.tools.serve_bound`). --any-order times
each chain a second time as a prefill's products ("FORM@M/any_order":
`cpu_kernels.any_order`, AMX tiles from a few rows on where they run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import cpu_kernels
from jspec import weights



def _q4k(w: weights.Dense, factored: bool) -> weights.Leaf:
  """Random Q4_K numbers of w's shape: d * sc * q - dmin * m, per 32 of a super-block of 256."""
  i, o = w.shape
  rng = np.random.default_rng(i * 7 + o)
  q = rng.integers(0, 16, (o, i), dtype=np.int8)
  d, dmin = (rng.uniform(1e-4, 1e-3, (o, i // 256)).astype(np.float16).astype(np.float32)
             for _ in range(2))
  sc, m = (rng.integers(0, 64, (o, i // 32)).astype(np.float32) for _ in range(2))
  scale = np.repeat(d, 8, axis=1) * sc
  offset = -(np.repeat(dmin, 8, axis=1) * m)
  return weights.blocks(q, scale, offset, factored=factored)


def _q6k(w: weights.Dense) -> weights.Leaf:
  """Random Q6_K numbers of w's shape: d * sc * q, q in [-32, 31], a float16 d per 256, an int8 sc per 16."""
  i, o = w.shape
  rng = np.random.default_rng(i * 11 + o)
  q = rng.integers(-32, 32, (o, i), dtype=np.int8)
  d = rng.uniform(1e-4, 1e-3, (o, i // 256)).astype(np.float16).astype(np.float32)
  sc = rng.integers(-128, 128, (o, i // 16)).astype(np.float32)
  return weights.blocks(q, np.repeat(d, 16, axis=1) * sc, factored=True)


FORMS = {"4bit": weights.to_int4_blocks, "int8": weights.to_int8_blocks,
         "q4k": lambda w: _q4k(w, True), "q4k_float": lambda w: _q4k(w, False), "q6k": _q6k,
         "bf16": lambda w: weights.to_bf16_panels(weights.Dense(w.w.astype(jnp.bfloat16)))}


def _chain(ws: list, reps_per_matrix: int, d: int, any_order: bool = False):
  """A jitted chain: x [M, D] through each matrix of ws in turn, reps_per_matrix times.

  With any_order, traced under `cpu_kernels.any_order` (a prefill's products).
  """
  def run(x, ws):
    with cpu_kernels.any_order() if any_order else contextlib.nullcontext():
      for w in ws:
        for _ in range(reps_per_matrix):
          y = weights.dot(x, w)  # [M, F]
          x = x + 1e-3 * jnp.resize(y, x.shape)  # the next call depends on this one
    return x

  return jax.jit(run)


def _name(form: str, m: int, any_order: bool = False) -> str:
  """The results' key of FORM at M rows (with "/any_order" for `cpu_kernels.any_order`)."""
  return (form if m == 1 else f"{form}@{m}") + ("/any_order" if any_order else "")


def measure(d: int, f: int, layers: int, cached_outputs: int, calls: int, reps: int,
            forms: Sequence[str] = tuple(FORMS), seed: int = 0,
            rows: Sequence[int] = (1,), any_order: bool = False) -> dict:
  """Times stream and cached chains of each form at each row count, alternated.

  Args:
    d, f: the streamed matrices' inputs and outputs.
    layers: how many distinct streamed matrices.
    cached_outputs: outputs of the one cached matrix (D inputs).
    calls: calls of the cached matrix per chain.
    reps: alternated timings of each chain.
    forms: which of `FORMS`.
    seed: of the random weights.
    rows: rows of x per call (M).
    any_order: also time each chain traced under `cpu_kernels.any_order`
      (a prefill's products: AMX tiles where they run), as "NAME/any_order".

  Returns:
    {name: {"stream": {...}, "cached": {...}}} with name the form at one
    row, "form@M" at M rows; each with "ms_per_call", "weights_per_ns",
    "macs_per_ns" (M x weights_per_ns), "gbs", "bytes_per_call", and per
    name "rows" and "stream_over_cached" (the ratio of their weights/ns).
  """
  rng = np.random.default_rng(seed)
  matrix = lambda o: weights.Dense(jnp.asarray(rng.standard_normal((d, o), np.float32) * 0.02))
  runs = {}
  for form in forms:
    stream_ws = [FORMS[form](matrix(f)) for _ in range(layers)]
    cached_ws = [FORMS[form](matrix(cached_outputs))]
    for m in rows:
      for tiles in (False, True) if any_order else (False,):
        name = _name(form, m, tiles)
        runs[(name, "stream")] = (_chain(stream_ws, 1, d, tiles), stream_ws, layers, d * f, m)
        runs[(name, "cached")] = (_chain(cached_ws, calls, d, tiles), cached_ws, calls,
                                  d * cached_outputs, m)
  xs = {m: jnp.ones((m, d), jnp.float32) for m in rows}
  for fn, ws, _, _, m in runs.values():
    jax.block_until_ready(fn(xs[m], ws))
  times: dict = {key: [] for key in runs}
  for r in range(reps):
    for key in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
      fn, ws, _, _, m = runs[key]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(xs[m], ws))
      times[key].append(time.perf_counter() - t0)
  out: dict = {}
  for (name, kind), (_, ws, n_calls, n_weights, m) in runs.items():
    per_call = float(np.median(times[(name, kind)])) / n_calls
    nbytes = weights.nbytes(ws[0])
    out.setdefault(name, {"rows": m})[kind] = {
        "ms_per_call": 1000 * per_call, "weights_per_ns": n_weights / per_call / 1e9,
        "macs_per_ns": m * n_weights / per_call / 1e9, "gbs": nbytes / per_call / 1e9,
        "bytes_per_call": nbytes}
  for record in out.values():
    record["stream_over_cached"] = (record["stream"]["weights_per_ns"]
                                    / record["cached"]["weights_per_ns"])
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Measures and prints one JSON object (see the module docstring).

  Args:
    argv: command-line arguments.

  Returns:
    0.
  """
  ap = argparse.ArgumentParser(prog="python -m bench.tools.kernel_rate",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--dims", default="1536,8960", help="D,F of the streamed matrices (gate's)")
  ap.add_argument("--layers", type=int, default=28)
  ap.add_argument("--cached-outputs", type=int, default=4096)
  ap.add_argument("--calls", type=int, default=100)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--forms", default=",".join(FORMS), help=f"some of {','.join(FORMS)}")
  ap.add_argument("--rows", default="1", help="rows per call, comma-separated (default 1)")
  ap.add_argument("--any-order", action="store_true",
                  help="also time every chain as a prefill's products (cpu_kernels.any_order)")
  args = ap.parse_args(argv)
  forms = tuple(v for v in args.forms.split(",") if v)
  if not forms or any(v not in FORMS for v in forms):
    ap.error(f"--forms {args.forms!r}: expected some of {','.join(FORMS)}")
  try:
    rows = tuple(int(v) for v in args.rows.split(","))
  except ValueError:
    rows = ()
  if not rows or min(rows) < 1 or len(set(rows)) != len(rows):
    ap.error(f"--rows {args.rows!r}: expected distinct positive integers, comma-separated")
  try:
    d, f = (int(v) for v in args.dims.split(","))
  except ValueError:
    ap.error(f"--dims {args.dims!r}: expected two comma-separated integers, D,F")
  if min(d, f, args.layers, args.cached_outputs, args.calls, args.reps) < 1 or any(
      v % 32 for v in (d, f, args.cached_outputs)):
    ap.error("every count must be at least 1, and D, F and --cached-outputs multiples of 32")
  if any(v.startswith(("q4k", "q6k")) for v in forms) and d % 256:
    ap.error("the q4k and q6k forms need D a multiple of 256")
  print(json.dumps(measure(d, f, args.layers, args.cached_outputs, args.calls, args.reps,
                           forms, rows=rows, any_order=args.any_order)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
