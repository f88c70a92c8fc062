"""What one speculative round costs on the default pair: a target step, a draft step, a verify.

    python -m bench.tools.round_cost [--prompt "def quicksort(arr):"] [--reps 3]
                                     [--max-new-tokens 64]

Greedy, EOS off, one process, each configuration once untimed (compiles),
then `--reps` alternating repetitions; medians of decode seconds per round.
On a prompt the draft predicts fully (acceptance 1), fixed gamma 3 and 4
under gamma_max 4 both verify at width 5 (`decode.verify_widths`: 2, 3, 5),
so their difference is one draft step; target-only's round is one target
step; each fixed gamma's round less its draft steps is the verify at its
width (gamma 1: 2, gamma 2: 3, gamma 4: 5, gamma 8: 9). The figures say how
much of a round the draft costs (docs/decisions-compact.md, "Where the
default's gain went").
"""

from __future__ import annotations

import argparse
import json
import statistics

import jspec

CONFIGS = {"target": {"method": "target"}, "g1": {"policy": "fixed", "gamma": 1},
           "g2": {"policy": "fixed", "gamma": 2},
           "g3": {"policy": "fixed", "gamma": 3, "gamma_max": 4},
           "g4": {"policy": "fixed", "gamma": 4}, "g8": {"policy": "fixed", "gamma": 8}}
# Each fixed configuration's drafts and the verify width they fill at acceptance 1.
VERIFIES = {"g1": (1, 2), "g2": (2, 3), "g4": (4, 5), "g8": (8, 9)}


def derive(per_round: dict) -> dict:
  """The step costs behind the rounds: one draft step, and each verify width's forward.

  Args:
    per_round: median decode seconds per round of each configuration in
      `CONFIGS`, at acceptance 1.

  Returns:
    target_step_s, draft_step_s, verify{T}_s for each width in `VERIFIES`,
    and draft_over_target.
  """
  draft = per_round["g4"] - per_round["g3"]
  out = {"target_step_s": per_round["target"], "draft_step_s": draft}
  for name, (gamma, width) in VERIFIES.items():
    out[f"verify{width}_s"] = per_round[name] - gamma * draft
  out["draft_over_target"] = draft / per_round["target"]
  return out


def main(argv=None) -> int:
  """Runs the configurations and prints the per-round costs as JSON.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.round_cost", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompt", default="def quicksort(arr):")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--max-new-tokens", type=int, default=64)
  args = parser.parse_args(argv)
  if args.reps < 1 or args.max_new_tokens < 2:
    parser.error("--reps must be at least 1 and --max-new-tokens at least 2")
  bundle = jspec.load(progress=False)
  kw = dict(max_new_tokens=args.max_new_tokens, stop_at_eos=False, temperature=0.0)
  for c in CONFIGS.values():
    jspec.generate(bundle, args.prompt, **kw, **c)
  runs: dict[str, list] = {k: [] for k in CONFIGS}
  for _ in range(args.reps):
    for name, c in CONFIGS.items():
      runs[name].append(jspec.generate(bundle, args.prompt, **kw, **c).stats)
  per_round = {k: statistics.median(s["decode_s"] / s["rounds"] for s in v) for k, v in runs.items()}
  out = {"per_round_s": per_round,
         "tokens_per_round": {k: v[0]["mean_tokens_per_round"] for k, v in runs.items()},
         "acceptance": {k: v[0]["acceptance_rate"] for k, v in runs.items()},
         "decode_tokens_per_s": {k: statistics.median((s["new_tokens"] - 1) / s["decode_s"]
                                                      for s in v) for k, v in runs.items()}}
  out["derived"] = derive(per_round)
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
