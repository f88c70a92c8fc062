"""Two builds of jspec in the real model: decode tok/s, process by process.

    python -m bench.tools.build_ab --flags= --flags=-DJSPEC_BLK_ROW_PANELS=1
        [--prompts quicksort,lru_cache_class,sql_report] [--long-tokens N]
        [--rounds 3] [--max-new-tokens 128] [--methods target,model] [--out FILE]
    python -m bench.tools.build_ab --checkouts /tmp/wt_old,. [...]

A build is a set of compiler flags for jspec's CPU kernels (`--flags`, one
per build), or a checkout of jspec (`--checkouts`, comma-separated paths,
for example a `git worktree add /tmp/wt_old COMMIT` beside this one): each
child process then imports jspec and the bench's prompts from its checkout,
and its programs are its own (the program store keys on jspec's source).
`--long-tokens N` adds a prompt of the first N tokens of this checkout's
`docs/decisions.md`, for costs that grow with the context.

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


LONG_TEXT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "decisions.md"


def long_name(tokens: int) -> str:
  """The name of the `--long-tokens` prompt."""
  return f"long{tokens}"


def _child(prompt_names: list[str], methods: list[str], max_new_tokens: int,
           long_tokens: int = 0, long_text: str = "") -> dict:
  """One build's figures: {method: {prompt: {"tok_s": best decode tok/s, "ids": [...]}}}."""
  bundle = jspec.load(progress=False)
  by_name = {p.name: p for p in prompts_lib.SUITE}
  out: dict = {method: {} for method in methods}
  for name in prompt_names:
    if long_tokens and name == long_name(long_tokens):
      ids = list(bundle.tokenizer.encode(long_text))[:long_tokens]
    else:
      ids = prompts_lib.encode(by_name[name], bundle.tokenizer)
    for method in methods:
      kwargs = {"max_new_tokens": max_new_tokens, "method": method, "stop_at_eos": False}
      jspec.generate(bundle, ids, **kwargs)  # compile
      runs = [jspec.generate(bundle, ids, **kwargs) for _ in range(2)]
      out[method][name] = {"tok_s": max(len(r.token_ids) / r.stats["decode_s"] for r in runs),
                           "ids": list(map(int, runs[0].token_ids))}
  return out


def summarize(builds: list[str], prompt_names: list[str], methods: list[str],
              runs: list[list[dict]]) -> dict:
  """Each method's medians, paired ratios and id check over every build's runs.

  Args:
    builds: each build's flags or checkout.
    prompt_names: the prompts every run timed.
    methods: the methods every run timed.
    runs: runs[b] is build b's `_child` results, one per round, rounds in order.

  Returns:
    {"builds", "prompts", "methods": {method: {"median_tok_s": per build,
    "ratio_to_first" and "ratio_range": per build after the first, the
    median and range of its (round, prompt) ratios to the first build's,
    "ratio_by_prompt": per build after the first, {prompt: the median of
    its rounds' ratios}, "ids_equal": whether every run's ids equal the
    first's}}}.
  """
  summary: dict = {"builds": builds, "prompts": prompt_names, "methods": {}}
  for m in methods:
    per_build = [[run[m][p]["tok_s"] for run in runs[b] for p in prompt_names]
                 for b in range(len(builds))]
    ratios = [[x / y for x, y in zip(per_build[b], per_build[0])] for b in range(1, len(builds))]
    by_prompt = [{p: statistics.median(run[m][p]["tok_s"] / first[m][p]["tok_s"]
                                       for run, first in zip(runs[b], runs[0]))
                  for p in prompt_names} for b in range(1, len(builds))]
    same_ids = all(run[m][p]["ids"] == runs[0][0][m][p]["ids"]
                   for b in range(len(builds)) for run in runs[b] for p in prompt_names)
    summary["methods"][m] = {
        "median_tok_s": [statistics.median(v) for v in per_build],
        "ratio_to_first": [statistics.median(v) for v in ratios],
        "ratio_range": [[min(v), max(v)] for v in ratios],
        "ratio_by_prompt": by_prompt,
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
  parser.add_argument("--flags", action="append", default=None,
                      help="extra compiler flags of one build, as --flags=FLAGS (twice or more)")
  parser.add_argument("--checkouts", default=None,
                      help="comma-separated paths of jspec checkouts, one build each")
  parser.add_argument("--prompts", default="quicksort,lru_cache_class,sql_report")
  parser.add_argument("--long-tokens", type=int, default=0,
                      help="add a prompt of this many tokens of docs/decisions.md (0: none)")
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
  if args.long_tokens < 0:
    parser.error(f"--long-tokens: {args.long_tokens}; expected 0 or more tokens")
  if args.child:
    text = LONG_TEXT.read_text(encoding="utf-8") if args.long_tokens else ""
    names = prompt_names + ([long_name(args.long_tokens)] if args.long_tokens else [])
    result = _child(names, methods, args.max_new_tokens, args.long_tokens, text)
    with open(args.child, "w", encoding="utf-8") as f:
      json.dump(result, f)
    return 0
  if (args.flags is None) == (args.checkouts is None):
    parser.error("give the builds as --flags (twice or more) or as --checkouts, not both")
  if args.checkouts is not None:
    builds = [c for c in args.checkouts.split(",") if c]
    missing = [c for c in builds if not (pathlib.Path(c) / "jspec" / "__init__.py").is_file()]
    if missing:
      parser.error(f"--checkouts: {missing[0]} holds no jspec/__init__.py; expected a jspec "
                   "checkout")
    if len(builds) < 2:
      parser.error("--checkouts: give at least two checkouts to compare")
  else:
    builds = args.flags
    if len(builds) < 2:
      parser.error("--flags: give at least two builds to compare")
  if args.long_tokens:
    prompt_names.append(long_name(args.long_tokens))

  compiler = os.environ.get("CXX", "c++")
  runs: list[list[dict]] = [[] for _ in builds]
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      order = [(r + i) % len(builds) for i in range(len(builds))]
      for b in order:
        path = os.path.join(tmp, f"{r}_{b}.json")
        common = ["--child", path, "--prompts", args.prompts, "--methods", args.methods,
                  "--max-new-tokens", str(args.max_new_tokens),
                  "--long-tokens", str(args.long_tokens)]
        if args.checkouts is not None:
          # This file, run against the checkout's jspec and bench: both are
          # found on PYTHONPATH, the checkout's own directory first.
          root = str(pathlib.Path(builds[b]).resolve())
          env = dict(os.environ, PYTHONPATH=root)
          command = [sys.executable, str(pathlib.Path(__file__).resolve()), *common,
                     "--checkouts", args.checkouts]
          subprocess.run(command, env=env, cwd=root, check=True)
        else:
          env = dict(os.environ, CXX=f"{compiler} {builds[b]}".strip())
          command = [sys.executable, "-m", "bench.tools.build_ab", *common]
          command += [f"--flags={f}" for f in builds]
          subprocess.run(command, env=env, check=True)
        with open(path, encoding="utf-8") as f:
          runs[b].append(json.load(f))
        print(f"round {r + 1}, build {b}: " + ", ".join(
            f"{m} {statistics.median(v['tok_s'] for v in runs[b][-1][m].values()):.2f}"
            for m in methods), file=sys.stderr, flush=True)

  summary = summarize(builds, prompt_names, methods, runs)
  summary.update(rounds=args.rounds, max_new_tokens=args.max_new_tokens)
  print(json.dumps(summary, indent=1))
  if args.out:
    results.write({"summary": summary, "runs": runs}, pathlib.Path(args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
