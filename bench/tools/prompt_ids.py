"""The cut draft vocabulary with and without the request's prompt ids, one process.

    python -m bench.tools.prompt_ids [--prompts code,chat] [--max-new-tokens 96] [--reps 2]
        [--out bench/results/prompt_ids_cpu.json]

The default draft keeps the head rows of its 65536 most frequent ids, and
what that ranking misses most is the prompt's own identifiers; each request
also scores its prompt's ids outside the subset from the whole head
(`jspec.draft_vocab.with_prompt_ids`). Loads the default pair once and
measures, per prompt and repetition in a rotated order (greedy): target-only,
the default ("prompt_ids") and the same draft with no prompt ids ("subset":
its params' `vocab_extra` None, which compiles its own programs once);
acceptance, tokens per round, decode tokens/s, the speedup over that
repetition's target-only and whether the ids equal target-only's. Summary
as `bench.tools.confidence_sweep`'s: per kind, medians over prompts, and
the paired ratio to "subset".
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from typing import Any, Optional, Sequence

import jspec
from bench import prompts as prompts_lib
from bench.tools import confidence_sweep
from jspec import bundle as bundle_lib

NAMES = ["subset", "prompt_ids"]  # the first is the paired ratios' reference


def without_prompt_ids(bundle: jspec.Bundle) -> jspec.Bundle:
  """The bundle with its draft's prompt-id rows removed (the cut subset alone).

  Args:
    bundle: a bundle whose draft has a cut head.

  Returns:
    The same target and tokenizer, the draft's `vocab_extra` None.

  Raises:
    ValueError: the draft's head is whole (nothing to compare).
  """
  params = bundle.draft.params
  if params.get("vocab_extra") is None:
    raise ValueError("the draft's head is whole (draft_vocab 0, or a vocabulary under "
                     "jspec.draft_vocab.DEFAULT): there are no prompt ids to leave out")
  draft = dataclasses.replace(bundle.draft, params={**params, "vocab_extra": None})
  return bundle_lib.Bundle(bundle.target, draft, bundle.tokenizer, bundle.vocab_limit)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the comparison, writes the JSON after every repetition, prints the summary.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0, or 1 where some ids differ from target-only's.
  """
  ap = argparse.ArgumentParser(prog="python -m bench.tools.prompt_ids",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--prompts", default="code,chat")
  ap.add_argument("--max-new-tokens", type=int, default=96)
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--out", type=pathlib.Path,
                  default=pathlib.Path("bench/results/prompt_ids_cpu.json"))
  args = ap.parse_args(argv)
  if args.reps < 1 or args.max_new_tokens < 2:
    ap.error("--reps must be at least 1 and --max-new-tokens at least 2")
  chosen = prompts_lib.select(prompts_lib.SUITE, args.prompts)
  bundle = jspec.load(progress=False)
  bundles = {"prompt_ids": bundle, "subset": without_prompt_ids(bundle)}
  ids = {p.name: prompts_lib.encode(p, bundle.tokenizer) for p in chosen}
  n = args.max_new_tokens
  run = confidence_sweep._run  # pylint: disable=protected-access
  configs = {"target": lambda x: run(bundle, x, n, method="target")}
  for name in NAMES:
    configs[name] = lambda x, b=bundles[name]: run(b, x, n)
  doc: dict[str, Any] = {"command": "python -m bench.tools.prompt_ids "
                                    + " ".join(argv if argv is not None else sys.argv[1:])}
  return confidence_sweep.compare(configs, chosen, ids, args.reps, args.out, doc)


if __name__ == "__main__":
  raise SystemExit(main())
