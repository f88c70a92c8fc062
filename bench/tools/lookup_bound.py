"""The most prompt lookup could gain on a bench run's prompts, replayed from its target tokens.

    python -m bench.tools.lookup_bound RESULTS.json [--prompts edit_type_hints] [--gamma 16] [--goal 2.5]

Greedy prompt lookup is deterministic given the target's output: each round
drafts what followed the latest earlier occurrence of the longest suffix of
at most n tokens that occurred before (`jspec.drafters.prompt_lookup`;
with `min_ngram` = n only a full n-gram counts, as `lookup_model`'s lookup
rounds ask), the target accepts the drafts up to the first that differs
from its own next token, and emits one more. So the rounds a run needs
follow from the prompt and the target-only tokens a results JSON holds,
for any n, without running a model. Each round is one target forward of
at least one position, which costs at least a target-only step, so with
the run's own target-only prefill P and per-token decode time t1:

  bound = (P + (N - 1) t1) / (P + rounds * t1)

is more than prompt lookup can reach on that prompt, however cheap its
verifies (N new tokens; the first comes from the prefill). The replay at
the run's n must need as many rounds as the run measured, which checks
the replay against the engine.

The oracle is the bound for any drafter that copies what followed an
earlier occurrence of its last tokens (as prompt lookup does, at any n):
each round it takes, of every earlier occurrence of the last token, the one
whose continuation the target accepts furthest (as if every candidate were
verified at once, for free). Rounds it cannot save are tokens that never
followed the token before them anywhere earlier. The span oracle drops the
anchor: each round it drafts the longest run of the target's next tokens
that occurs anywhere in the context, which no drafter that copies one run
of the context beats (one that knew where to copy from without being told).

Against a run's prompt lookup, the tool also says how many rounds a GOAL x
speedup would allow at the cost per round that run measured (its decode
time over its rounds): (P + (N - 1) t1) / GOAL - P, over that cost.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Sequence

NGRAMS = (1, 2, 3, 4)
ORACLES = ("", "token", "span")


def _match(tokens: Sequence[int], end: int, ngram: int) -> int:
  """How many of tokens' last ngram tokens match the ones ending at index `end` (consecutively)."""
  n, length = len(tokens), 0
  while length < ngram and end - length >= 0 and tokens[end - length] == tokens[n - 1 - length]:
    length += 1
  return length


def lookup(tokens: Sequence[int], ngram: int, gamma: int, min_ngram: int = 1) -> list[int]:
  """What prompt lookup drafts after `tokens` (`jspec.drafters.prompt_lookup`).

  Args:
    tokens: prompt and output so far.
    ngram: longest suffix matched.
    gamma: most drafts for a full-length match (each token shorter, half as many, at least 1).
    min_ngram: shortest suffix that counts.

  Returns:
    The drafts (empty when no suffix of min_ngram tokens occurred before).
  """
  n = len(tokens)
  best, at = 0, -1
  for end in range(n - 2, -1, -1):  # latest first; at least one token follows the match
    length = _match(tokens, end, ngram)
    if length > best:
      best, at = length, end
  if best < min_ngram:
    return []
  return list(tokens[at + 1:at + 1 + max(gamma >> (ngram - best), 1)])


def _oracle(tokens: Sequence[int], future: Sequence[int], gamma: int, span: bool) -> list[int]:
  """The longest run of `future` that the context holds: after an earlier occurrence of the
  last token, or anywhere when `span`."""
  best: list[int] = []
  for start in range(len(tokens)):  # where a copy would begin
    if not span and (start == 0 or tokens[start - 1] != tokens[-1]):
      continue
    k = 0
    while k < min(gamma, len(future)) and start + k < len(tokens) and tokens[start + k] == future[k]:
      k += 1
    if k > len(best):
      best = list(future[:k])
  return best


def replay(prompt: Sequence[int], output: Sequence[int], ngram: int, gamma: int,
           min_ngram: int = 1, oracle: str = "") -> dict:
  """The rounds greedy prompt lookup takes to emit `output` after `prompt`.

  Args:
    prompt: prompt token ids.
    output: the target's greedy tokens (the first comes from the prefill).
    ngram: longest suffix matched.
    gamma: most drafts a round.
    min_ngram: shortest suffix that counts.
    oracle: "token" drafts the best continuation of the last token instead,
      "span" the longest run of the output found anywhere before (see the
      module docstring; ngram and min_ngram are then unused); "" neither.

  Returns:
    {"rounds", "empty_rounds" (no drafts: one token), "accepted" (drafts)}.
  """
  if oracle not in ORACLES:
    raise ValueError(f"oracle {oracle!r}: expected one of {ORACLES}")
  tokens = list(prompt) + list(output[:1])
  done, rounds, empty, accepted = 1, 0, 0, 0
  while done < len(output):
    if oracle:
      drafts = _oracle(tokens, output[done:], gamma, span=oracle == "span")
    else:
      drafts = lookup(tokens, ngram, gamma, min_ngram)
    n = 0
    while n < len(drafts) and done + n < len(output) and drafts[n] == output[done + n]:
      n += 1
    emitted = min(n + 1, len(output) - done)
    tokens += output[done:done + emitted]
    done += emitted
    rounds, empty, accepted = rounds + 1, empty + (not drafts), accepted + n
  return {"rounds": rounds, "empty_rounds": empty, "accepted": accepted}


def bounds(results: dict, prompts: Sequence[str] = (), gamma: int | None = None,
           goal: float = 2.5) -> dict:
  """Per prompt of a results JSON: each rule's replay and speedup bound.

  Args:
    results: a bench results JSON (`python -m bench`), with target runs.
    prompts: prompt names to take (empty: all).
    gamma: most drafts a round (None: the run's prompt_lookup gamma, else 16).
    goal: the speedup whose allowed rounds "measured" reports.

  Returns:
    {prompt: {"prefill_s", "step_s", "gamma", "measured": {"ngram", "rounds", "speedup",
    "round_s" (its decode time per round), "goal", "rounds_for_goal" (the most rounds at
    round_s that reach goal)} or None, "ngram": {n: replay + {"bound"}} (the engine's rule,
    falling back to shorter suffixes), "exact": {n: ...} (a full n-gram only), "oracle"
    and "span_oracle": replay + {"bound"}}}.

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
    entry = {"prefill_s": target["prefill_s"], "step_s": step, "gamma": gamma, "measured": None}
    if measured:
      round_s = measured["decode_s"] / measured["rounds"]
      entry["measured"] = {"ngram": settings.get("ngram"), "rounds": measured["rounds"],
                           "speedup": measured["speedup_vs_target"], "round_s": round_s,
                           "goal": goal,
                           "rounds_for_goal": max(0, int((total / goal - target["prefill_s"]) // round_s))}

    def bounded(r: dict) -> dict:
      return {**r, "bound": total / (target["prefill_s"] + r["rounds"] * step)}

    prompt = record["prompt_ids"]
    entry["ngram"] = {n: bounded(replay(prompt, output, n, gamma)) for n in NGRAMS}
    entry["exact"] = {n: bounded(replay(prompt, output, n, gamma, min_ngram=n)) for n in NGRAMS}
    entry["oracle"] = bounded(replay(prompt, output, 1, gamma, oracle="token"))
    entry["span_oracle"] = bounded(replay(prompt, output, 1, gamma, oracle="span"))
    out[name] = entry
  return out


def main(argv=None) -> dict:
  """Prints each prompt's replays and bounds, then the figures as one JSON line."""
  parser = argparse.ArgumentParser(prog="python -m bench.tools.lookup_bound", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("results", type=pathlib.Path, help="a results JSON of `python -m bench`")
  parser.add_argument("--prompts", default="", help="comma-separated prompt names (default all)")
  parser.add_argument("--gamma", type=int, default=None,
                      help="most drafts a round (default: the run's prompt_lookup gamma)")
  parser.add_argument("--goal", type=float, default=2.5,
                      help="the speedup whose allowed rounds are printed (default 2.5)")
  args = parser.parse_args(argv)
  if args.gamma is not None and args.gamma < 1:
    parser.error(f"--gamma {args.gamma}: expected at least 1")
  if not args.goal > 0:
    parser.error(f"--goal {args.goal}: expected a speedup above 0")
  try:
    results = json.loads(args.results.read_text())
    out = bounds(results, [p for p in args.prompts.split(",") if p], args.gamma, args.goal)
  except (OSError, ValueError, KeyError) as err:
    parser.error(f"{args.results}: {err}")
  for name, entry in out.items():
    m = entry["measured"]
    seen = (f"; measured: {m['rounds']} rounds at n={m['ngram']}, {m['speedup']:.2f}x, "
            f"{m['round_s'] * 1e3:.0f} ms a round: {m['goal']:g}x needs at most "
            f"{m['rounds_for_goal']} rounds" if m else "")
    print(f"{name}: target prefill {entry['prefill_s']:.2f} s, step {entry['step_s'] * 1e3:.0f} ms, "
          f"gamma {entry['gamma']}{seen}")
    rows = [(f"n<={n}", r) for n, r in entry["ngram"].items()]
    rows += [(f"n={n} only", r) for n, r in entry["exact"].items()]
    for label, r in rows + [("oracle", entry["oracle"]), ("span", entry["span_oracle"])]:
      print(f"  {label:9s} {r['rounds']} rounds, {r['empty_rounds']} with no drafts, "
            f"{r['accepted']} drafts accepted; at most {r['bound']:.2f}x")
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
