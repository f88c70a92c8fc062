"""Batch 1 vs batch 4 on the real pair: per-row acceptance in one program.

    python -m bench.batch [--max-new-tokens 128] [--gamma 4] [--out FILE]

Generates four code prompts of different lengths one at a time and then as
one batch (greedy, same settings), checks that every batch row is
token-identical to its single run (and to target-only), and reports
tokens/s of each. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jspec
from bench import prompts as prompts_lib

NAMES = ("quicksort", "lru_cache_class", "docstring_merge_intervals", "sql_report")


def main(argv=None) -> int:
  """Runs the comparison.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0 when every row matches, else 1.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--gamma", type=int, default=4)
  parser.add_argument("--out", default=None, help="write the figures as JSON here")
  args = parser.parse_args(argv)
  bundle = jspec.load("qwen2.5-coder", progress=False)
  chosen = [p for p in prompts_lib.SUITE if p.name in NAMES]
  texts = [p.text for p in chosen]
  kw = dict(max_new_tokens=args.max_new_tokens, gamma=args.gamma, stop_at_eos=False)
  jspec.generate(bundle, texts, **kw)  # compile the batch program
  for t in texts:  # and the single-row programs
    jspec.generate(bundle, t, **kw)
    jspec.generate(bundle, t, method="target", **{**kw, "gamma": 1})
  singles = [jspec.generate(bundle, t, **kw) for t in texts]
  targets = [jspec.generate(bundle, t, method="target", **{**kw, "gamma": 1}) for t in texts]
  batch = jspec.generate(bundle, texts, **kw)
  single_s = sum(r.stats["prefill_s"] + r.stats["decode_s"] for r in singles)
  batch_s = batch[0].stats["prefill_s"] + batch[0].stats["decode_s"]
  n_tokens = sum(len(r.token_ids) for r in batch)
  rows = []
  ok = True
  for p, s, t, b in zip(chosen, singles, targets, batch):
    same = b.token_ids == s.token_ids == t.token_ids
    ok &= same
    rows.append({"prompt": p.name, "prompt_tokens": len(bundle.tokenizer.encode(p.text)),
                 "identical": same, "acceptance_single": s.stats["acceptance_rate"],
                 "acceptance_in_batch": b.stats["acceptance_rate"],
                 "rounds_in_batch": b.stats["rounds"]})
  out = {"gamma": args.gamma, "max_new_tokens": args.max_new_tokens, "rows": rows,
         "batch1_tokens_per_s": n_tokens / single_s, "batch4_tokens_per_s": n_tokens / batch_s,
         "batch4_over_batch1": single_s / batch_s, "all_identical": ok,
         "command": "python -m bench.batch " + " ".join(argv or sys.argv[1:])}
  for r in rows:
    print(f"{r['prompt']:18s} {r['prompt_tokens']:4d} prompt tokens  identical={r['identical']}  "
          f"acceptance {r['acceptance_single']:.2f} alone, {r['acceptance_in_batch']:.2f} in batch")
  print(f"batch 1 (one prompt at a time): {out['batch1_tokens_per_s']:.2f} tok/s; "
        f"batch 4: {out['batch4_tokens_per_s']:.2f} tok/s ({out['batch4_over_batch1']:.2f}x)")
  print("CORRECTNESS:", "PASS" if ok else "FAIL")
  if args.out:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.out)) or ".")
    with os.fdopen(fd, "w") as f:
      json.dump(out, f, indent=1)
    os.replace(tmp, args.out)
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
