"""What one forward pass of the real target and draft costs at T new tokens.

    python -m bench.tools.forward_cost [--target-t 1,2,5,9] [--draft-t 1,2] [--reps 8]
                                       [--layouts cols,packed] [--draft-int8]
    python -m bench.tools.forward_cost --paired packed,cols [--target-t 1] [--reps 30]

Loads the real pair's checkpoints one model at a time, jits `model.forward`
on a cache of 512 slots holding 200 tokens, and prints the median ms per
call for each T and storage. A layout is a `jspec.Settings`: "packed"
stores the float matrices in panels for jspec's CPU kernels (kernels=True,
what `jspec.load` does on CPU where they build), "cols" as plain [in, out]
matrices for XLA's dot (kernels=False, what runs without them). These are
the numbers behind the cost of a speculative round (gamma draft steps + one
verify of gamma + 1) and behind the storage choice (docs/decisions.md,
"Kernels", "Verify width"). The draft is timed with its float weights;
--draft-int8 also times it as `jspec.load` prepares it on CPU
(draft_int8=True): through XLA's int8 dot under "cols", through jspec's
int8 kernel where it runs under "packed" (docs/decisions.md, "Int8 draft").
The target is timed as a verify runs it, reading the whole float head (not
the greedy head of a target-only step, `bench.tools.head_candidates`).

The old "rows" layout ([out, in] matrices, once target-only decoding's
without the kernels) is gone: a model's storage is decided once at load,
and no call lays it out another way.

--paired holds the target in each of the given layouts at once (one more
copy of its 6.2 GB per layout) and times their T-token steps call by call,
alternating, so that a noisy shared machine slows both alike; it prints
each median and the median of the paired ratios against the first layout.
That is the comparison behind the storage choice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from bench import models
from jspec import cache as cache_lib
from jspec import model

PAIR = "qwen2.5-coder"
# Each layout as load settings. Forwards here never take the greedy head, so
# the target is prepared without one.
LAYOUTS = {"cols": jspec.Settings(kernels=False, greedy_head=False),
           "packed": jspec.Settings(kernels=True, greedy_head=False)}


def _median_ms(m: jspec.Model, t: int, reps: int) -> float:
  """Median ms of one forward of T new tokens after 200 cached ones."""
  cache = cache_lib.with_lengths(cache_lib.init(m.cfg, 1, 512, m.backend.dtype),
                                 jnp.array([200], jnp.int32))
  step = jax.jit(lambda p, x, c: model.forward(m.arch, p, x, c))
  tokens = jnp.ones((1, t), jnp.int32)
  jax.block_until_ready(step(m.params, tokens, cache))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(m.params, tokens, cache))
    times.append(time.perf_counter() - t0)
  return 1000 * float(np.median(times))


def _paired(kinds: list, ts: list, reps: int) -> dict:
  """Times the target's steps in several layouts, alternating call by call.

  Args:
    kinds: layouts to compare; ratios are against the first.
    ts: new-token counts T to measure.
    reps: calls per layout and T.

  Returns:
    {T: {"ms": {layout: median ms}, "ratio": {layout: median of paired
    ratios to kinds[0]}}}.
  """
  path = models.checkpoint_files(PAIR)[0]
  copies = [models.prepare_checkpoint(path, "target", LAYOUTS[kind]) for kind in kinds]
  cfg = copies[0].cfg
  steps = [jax.jit(lambda p, x, c, arch=m.arch: model.forward(arch, p, x, c)) for m in copies]
  caches = [cache_lib.with_lengths(cache_lib.init(cfg, 1, 512, m.backend.dtype),
                                   jnp.array([200], jnp.int32)) for m in copies]
  out = {}
  for t in ts:
    tokens = jnp.ones((1, t), jnp.int32)
    for m, step, cache in zip(copies, steps, caches):
      jax.block_until_ready(step(m.params, tokens, cache))
    times = np.zeros((reps, len(kinds)))
    for r in range(reps):
      order = range(len(kinds)) if r % 2 == 0 else reversed(range(len(kinds)))
      for i in order:
        t0 = time.perf_counter()
        jax.block_until_ready(steps[i](copies[i].params, tokens, caches[i]))
        times[r, i] = time.perf_counter() - t0
    out[t] = {"ms": {k: 1000 * float(np.median(times[:, i])) for i, k in enumerate(kinds)},
              "ratio": {k: float(np.median(times[:, i] / times[:, 0]))
                        for i, k in enumerate(kinds)}}
    print(f"target T={t}: " + ", ".join(
        f"{k} {out[t]['ms'][k]:.1f} ms ({out[t]['ratio'][k]:.3f}x {kinds[0]})" for k in kinds),
          flush=True)
  return out


def _costs(name: str, m: jspec.Model, ts: str, reps: int) -> dict:
  """{T: median ms} of one prepared model, printed as measured."""
  costs = {}
  for t in (int(x) for x in ts.split(",")):
    costs[t] = _median_ms(m, t, reps)
    print(f"{name} T={t}: {costs[t]:.1f} ms", flush=True)
  return costs


def main(argv=None) -> int:
  """Measures and prints the costs (text, then one JSON line).

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    Exit status 0.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.forward_cost",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target-t", default="1,2,5,9")
  parser.add_argument("--draft-t", default="1,2")
  parser.add_argument("--reps", type=int, default=8)
  parser.add_argument("--layouts", default="cols",
                      help=f"comma-separated: {', '.join(LAYOUTS)} (default cols)")
  parser.add_argument("--draft-int8", action="store_true",
                      help="also time the draft in int8 (after each layout's float draft)")
  parser.add_argument("--paired", default=None,
                      help="comma-separated layouts: time the target's steps in each, "
                           "alternating call by call (instead of the passes above)")
  args = parser.parse_args(argv)
  kinds = (args.paired or args.layouts).split(",")
  for kind in kinds:
    if kind not in LAYOUTS:
      flag = "--paired" if args.paired else "--layouts"
      parser.error(f"{flag}: unknown layout {kind!r}: expected a comma-separated subset of "
                   f"{','.join(LAYOUTS)}")
  if args.paired:
    print(json.dumps(_paired(kinds, [int(x) for x in args.target_t.split(",")], args.reps)))
    return 0
  t_path, d_path = models.checkpoint_files(PAIR)
  out = {}
  for kind in kinds:
    settings = dataclasses.replace(LAYOUTS[kind], draft_int8=False)
    for name, path, ts in (("target", t_path, args.target_t), ("draft", d_path, args.draft_t)):
      m = models.prepare_checkpoint(path, name, settings)  # one model held at a time
      key = name if kind == "cols" else f"{name}_{kind}"
      # One entry per pass: a layout may repeat.
      out.setdefault(key, []).append(_costs(f"{name} ({kind})", m, ts, args.reps))
      del m
    if args.draft_int8:
      m = models.prepare_checkpoint(d_path, "draft", dataclasses.replace(settings, draft_int8=True))
      form = "int8" if kind == "cols" else f"int8_{kind}"
      out.setdefault(f"draft_{form}", []).append(_costs(f"draft ({form})", m, args.draft_t,
                                                        args.reps))
      del m
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
