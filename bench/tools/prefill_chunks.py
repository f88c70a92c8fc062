"""`python -m bench.tools.prefill_chunks`: a chunked prefill against one forward over the padded prompt.

Times the target's prefill of prompts of several lengths on random weights
of a model's real shapes, prepared as `jspec.load` would on this host (or,
with --weights real, on the default pair's own model as `jspec.load` holds
it: the exact int8-block target on CPU):
`decode.encode` in chunks of each size given (one program per buffer
width), and the way before it (one fresh forward over the prompt padded to
an eighth of its power-of-two bucket, a program per such width),
alternated, medians of the repetitions. The decision it informs is in
docs/decisions.md, "Chunked prefill".
"""

from __future__ import annotations

import argparse
import functools
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
  parser.add_argument("--weights", default="random", choices=("random", "real"),
                      help="random weights of the real shapes, float32 (default), or the default "
                      "pair's model as jspec.load holds it")
  args = parser.parse_args(argv)
  if args.weights == "real":
    m = getattr(jspec.load(progress=False), args.model)
    cfg = m.cfg
  else:
    cfg = shapes.KNOWN["qwen2.5-coder"][0 if args.model == "target" else 1]
    params = model.init_params(cfg, jax.random.key(0))
    m = bundle_lib.prepare(cfg, params, "target", jspec.Settings(), consume=True)
  for n in [int(x) for x in args.lengths.split(",")]:
    ids = np.random.RandomState(n).randint(0, cfg.vocab_size, size=(1, n)).astype(np.int32)
    p_width, width = api.widths(n, 128, 8)  # as `api.request` pads a prompt
    ways = {}
    for chunk in [int(x) for x in args.chunks.split(",")]:
      prompt = jnp.asarray(np.pad(ids, ((0, 0), (0, p_width - n))))
      ways[f"chunk{chunk}"] = (jax.jit(lambda w, p, c=chunk: decode.encode(
          functools.partial(model.forward, m.arch, w), cache_lib.init(cfg, 1, width), p,
          jnp.asarray([n]), c, head=functools.partial(model.logits, m.arch, w))[0]), prompt)
    old = _old_width(n)
    prompt = jnp.asarray(np.pad(ids, ((0, 0), (0, old - n))))
    ways["one_forward"] = (jax.jit(lambda w, p: decode.encode(
        functools.partial(model.forward, m.arch, w), cache_lib.init(cfg, 1, width), p,
        jnp.asarray([n]), old, head=functools.partial(model.logits, m.arch, w))[0]), prompt)
    times = {name: [] for name in ways}
    logits = {}
    for name, (fn, prompt) in ways.items():  # compile and warm up
      logits[name] = np.asarray(jax.block_until_ready(fn(m.params, prompt)))
    for _ in range(args.reps):
      for name, (fn, prompt) in ways.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(m.params, prompt))
        times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({"model": args.model, "weights": args.weights, "prompt_tokens": n, "one_forward_width": old,
                      "median_s": medians,
                      "vs_one_forward": {k: v / medians["one_forward"] for k, v in medians.items()},
                      "max_abs_logit_diff_vs_one_forward": {
                          k: float(np.max(np.abs(v - logits["one_forward"])))
                          for k, v in logits.items()},
                      "same_argmax": {k: bool(np.array_equal(v.argmax(-1),
                                                             logits["one_forward"].argmax(-1)))
                                      for k, v in logits.items()},
                      "reps": args.reps}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
