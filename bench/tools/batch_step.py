"""Where an 8-row target step goes: one forward of the exact target at B rows x T tokens.

    python -m bench.tools.batch_step [--reps 7] [--filled 150]

Loads the default pair's target (as `jspec.load` prepares it on CPU) and
times, alternating call by call, one forward on a 512-slot cache holding
`--filled` tokens per row: 1 x 1 (a target-only step), 8 x 1 (a serving
step of 8 rows), 1 x 8 (the same 8 rows of products as one row's 8
positions: what differs from 8 x 1 is attention and the cache), each
with `greedy` (the greedy head, where the target has one: a float32 head)
and without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import jspec
from jspec import cache as cache_lib
from jspec import model


def main(argv=None) -> int:
  """Times the shapes and prints medians as JSON.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0.
  """
  ap = argparse.ArgumentParser(prog="python -m bench.tools.batch_step", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--filled", type=int, default=150)
  args = ap.parse_args(argv)
  target = jspec.load(progress=False).target
  arch = model.Arch(target.cfg, target.backend)
  calls = {}
  for b, t in ((1, 1), (8, 1), (1, 8)):
    cache = cache_lib.with_lengths(cache_lib.init(target.cfg, b, 512, target.backend.dtype),
                                   jnp.full((b,), args.filled, jnp.int32))
    tokens = jnp.ones((b, t), jnp.int32)
    for greedy in (True, False):
      fn = jax.jit(lambda p, x, c, g=greedy: model.forward(arch, p, x, c, greedy=g)[0])
      compiled = fn.lower(target.params, tokens, cache).compile()
      calls[f"{b}x{t}{' greedy' if greedy else ''}"] = (
          lambda f=compiled, x=tokens, c=cache: f(target.params, x, c).block_until_ready())
  times = {name: [] for name in calls}
  for name, call in calls.items():
    call()
  for _ in range(args.reps):
    for name, call in calls.items():
      t0 = time.perf_counter()
      call()
      times[name].append(time.perf_counter() - t0)
  med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
  one = med["1x1 greedy"]
  print(json.dumps({name: {"ms": round(ms, 1), "x_one_row_step": round(ms / one, 2)}
                    for name, ms in med.items()}, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
