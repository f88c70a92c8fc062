"""jspec's block kernel on Q4_K (nibbles, factored scales) at 1 to 9 rows, for comparison with bench/proto.

    python bench/proto/jspec_rows.py [REPS]

Four distinct [1536, 71680] matrices (62 MB each, past the 32 MiB L3), one
call each per chain, the row counts alternated rep by rep; prints the median
ms per call, weights per ns and weights x rows per ns. The shape, and random Q4_K
numbers drawn alike, are those of `bench/proto/digits_q4k.cc` and
`bench/proto/ggml_matvec.sh` (docs/decisions-compact.md, "Where llama.cpp's
lead comes from on the Zen 5 host").
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.tools import kernel_rate
from jspec import weights

D, F = 1536, 71680
ROWS = (1, 2, 3, 5, 9)


def _chain():
  """x [M, D] through each matrix in turn, each call depending on the last."""
  def run(x, ws):
    for w in ws:
      y = weights.dot(x, w)  # [M, F]
      x = x + 1e-3 * y[:, :D]
    return x
  return jax.jit(run)


def main() -> None:
  reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
  ws = [kernel_rate._q4k(weights.Dense(jnp.zeros((D, F), jnp.float32)), True) for _ in range(4)]
  run = _chain()
  xs = {m: jnp.full((m, D), 0.01, jnp.float32) for m in ROWS}
  for m in ROWS:
    run(xs[m], ws).block_until_ready()  # compile
  times = {m: [] for m in ROWS}
  for _ in range(reps):
    for m in ROWS:
      t0 = time.perf_counter()
      run(xs[m], ws).block_until_ready()
      times[m].append((time.perf_counter() - t0) / len(ws))
  for m in ROWS:
    t = float(np.median(times[m]))
    print(f"jspec q4k M={m}: {t * 1e3:.2f} ms/call, {D * F / t * 1e-9:.1f} w/ns,"
          f" {m * D * F / t * 1e-9:.1f} w*rows/ns")


if __name__ == "__main__":
  main()
