"""The most prompt lookup could gain on a bench run's prompts, replayed from its target tokens.

    python -m bench.lookup_bound RESULTS.json [--prompts edit_type_hints] [--gamma 16]

Greedy prompt lookup is deterministic given the target's output: each round
drafts what followed the latest earlier occurrence of the last n tokens
(`jspec.drafters.prompt_lookup`), the target accepts the drafts up to the
first that differs from its own next token, and emits one more. So the
rounds a run needs follow from the prompt and the target-only tokens a
results JSON holds, for any n-gram length, without running a model. Each
round is one target forward of at least one position, which costs at
least a target-only step, so with the run's own target-only prefill P and
per-token decode time t1:

  bound = (P + (N - 1) t1) / (P + rounds * t1)

is more than prompt lookup can reach on that prompt, however cheap its
verifies (N new tokens; the first comes from the prefill). The replay at
the run's n-gram length must need as many rounds as the run measured,
which checks the replay against the engine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Sequence

NGRAMS = (1, 2, 3, 4)


def lookup(tokens: Sequence[int], ngram: int, gamma: int) -> list[int]:
  """What prompt lookup drafts after `tokens`: up to gamma tokens that followed the latest match.

  Args:
    tokens: prompt and output so far.
    ngram: n-gram length matched.
    gamma: most drafts.

  Returns:
    The drafts (empty when the last n-gram occurred nowhere before).
  """
  n = len(tokens)
  if n <= ngram:
    return []
  suffix = list(tokens[n - ngram:])
  for j in range(n - ngram - 1, -1, -1):  # latest first; the match ends before the suffix does
    if list(tokens[j:j + ngram]) == suffix:
      return list(tokens[j + ngram:j + ngram + gamma])
  return []


def replay(prompt: Sequence[int], output: Sequence[int], ngram: int, gamma: int) -> dict:
  """The rounds greedy prompt lookup takes to emit `output` after `prompt`.

  Args:
    prompt: prompt token ids.
    output: the target's greedy tokens (the first comes from the prefill).
    ngram: n-gram length.
    gamma: most drafts a round.

  Returns:
    {"rounds", "empty_rounds" (no match: one token), "accepted" (drafts)}.
  """
  tokens = list(prompt) + list(output[:1])
  done, rounds, empty, accepted = 1, 0, 0, 0
  while done < len(output):
    drafts = lookup(tokens, ngram, gamma)
    n = 0
    while n < len(drafts) and done + n < len(output) and drafts[n] == output[done + n]:
      n += 1
    emitted = min(n + 1, len(output) - done)
    tokens += output[done:done + emitted]
    done += emitted
    rounds, empty, accepted = rounds + 1, empty + (not drafts), accepted + n
  return {"rounds": rounds, "empty_rounds": empty, "accepted": accepted}


def bounds(results: dict, prompts: Sequence[str] = (), gamma: int | None = None) -> dict:
  """Per prompt of a results JSON: each n-gram length's replay and speedup bound.

  Args:
    results: a bench results JSON (`python -m bench`), with target runs.
    prompts: prompt names to take (empty: all).
    gamma: most drafts a round (None: the run's prompt_lookup gamma, else 16).

  Returns:
    {prompt: {"prefill_s", "step_s", "gamma", "measured": {"ngram", "rounds", "speedup"}
    or None, "ngram": {n: replay + {"bound"}}}}.

  Raises:
    ValueError: a prompt the results do not hold, or a prompt without a target run.
  """
  settings = results.get("settings", {}).get("mode_args", {}).get("prompt_lookup") or {}
  gamma = gamma or settings.get("gamma") or 16
  unknown = sorted(set(prompts) - set(results["prompts"]))
  if unknown:
    raise ValueError(f"prompts {unknown} are not in the results; they hold "
                     f"{sorted(results['prompts'])}")
  out = {}
  for name, record in results["prompts"].items():
    if prompts and name not in prompts:
      continue
    target = record["modes"].get("target")
    if not target or not target.get("token_ids"):
      raise ValueError(f"prompt {name}: no target-only run with token ids to replay")
    output, n_new = target["token_ids"], target["new_tokens"]
    step = target["decode_s"] / (n_new - 1)
    total = target["prefill_s"] + target["decode_s"]
    measured = record["modes"].get("prompt_lookup")
    entry = {"prefill_s": target["prefill_s"], "step_s": step, "gamma": gamma,
             "measured": measured and {"ngram": settings.get("ngram"), "rounds": measured["rounds"],
                                       "speedup": measured["speedup_vs_target"]},
             "ngram": {}}
    for n in NGRAMS:
      r = replay(record["prompt_ids"], output, n, gamma)
      r["bound"] = total / (target["prefill_s"] + r["rounds"] * step)
      entry["ngram"][n] = r
    out[name] = entry
  return out


def main(argv=None) -> dict:
  """Prints each prompt's replays and bounds, then the figures as one JSON line."""
  parser = argparse.ArgumentParser(prog="python -m bench.lookup_bound", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("results", type=pathlib.Path, help="a results JSON of `python -m bench`")
  parser.add_argument("--prompts", default="", help="comma-separated prompt names (default all)")
  parser.add_argument("--gamma", type=int, default=None,
                      help="most drafts a round (default: the run's prompt_lookup gamma)")
  args = parser.parse_args(argv)
  if args.gamma is not None and args.gamma < 1:
    parser.error(f"--gamma {args.gamma}: expected at least 1")
  try:
    results = json.loads(args.results.read_text())
    out = bounds(results, [p for p in args.prompts.split(",") if p], args.gamma)
  except (OSError, ValueError, KeyError) as err:
    parser.error(f"{args.results}: {err}")
  for name, entry in out.items():
    m = entry["measured"]
    seen = f"; measured: {m['rounds']} rounds at n={m['ngram']}, {m['speedup']:.2f}x" if m else ""
    print(f"{name}: target prefill {entry['prefill_s']:.2f} s, step {entry['step_s'] * 1e3:.0f} ms, "
          f"gamma {entry['gamma']}{seen}")
    for n, r in entry["ngram"].items():
      print(f"  n={n}: {r['rounds']} rounds, {r['empty_rounds']} with no match, "
            f"{r['accepted']} drafts accepted; at most {r['bound']:.2f}x")
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
