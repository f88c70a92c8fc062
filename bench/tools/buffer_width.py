"""One buffer width per power of two against the per-bucket widths before it, on short and long prompts.

    python -m bench.tools.buffer_width [--prompts quicksort,edit_type_hints] [--reps 2]
                                       [--max-new-tokens 128] [--out bench/results/buffer_width.json]

`api.widths` pads the prompt to the buffer width W, the power of two at or
past prompt + new tokens + G + 2, so only W selects the programs. Before it,
the prompt was padded to its own power-of-two bucket and W was bucket(prompt)
+ bucket(new) + G + 2: every prompt bucket had its own programs, and W was
smaller. This runs both in one process on the default pair, alternating
after a warm-up of each (so compiles are excluded), greedy, EOS off, for
target-only and the default method: prefill seconds and decode tokens/s,
medians of the repetitions, and whether the tokens are identical.
docs/decisions.md, "One program for every prompt length", cites it.
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
from jspec import api


def old_widths(longest: int, max_new: int, gamma_max: int) -> tuple[int, int]:
  """The widths before: the prompt's own bucket, and W = bucket(P) + bucket(new) + G + 2."""
  p = api.bucket(longest)
  return p, p + api.bucket(max_new) + gamma_max + 2


def main(argv=None) -> int:
  """Runs the A/B and prints one line per prompt and method.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.buffer_width", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompts", default="quicksort,edit_type_hints")
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path("bench/results/buffer_width.json"))
  args = parser.parse_args(argv)
  if args.reps < 1 or args.max_new_tokens < 2:
    parser.error("--reps must be at least 1 and --max-new-tokens at least 2")
  suite = {p.name: p for p in prompts_lib.SUITE}
  names = args.prompts.split(",")
  unknown = [n for n in names if n not in suite]
  if unknown:
    parser.error(f"unknown prompts {unknown}: expected some of {sorted(suite)}")
  bundle = jspec.load(progress=False)
  new_widths = api.widths
  result = {"command": "python -m bench.tools.buffer_width " + " ".join(argv or []),
            "date": time.strftime("%Y-%m-%d %H:%M"), "prompts": {}}
  for name in names:
    ids = prompts_lib.encode(suite[name], bundle.tokenizer)
    per = {}
    for method in ("target", "model"):
      gamma_max = jspec.Options(method=method).gammas()[1]
      runs = {"old": [], "new": []}
      for rep in range(args.reps + 1):  # the first of each compiles: not counted
        for label, fn in (("old", old_widths), ("new", new_widths)):
          api.widths = fn
          try:
            r = jspec.generate(bundle, ids, max_new_tokens=args.max_new_tokens, method=method,
                               temperature=0.0, stop_at_eos=False)
          finally:
            api.widths = new_widths
          if rep:
            runs[label].append(r)
      rec = {"prompt_tokens": len(ids), "gamma_max": gamma_max}
      for label, fn in (("old", old_widths), ("new", new_widths)):
        rs = runs[label]
        rec[label] = {
            "widths": fn(len(ids), args.max_new_tokens, gamma_max),
            "prefill_s": statistics.median(r.stats["prefill_s"] for r in rs),
            "decode_tokens_per_s": statistics.median(
                (r.stats["new_tokens"] - 1) / r.stats["decode_s"] for r in rs),
            "token_ids": rs[0].token_ids}
      rec["same_tokens"] = all(r.token_ids == rec["old"]["token_ids"]
                               for rs in runs.values() for r in rs)
      for label in ("old", "new"):
        del rec[label]["token_ids"]
      rec["decode_new_over_old"] = (rec["new"]["decode_tokens_per_s"]
                                    / rec["old"]["decode_tokens_per_s"])
      rec["prefill_new_over_old"] = rec["new"]["prefill_s"] / rec["old"]["prefill_s"]
      per[method] = rec
      print(f"{name} ({len(ids)} tokens) {method}: widths old {rec['old']['widths']} new "
            f"{rec['new']['widths']}; prefill {rec['old']['prefill_s']:.2f} -> "
            f"{rec['new']['prefill_s']:.2f} s; decode {rec['old']['decode_tokens_per_s']:.2f} -> "
            f"{rec['new']['decode_tokens_per_s']:.2f} tok/s; same tokens {rec['same_tokens']}",
            flush=True)
    result["prompts"][name] = per
    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
