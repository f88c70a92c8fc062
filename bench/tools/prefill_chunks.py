"""`python -m bench.tools.prefill_chunks`: a chunked prefill against one forward over the padded prompt.

Times the target's prefill of prompts of several lengths on random weights
of a model's real shapes, prepared as `jspec.load` would on this host:
`decode.encode` in chunks of each size given (one program per buffer
width), and the way before it (one fresh forward over the prompt padded to
an eighth of its power-of-two bucket, a program per such width),
alternated, medians of the repetitions. The decision it informs is in
docs/decisions.md, "Chunked prefill".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from bench import shapes
from jspec import api
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import decode
from jspec import model


def _old_width(n: int) -> int:
  """The prompt width the per-bucket prefill computed: `n` rounded up to an eighth of its bucket."""
  step = max(api.MIN_BUCKET, api.bucket(n) // 8)
  return -(-n // step) * step


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the comparison and prints a JSON line per prompt length.

  Args:
    argv: arguments without the program name (None: sys.argv[1:]).

  Returns:
    Exit status.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.prefill_chunks",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="target", choices=("target", "draft"),
                      help="the default pair's target or draft shapes (default: target)")
  parser.add_argument("--lengths", default="35,317", help="prompt lengths (default: 35,317)")
  parser.add_argument("--chunks", default="32,64,128", help="chunk sizes (default: 32,64,128)")
  parser.add_argument("--reps", type=int, default=5, help="timed repetitions (default: 5)")
  args = parser.parse_args(argv)
  cfg = shapes.KNOWN["qwen2.5-coder"][0 if args.model == "target" else 1]
  params = model.init_params(cfg, jax.random.key(0))
  m = bundle_lib.prepare(cfg, params, "target", jspec.Settings(), consume=True)
  fwd = lambda *a, **k: model.forward(m.arch, m.params, *a, **k)
  for n in [int(x) for x in args.lengths.split(",")]:
    ids = np.random.RandomState(n).randint(0, cfg.vocab_size, size=(1, n)).astype(np.int32)
    width = api.widths(n, 128, 8)[1]
    ways = {}
    for chunk in [int(x) for x in args.chunks.split(",")]:
      prompt = jnp.asarray(np.pad(ids, ((0, 0), (0, api.bucket(n) - n))))
      ways[f"chunk{chunk}"] = (jax.jit(lambda p, c=chunk: decode.encode(
          fwd, cache_lib.init(cfg, 1, width), p, jnp.asarray([n]), c)[0]), prompt)
    old = _old_width(n)
    prompt = jnp.asarray(np.pad(ids, ((0, 0), (0, old - n))))
    ways["one_forward"] = (jax.jit(lambda p: decode.encode(
        fwd, cache_lib.init(cfg, 1, width), p, jnp.asarray([n]), old)[0]), prompt)
    times = {name: [] for name in ways}
    for name, (fn, prompt) in ways.items():  # compile and warm up
      jax.block_until_ready(fn(prompt))
    for _ in range(args.reps):
      for name, (fn, prompt) in ways.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(prompt))
        times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({"model": args.model, "prompt_tokens": n, "one_forward_width": old,
                      "median_s": medians,
                      "vs_one_forward": {k: v / medians["one_forward"] for k, v in medians.items()},
                      "reps": args.reps}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
