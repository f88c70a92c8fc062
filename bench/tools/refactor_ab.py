"""One jspec version's target-only and default speculative tok/s, for an A/B of two checkouts.

Run it from each checkout in turn, alternating processes, so that the host's
swings fall on both (the figures of the refactor's A/B in docs/decisions.md):

  git worktree add /tmp/old 8f883f9
  for i in 1 2; do
    (cd /tmp/old && JSPEC_CACHE=/tmp/oldcache PYTHONPATH=/tmp/old \\
        python /path/to/main/bench/tools/refactor_ab.py old /tmp/ab_old_$i.json)
    (cd /path/to/main && python -m bench.tools.refactor_ab new /tmp/ab_new_$i.json)
  done

It uses only what both versions have: `jspec.load(dtype="float32")`,
`jspec.generate(bundle, ids, max_new_tokens=, method=)` and the bench's
prompt suite. The old checkout needs its own cache: its converted files
have another format.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jspec
from bench import prompts as prompts_lib


def main(argv: list[str]) -> int:
  """Args: [label, output JSON path]. Returns 0."""
  label, out = argv
  t0 = time.time()
  bundle = jspec.load(progress=False, dtype="float32")
  rec = {"label": label, "load_s": time.time() - t0, "prompts": {}}
  for prompt in prompts_lib.SUITE[:2]:
    ids = prompts_lib.encode(prompt, bundle.tokenizer)
    per_method = {}
    for method in ("target", "model"):
      jspec.generate(bundle, ids, max_new_tokens=64, method=method)  # compile
      runs = []
      for _ in range(2):
        result = jspec.generate(bundle, ids, max_new_tokens=64, method=method)
        runs.append(len(result.token_ids) / result.stats["decode_s"])
      per_method[method] = {"tok_s": statistics.median(runs), "runs": runs,
                            "ids": result.token_ids}
    rec["prompts"][prompt.name] = per_method
    print(label, prompt.name, {m: round(v["tok_s"], 2) for m, v in per_method.items()},
          flush=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(rec, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
