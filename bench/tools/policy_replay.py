"""Drafting policies replayed on the real pair's greedy paths, priced by this host's forward costs.

    python -m bench.tools.policy_replay [--prompts code,chat] [--max-new-tokens 96]
        [--reps 5] [--from DOC] [--costs COSTS] [--check SWEEP]
        [--out bench/results/policy_replay_cpu.json]

Greedy, a round's outcome is fixed by the target's path: while its drafts
match, the draft sees exactly the prefix of the target's own tokens. So one
target-only generation per prompt (the path y) and one draft forward over it
(at each position j the draft's argmax a_j and its top probability c_j, as
`drafters._top_prob` reads it) replay any stopping rule offline, exactly up
to one approximation: after a wrong draft the rule is shown the confidences
of the true path, not of the draft's own wrong continuation (those drafts
are rejected whatever they are; only how many are run can differ).

Each round is priced by forwards timed on this host, alternated in one
process: a draft step d, a verify of T positions v(T) for each compiled
width, and the target-only step t. A round of f draft forwards verified at
width T costs f x d + v(T); target-only costs t a token. The replayed speedup
over target-only is then sum(t per token) / sum(round costs): the loop's
own overheads (acceptance, catch-up, the while loop) are left out.
`--check` compares the replay with a measured `confidence_sweep` document
of the same policies (tokens per round and speedups), which is what says
whether the prices are good enough to rank policies by. `--from` replays an
earlier document's paths without loading a model, and `--costs` prices
them with another host's costs (a JSON file of `target_step_s`,
`draft_step_s` and `verify_s` for widths 2 to 9).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from jspec import rounds

Rule = rounds.Rule


@dataclasses.dataclass(frozen=True)
class Costs:
  """Seconds of the forwards a round is made of.

  Attributes:
    target_step: the target's one-token forward (target-only's round).
    draft_step: the draft's one-token forward.
    verify: {T: seconds} the target's forward over T positions, per width.
  """

  target_step: float
  draft_step: float
  verify: dict[int, float]


def cumulative(threshold: float) -> Rule:
  """Go on while the product of the round's top probabilities is at least `threshold`."""
  return lambda c, cap: math.prod(c) >= threshold


def fixed() -> Rule:
  """Draft the cap every round."""
  return lambda c, cap: True


def replay(a: np.ndarray, c: np.ndarray, y: np.ndarray, rule: Rule, cap: int, gamma_max: int,
           stops: bool, costs: Costs) -> dict[str, float]:
  """Replays a whole path from position 1 (position 0 is the prefill's token).

  Returns:
    {"rounds", "tokens_per_round", "acceptance", "seconds", "speedup"}.
  """
  ok = np.asarray(a) == np.asarray(y)  # [N]
  j, n_rounds, seconds, drafted, accepted = 1, 0, 0.0, 0, 0
  while j < len(y):
    emitted, forwards, width, counted = rounds.replay_round(ok, c, j, rule, cap, gamma_max, stops)
    emitted = min(emitted, len(y) - j)
    n_rounds += 1
    seconds += forwards * costs.draft_step + costs.verify[width]
    drafted += counted
    accepted += emitted - 1
    j += emitted
  tokens = len(y) - 1
  return {"rounds": n_rounds, "tokens_per_round": tokens / n_rounds,
          "acceptance": accepted / max(drafted, 1), "seconds": seconds,
          "speedup": tokens * costs.target_step / seconds}


def policies() -> dict[str, tuple[Rule, int, int, bool]]:
  """The policies replayed: name -> (rule, cap, gamma_max, stops), named as `confidence_sweep` names them."""
  out: dict[str, tuple[Rule, int, int, bool]] = {}
  for cap in (8, 5, 4, 3, 2):
    for t in (0.5, 0.65, 0.7, 0.8, 0.9):
      out[f"c{t:g}_g{cap}"] = (rounds.confidence(t), cap, cap, True)
  for g in (1, 2, 3, 4):
    out[f"fixed{g}"] = (fixed(), g, g, False)
  for t in (0.5, 0.7, 0.8, 0.9):
    out[f"cum{t:g}_g8"] = (cumulative(t), 8, 8, True)
  return out


def measure_costs(bundle, gamma_max: int, reps: int, context: int = 150) -> Costs:
  """Times the target's and the draft's forwards on a cache holding `context` tokens, alternated.

  Every verify width from 2 to gamma_max + 1 is timed: a policy whose cap
  is lower has its own widths.

  Returns:
    Medians over `reps` alternated repetitions.
  """
  import jax
  import jax.numpy as jnp
  from jspec import cache as cache_lib
  from jspec import model

  def fwd(m, t: int, greedy: bool):
    cache = cache_lib.init(m.cfg, 1, 512, m.backend.dtype)
    cache = cache_lib.with_lengths(cache, jnp.full((1,), context, jnp.int32))
    tokens = jnp.full((1, t), 100, jnp.int32)
    f = jax.jit(lambda p, x, k: model.forward(m.arch, p, x, k, greedy=greedy,
                                              vocab_limit=bundle.vocab_limit)[0])
    return lambda: jax.block_until_ready(f(m.params, tokens, cache))

  calls = {("verify", t): fwd(bundle.target, t, True) for t in range(2, gamma_max + 2)}
  calls[("target", 1)] = fwd(bundle.target, 1, True)
  calls[("draft", 1)] = fwd(bundle.draft, 1, False)
  times: dict[Any, list[float]] = {k: [] for k in calls}
  for call in calls.values():
    call()
  for _ in range(reps):
    for k, call in calls.items():
      start = time.perf_counter()
      call()
      times[k].append(time.perf_counter() - start)
  med = {k: statistics.median(v) for k, v in times.items()}
  return Costs(target_step=med[("target", 1)], draft_step=med[("draft", 1)],
               verify={t: med[("verify", t)] for t in range(2, gamma_max + 2)})


def draft_path(bundle, prompt: list[int], y: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """The draft's argmax and top probability predicting each y[j] from prompt + y[:j].

  Returns:
    (a [N], c [N]); index 0 is unused (the prefill's token).
  """
  import jax.numpy as jnp
  from jspec import cache as cache_lib
  from jspec import draft_vocab as draft_vocab_lib
  from jspec import drafters
  from jspec import model
  from jspec import sampling

  m = bundle.draft
  params = draft_vocab_lib.with_prompt_ids(m.params, m.cfg.vocab_size, [prompt])
  seq = np.asarray(prompt + y[:-1], np.int32)[None]
  p = len(prompt)
  width = 1 << (seq.shape[1] - 1).bit_length()
  chunk = np.zeros((1, width), np.int32)
  chunk[:, :seq.shape[1]] = seq
  cache = cache_lib.init(m.cfg, 1, width, m.backend.dtype)
  at = np.arange(p - 1, p + len(y) - 1, dtype=np.int32)[None]  # predicts y[0..N-1]
  logits, _ = model.forward(m.arch, params, jnp.asarray(chunk), cache, logits_at=jnp.asarray(at),
                            fresh=True)
  greedy = sampling.Sampling(0.0, vocab_limit=bundle.vocab_limit)
  c = np.asarray(drafters._top_prob(logits[0], None, greedy))  # the engine's own confidence
  a = np.asarray(sampling.argmax(logits[0], greedy))
  return a, c


def summarize(per_prompt: list[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
  """Per kind and policy: medians over prompts of tokens per round and replayed speedup."""
  out: dict[str, Any] = {}
  for kind in sorted({r["kind"] for r in per_prompt}):
    rows = [r for r in per_prompt if r["kind"] == kind]
    out[kind] = {n: {"tokens_per_round": statistics.median(r[n]["tokens_per_round"] for r in rows),
                     "speedup": statistics.median(r[n]["speedup"] for r in rows)} for n in names}
  return out


def check(per_prompt: list[dict[str, Any]], measured: dict[str, Any]) -> dict[str, Any]:
  """Replay against a measured sweep, per policy both ran: median tokens per round and speedup."""
  out: dict[str, Any] = {}
  recs = measured["records"]
  names = [n for n in recs[0] if n not in ("prompt", "kind", "rep", "order", "target")]
  # A sweep of one cap names its configurations without it: the cap it
  # records, or 8 (the default before the sweep recorded its caps).
  cap = measured.get("gammas", [8])[0]
  for name in names:
    n = name if name in per_prompt[0] or "_g" in name or "fixed" in name else f"{name}_g{cap}"
    if n not in per_prompt[0]:
      continue
    rows = []
    for r in per_prompt:
      mine = [m for m in recs if m["prompt"] == r["prompt"]]
      if not mine:
        continue
      rows.append({"kind": r["kind"],
                   "tpr_replay": r[n]["tokens_per_round"],
                   "tpr_measured": statistics.median(m[name]["tokens_per_round"] for m in mine),
                   "x_replay": r[n]["speedup"],
                   "x_measured": statistics.median(m[name]["tok_s"] / m["target"]["tok_s"]
                                                   for m in mine)})
    for kind in sorted({x["kind"] for x in rows}):
      k = [x for x in rows if x["kind"] == kind]
      out.setdefault(kind, {})[n] = {f: statistics.median(x[f] for x in k)
                                     for f in ("tpr_replay", "tpr_measured", "x_replay",
                                               "x_measured")}
  return out


def costs_from(doc: dict[str, Any]) -> Costs:
  """The `costs` of a replay document (or a file holding only them) as `Costs`.

  Raises:
    ValueError: a cost missing or not a positive number, or a verify width missing.
  """
  doc = doc.get("costs", doc)
  try:
    out = Costs(float(doc["target_step_s"]), float(doc["draft_step_s"]),
                {int(t): float(v) for t, v in doc["verify_s"].items()})
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise ValueError(f"costs {doc!r}: expected target_step_s, draft_step_s and verify_s "
                     f"{{width: seconds}} ({e})") from None
  if not all(v > 0 for v in [out.target_step, out.draft_step, *out.verify.values()]):
    raise ValueError(f"costs {doc!r}: expected positive seconds")
  missing = sorted(set(range(2, 10)) - set(out.verify))
  if missing:
    raise ValueError(f"costs: verify_s lacks widths {missing}: expected every width 2 to 9")
  return out


def replay_all(paths: list[dict[str, Any]], costs: Costs) -> list[dict[str, Any]]:
  """Every policy of `policies` on every prompt's path.

  Args:
    paths: per prompt {"prompt", "kind", "path": {"y", "a", "c"}}.
    costs: the host's forward costs.

  Returns:
    The rows with each policy's `replay` under its name.
  """
  out = []
  for row in paths:
    y, a, c = (np.asarray(row["path"][k]) for k in ("y", "a", "c"))
    row = {**row, "draft_matches": float(np.mean(a[1:] == y[1:]))}
    for name, (rule, cap, g, stops) in policies().items():
      row[name] = replay(a, c, y, rule, cap, g, stops, costs)
    out.append(row)
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Replays the policies on the default pair's paths (or an earlier document's), prints the summary.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0.
  """
  ap = argparse.ArgumentParser(prog="python -m bench.tools.policy_replay",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--prompts", default="code,chat")
  ap.add_argument("--max-new-tokens", type=int, default=96)
  ap.add_argument("--reps", type=int, default=5, help="alternated repetitions of the cost timing")
  ap.add_argument("--from", dest="source", type=pathlib.Path, default=None,
                  help="replay the paths (and costs) of an earlier document; loads no model")
  ap.add_argument("--costs", type=pathlib.Path, default=None,
                  help="a JSON file of costs (target_step_s, draft_step_s, verify_s) to price with")
  ap.add_argument("--check", type=pathlib.Path, default=None,
                  help="a confidence_sweep document of this host to compare with")
  ap.add_argument("--out", type=pathlib.Path,
                  default=pathlib.Path("bench/results/policy_replay_cpu.json"))
  args = ap.parse_args(argv)
  if args.reps < 1 or args.max_new_tokens < 2:
    ap.error("--reps must be at least 1 and --max-new-tokens at least 2")
  from bench import results

  def read(path: pathlib.Path) -> dict[str, Any]:
    try:
      return json.loads(path.read_text())
    except (OSError, ValueError) as e:
      ap.error(f"{path}: expected a readable JSON document ({e})")

  try:
    costs = costs_from(read(args.costs)) if args.costs else None
    if args.source is not None:
      source = read(args.source)
      paths = [{k: r[k] for k in ("prompt", "kind", "path")} for r in source["per_prompt"]]
      costs = costs or costs_from(source)
  except ValueError as e:
    ap.error(str(e))
  except (KeyError, TypeError):
    ap.error(f"{args.source}: expected a policy_replay document with per_prompt paths")
  if args.source is None:
    import jspec
    from bench import prompts as prompts_lib
    bundle = jspec.load(progress=False)
    costs = costs or measure_costs(bundle, 8, args.reps)
    paths = []
    for p in prompts_lib.select(prompts_lib.SUITE, args.prompts):
      ids = prompts_lib.encode(p, bundle.tokenizer)
      y = list(jspec.generate(bundle, ids, max_new_tokens=args.max_new_tokens, temperature=0.0,
                              stop_at_eos=False, method="target").token_ids)
      a, c = draft_path(bundle, ids, y)
      paths.append({"prompt": p.name, "kind": p.kind,
                    "path": {"y": y, "a": a.tolist(), "c": c.tolist()}})
  print(f"costs: target step {costs.target_step * 1e3:.1f} ms, draft step "
        f"{costs.draft_step * 1e3:.1f} ms, verify " + ", ".join(
            f"{t}: {s * 1e3:.1f}" for t, s in sorted(costs.verify.items())), flush=True)
  per_prompt = replay_all(paths, costs)
  doc: dict[str, Any] = {
      "command": "python -m bench.tools.policy_replay " + " ".join(
          argv if argv is not None else sys.argv[1:]),
      "costs": {"target_step_s": costs.target_step, "draft_step_s": costs.draft_step,
                "verify_s": {str(t): s for t, s in sorted(costs.verify.items())}},
      "per_prompt": per_prompt, "summary": summarize(per_prompt, list(policies()))}
  if args.check is not None:
    doc["check"] = check(per_prompt, read(args.check))
  results.write(doc, args.out)
  for kind, per in doc["summary"].items():
    for name, s in sorted(per.items(), key=lambda kv: -kv[1]["speedup"]):
      print(f"{kind} {name}: replayed x target {s['speedup']:.3f}, tokens/round "
            f"{s['tokens_per_round']:.2f}")
  for kind, per in doc.get("check", {}).items():
    for name, s in per.items():
      print(f"check {kind} {name}: tokens/round {s['tpr_replay']:.2f} replayed, "
            f"{s['tpr_measured']:.2f} measured; x target {s['x_replay']:.3f} replayed, "
            f"{s['x_measured']:.3f} measured")
  return 0


if __name__ == "__main__":
  sys.exit(main())
