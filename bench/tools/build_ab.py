"""Two builds of jspec's CPU kernels in the real model: decode tok/s, process by process.

    python -m bench.tools.build_ab --flags= --flags=-DJSPEC_BLK_ROW_PANELS=1
        [--prompts quicksort,lru_cache_class,sql_report] [--rounds 3]
        [--max-new-tokens 128] [--methods target,model] [--out FILE]

A kernel change that is faster one call at a time can be slower in the
model, where the calls sit among the rest of a forward (a weight prefetch
into L2 was: docs/decisions-compact.md, "The Zen 5 host"). This runs each
build in its own process (`CXX="c++ FLAGS"`: `jspec.cpu_kernels.build`
compiles and caches a library per compiler command, so each flag set gets
its own build), loads the default pair, and times greedy generations with
each method on each prompt: one untimed (compiles), then the best of two.
The builds alternate round by round, the first one changing each round,
so a host that drifts slows both alike. The compiled programs are shared:
they call the kernels by name.

Prints, per method, each build's median decode tok/s over prompts and
rounds, the median of the per-prompt ratios against the first build
(above 1 is faster), and whether every build's token ids were the same.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

import jspec
from bench import prompts as prompts_lib
from bench import results
from jspec import options as options_lib


def _child(prompt_names: list[str], methods: list[str], max_new_tokens: int) -> dict:
  """One build's figures: {method: {prompt: {"tok_s": best decode tok/s, "ids": [...]}}}."""
  bundle = jspec.load(progress=False)
  by_name = {p.name: p for p in prompts_lib.SUITE}
  out: dict = {method: {} for method in methods}
  for name in prompt_names:
    ids = prompts_lib.encode(by_name[name], bundle.tokenizer)
    for method in methods:
      kwargs = {"max_new_tokens": max_new_tokens, "method": method, "stop_at_eos": False}
      jspec.generate(bundle, ids, **kwargs)  # compile
      runs = [jspec.generate(bundle, ids, **kwargs) for _ in range(2)]
      out[method][name] = {"tok_s": max(len(r.token_ids) / r.stats["decode_s"] for r in runs),
                           "ids": list(map(int, runs[0].token_ids))}
  return out


def summarize(flags: list[str], prompt_names: list[str], methods: list[str],
              runs: list[list[dict]]) -> dict:
  """Each method's medians, paired ratios and id check over every build's runs.

  Args:
    flags: each build's flags.
    prompt_names: the prompts every run timed.
    methods: the methods every run timed.
    runs: runs[b] is build b's `_child` results, one per round, rounds in order.

  Returns:
    {"flags", "prompts", "methods": {method: {"median_tok_s": per build,
    "ratio_to_first" and "ratio_range": per build after the first, the
    median and range of its (round, prompt) ratios to the first build's,
    "ids_equal": whether every run's ids equal the first's}}}.
  """
  summary: dict = {"flags": flags, "prompts": prompt_names, "methods": {}}
  for m in methods:
    per_build = [[run[m][p]["tok_s"] for run in runs[b] for p in prompt_names]
                 for b in range(len(flags))]
    ratios = [[x / y for x, y in zip(per_build[b], per_build[0])] for b in range(1, len(flags))]
    same_ids = all(run[m][p]["ids"] == runs[0][0][m][p]["ids"]
                   for b in range(len(flags)) for run in runs[b] for p in prompt_names)
    summary["methods"][m] = {
        "median_tok_s": [statistics.median(v) for v in per_build],
        "ratio_to_first": [statistics.median(v) for v in ratios],
        "ratio_range": [[min(v), max(v)] for v in ratios],
        "ids_equal": same_ids,
    }
  return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the A/B and prints its summary as JSON.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.build_ab", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--flags", action="append", required=True,
                      help="extra compiler flags of one build, as --flags=FLAGS (twice or more)")
  parser.add_argument("--prompts", default="quicksort,lru_cache_class,sql_report")
  parser.add_argument("--methods", default="target,model")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--out", default=None, help="also write every figure here (JSON)")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  prompt_names = [p for p in args.prompts.split(",") if p]
  methods = [m for m in args.methods.split(",") if m]
  known = {p.name for p in prompts_lib.SUITE}
  unknown = sorted(set(prompt_names) - known)
  if unknown:
    parser.error(f"--prompts: unknown prompt(s) {', '.join(unknown)}; expected names from "
                 "bench.prompts.SUITE")
  bad = sorted(set(methods) - set(options_lib.METHODS))
  if bad or not methods:
    parser.error(f"--methods: {', '.join(bad) or 'none given'}; expected some of "
                 f"{', '.join(options_lib.METHODS)}")
  if len(args.flags) < 2:
    parser.error("--flags: give at least two builds to compare")
  if args.child:
    result = _child(prompt_names, methods, args.max_new_tokens)
    with open(args.child, "w", encoding="utf-8") as f:
      json.dump(result, f)
    return 0

  compiler = os.environ.get("CXX", "c++")
  runs: list[list[dict]] = [[] for _ in args.flags]
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      order = [(r + i) % len(args.flags) for i in range(len(args.flags))]
      for b in order:
        path = os.path.join(tmp, f"{r}_{b}.json")
        env = dict(os.environ, CXX=f"{compiler} {args.flags[b]}".strip())
        command = [sys.executable, "-m", "bench.tools.build_ab", "--child", path,
                   "--prompts", args.prompts, "--methods", args.methods,
                   "--max-new-tokens", str(args.max_new_tokens)]
        command += [f"--flags={f}" for f in args.flags]
        subprocess.run(command, env=env, check=True)
        with open(path, encoding="utf-8") as f:
          runs[b].append(json.load(f))
        print(f"round {r + 1}, build {b}: " + ", ".join(
            f"{m} {statistics.median(v['tok_s'] for v in runs[b][-1][m].values()):.2f}"
            for m in methods), file=sys.stderr, flush=True)

  summary = summarize(args.flags, prompt_names, methods, runs)
  summary.update(rounds=args.rounds, max_new_tokens=args.max_new_tokens)
  print(json.dumps(summary, indent=1))
  if args.out:
    results.write({"summary": summary, "runs": runs}, pathlib.Path(args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
