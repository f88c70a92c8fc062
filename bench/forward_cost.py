"""What one forward pass of the real target and draft costs at T new tokens.

    python -m bench.forward_cost [--target-t 1,2,5,9] [--draft-t 1,2] [--reps 8]
                                 [--layouts cols,rows,packed] [--draft-int8]
    python -m bench.forward_cost --paired packed,rows [--target-t 1] [--reps 30]

Loads the real pair, jits `model.forward` on a cache of 512 slots holding 200
tokens, and prints the median ms per call for each T and weight layout
(`jspec.layout`: "packed", panels for jspec's CPU kernel, what everything
uses on CPU when the kernel builds; without it "cols" [in, out], what
verifies use, and "rows" [out, in], what target-only decoding of one prompt
uses): the numbers behind the cost of a
speculative round (gamma draft steps + one verify of gamma + 1) and behind
the layout choice. --draft-int8 also measures the draft's int8 copy
(`jspec.quant`, what `generate` drafts with on CPU), through XLA's int8 dot
and, where it runs, through jspec's int8 kernel (`quant.pack`, what
`generate` uses then).

--paired holds the target in each of the given layouts at once (one more
copy of its 6.2 GB per layout) and times their T-token steps call by call,
alternating, so that a noisy shared machine slows both alike; it prints
each median and the median of the paired ratios against the first layout.
That is the comparison behind the layout choice.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import layout
from jspec import model
from jspec import quant


def _median_ms(params, cfg, t: int, reps: int) -> float:
  cache = cache_lib.with_lengths(cache_lib.init(cfg, 1, 512), jnp.array([200], jnp.int32))
  step = jax.jit(lambda p, x, c: model.forward(p, cfg, x, c))
  tokens = jnp.ones((1, t), jnp.int32)
  jax.block_until_ready(step(params, tokens, cache))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, tokens, cache))
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
  copies = []
  for kind in kinds:  # a fresh load per layout: `layout.convert` works in place
    target = jspec.load("qwen2.5-coder", progress=False).target
    copies.append(layout.convert(target.params, kind))
  cfg = target.cfg
  cache = cache_lib.with_lengths(cache_lib.init(cfg, 1, 512), jnp.array([200], jnp.int32))
  step = jax.jit(lambda p, x, c: model.forward(p, cfg, x, c))
  out = {}
  for t in ts:
    tokens = jnp.ones((1, t), jnp.int32)
    for params in copies:
      jax.block_until_ready(step(params, tokens, cache))
    times = np.zeros((reps, len(kinds)))
    for r in range(reps):
      order = range(len(kinds)) if r % 2 == 0 else reversed(range(len(kinds)))
      for i in order:
        t0 = time.perf_counter()
        jax.block_until_ready(step(copies[i], tokens, cache))
        times[r, i] = time.perf_counter() - t0
    out[t] = {"ms": {k: 1000 * float(np.median(times[:, i])) for i, k in enumerate(kinds)},
              "ratio": {k: float(np.median(times[:, i] / times[:, 0]))
                        for i, k in enumerate(kinds)}}
    print(f"target T={t}: " + ", ".join(
        f"{k} {out[t]['ms'][k]:.1f} ms ({out[t]['ratio'][k]:.3f}x {kinds[0]})" for k in kinds),
          flush=True)
  return out


def main(argv=None) -> int:
  """Measures and prints the costs (text, then one JSON line).

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    Exit status 0.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.forward_cost", description=__doc__)
  parser.add_argument("--target-t", default="1,2,5,9")
  parser.add_argument("--draft-t", default="1,2")
  parser.add_argument("--reps", type=int, default=8)
  parser.add_argument("--layouts", default="cols", help="comma-separated: cols, rows, packed")
  parser.add_argument("--draft-int8", action="store_true",
                      help="also measure the draft's int8 copy (after each layout pass)")
  parser.add_argument("--paired", default=None,
                      help="comma-separated layouts: time the target's steps in each, "
                           "alternating call by call (instead of the passes above)")
  args = parser.parse_args(argv)
  kinds = (args.paired or args.layouts).split(",")
  for kind in kinds:
    if kind not in layout.LAYOUTS:
      flag = "--paired" if args.paired else "--layouts"
      parser.error(f"{flag}: unknown layout {kind!r}: expected a comma-separated subset of "
                   f"{','.join(layout.LAYOUTS)}")
  if args.paired:
    print(json.dumps(_paired(kinds, [int(x) for x in args.target_t.split(",")], args.reps)))
    return 0
  bundle = jspec.load("qwen2.5-coder", progress=False)
  out = {}
  for name, m, ts in (("target", bundle.target, args.target_t), ("draft", bundle.draft, args.draft_t)):
    for kind in kinds:
      m.params = layout.convert(m.params, kind)
      key = name if kind == "cols" else f"{name}_{kind}"
      costs = {}
      for t in (int(x) for x in ts.split(",")):
        costs[t] = _median_ms(m.params, m.cfg, t, args.reps)
        print(f"{name} ({kind}) T={t}: {costs[t]:.1f} ms", flush=True)
      out.setdefault(key, []).append(costs)  # one entry per pass: a layout may repeat
      if name == "draft" and args.draft_int8:
        int8 = quant.quantize(m.params)
        # XLA's int8 dot, then jspec's int8 kernel where it runs (what generate uses).
        forms = [("int8", int8)]
        if cpu_kernels.int8_available():
          forms.append(("int8_packed", quant.pack(quant.quantize(m.params))))
        for form, params in forms:
          costs = {}
          for t in (int(x) for x in ts.split(",")):
            costs[t] = _median_ms(params, m.cfg, t, args.reps)
            print(f"draft ({form}) T={t}: {costs[t]:.1f} ms", flush=True)
          out.setdefault(f"draft_{form}", []).append(costs)
        del int8, forms, params
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
