"""Which method serves a batch fastest: eight prompts one at a time against one batch of eight.

    python -m bench.tools.batch_methods [--rows 8] [--max-new-tokens 64] [--reps 1]
                                        [--out bench/results/batch_methods_cpu.json]

The server (`jspec serve`) gathers concurrent requests into one batch. A
speculative round verifies G + 1 positions per row, so a batch of B rows is
a target forward over B (G + 1) positions: on a CPU that is compute, not
memory, and batching may gain less with speculation than without it. This
runs the first `--rows` suite prompts on the default pair, greedy, EOS off,
in one process: each alone with the default method (what a server without
batching does), then as one batch with the default, with fixed gammas 1
and 2, and with target-only. Each configuration runs once untimed first
(compiles). Reported: total new tokens over wall seconds (prefill and
decode), the ratio to the sequential default, and whether every batch row
equals its single run token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import jspec
from bench import prompts as prompts_lib

CONFIGS = {"default": {}, "fixed_g2": {"policy": "fixed", "gamma": 2},
           "fixed_g1": {"policy": "fixed", "gamma": 1}, "target": {"method": "target"}}


def main(argv=None) -> int:
  """Runs the configurations and prints one line each.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0, or 1 if a batch row differs from its single run.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.batch_methods", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--reps", type=int, default=1)
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path("bench/results/batch_methods_cpu.json"))
  args = parser.parse_args(argv)
  if not 1 <= args.rows <= len(prompts_lib.SUITE) or args.reps < 1 or args.max_new_tokens < 1:
    parser.error(f"--rows must be 1 to {len(prompts_lib.SUITE)}, --reps and --max-new-tokens "
                 "at least 1")
  bundle = jspec.load(progress=False)
  ids = [prompts_lib.encode(p, bundle.tokenizer) for p in prompts_lib.SUITE[:args.rows]]
  kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_at_eos=False)
  result = {"command": "python -m bench.tools.batch_methods " + " ".join(argv or []),
            "date": time.strftime("%Y-%m-%d %H:%M"), "rows": args.rows,
            "prompt_tokens": [len(i) for i in ids], "configs": {}}

  def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0

  fns = {"sequential_default": lambda: [jspec.generate(bundle, i, **kw) for i in ids]}
  fns.update({f"batch_{name}": (lambda c=c: jspec.generate(bundle, ids, **kw, **c))
              for name, c in CONFIGS.items()})
  singles = None
  for name, fn in fns.items():
    fn()  # compiles
    walls, outs = [], None
    for _ in range(args.reps):
      outs, wall = timed(fn)
      walls.append(wall)
    tokens = [o.token_ids for o in outs]
    singles = singles or tokens
    new = sum(len(t) for t in tokens)
    rec = {"wall_s": statistics.median(walls), "new_tokens": new,
           "tokens_per_s": new / statistics.median(walls), "same_as_single": tokens == singles,
           "mean_tokens_per_round": statistics.mean(o.stats["mean_tokens_per_round"]
                                                    for o in outs)}
    result["configs"][name] = rec
    base = result["configs"]["sequential_default"]["tokens_per_s"]
    rec["over_sequential_default"] = rec["tokens_per_s"] / base
    print(f"{name:20s} {rec['tokens_per_s']:6.2f} tok/s  {rec['over_sequential_default']:.2f}x "
          f"sequential default; tokens/round {rec['mean_tokens_per_round']:.2f}; same tokens "
          f"{rec['same_as_single']}", flush=True)
    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, args.out)
  return 0 if all(r["same_as_single"] for r in result["configs"].values()) else 1


if __name__ == "__main__":
  raise SystemExit(main())
