"""The confidence policy's threshold and cap against the target at hand, in one process.

    python -m bench.tools.confidence_sweep [--thresholds 0.5,0.65,0.8] [--gammas 8]
        [--fixed 2,3] [--prompts code,chat] [--max-new-tokens 96] [--reps 2]
        [--temperature 0] [--out bench/results/confidence_sweep_cpu.json]

The default threshold was chosen when the target was float32 and a draft
step cost little beside a target step; with the target exact as its GGUF
stores it a draft step costs a larger share of one, so a draft must be
likelier to be accepted to pay (docs/decisions.md, "Default policy"). `min_confidence` is data in the compiled program, so
every threshold runs the same programs; each cap (`gamma`, the most drafts
a round) compiles its own. A verify costs more steps on a host whose
multiply-adds are slow, so the cap that pays differs by host. `--fixed`
adds fixed-gamma configurations beside them. Loads the default pair once; for
each prompt and repetition runs target-only and the default method at each
threshold and cap, in a rotated order so that host drift falls on all alike
(greedy, or sampled at `--temperature` with seed 0); records acceptance,
tokens per round, decode tokens/s, the speedup over that repetition's
target-only, and whether the ids equal target-only's (a check only when
greedy). Summary: per kind, medians over prompts of each prompt's
median over repetitions, and of the paired ratio to the first threshold.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from typing import Any, Callable, Optional, Sequence

import jspec
from bench import prompts as prompts_lib
from bench import results
from jspec import options


def _run(bundle: jspec.Bundle, ids: list[int], n: int, temperature: float = 0.0,
         **kw) -> dict[str, Any]:
  r = jspec.generate(bundle, ids, max_new_tokens=n, temperature=temperature, stop_at_eos=False,
                     **kw)
  s = r.stats
  return {"ids": list(r.token_ids), "tok_s": len(r.token_ids) / s["decode_s"],
          "acceptance": s.get("acceptance_rate"), "tokens_per_round": s.get("mean_tokens_per_round")}


def summarize(records: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
  """Per kind and threshold: medians over prompts of the per-prompt medians over repetitions.

  Args:
    records: one per prompt and repetition: {"prompt", "kind", "target": run, name: run, ...}.
    names: the thresholds' names, the first the reference of the paired ratios.

  Returns:
    {kind: {name: {"speedup_over_target", "over_first_paired", "acceptance",
    "tokens_per_round", "ids_equal_target", "records"}}}.
  """
  out: dict[str, Any] = {}
  for kind in sorted({r["kind"] for r in records}):
    rows = [r for r in records if r["kind"] == kind]
    prompts = sorted({r["prompt"] for r in rows})
    per: dict[str, Any] = {}
    for name in names:
      def med(fn):
        return statistics.median(
            statistics.median(fn(r) for r in rows if r["prompt"] == p) for p in prompts)
      per[name] = {
          "speedup_over_target": med(lambda r: r[name]["tok_s"] / r["target"]["tok_s"]),
          "over_first_paired": med(lambda r: r[name]["tok_s"] / r[names[0]]["tok_s"]),
          "acceptance": med(lambda r: r[name]["acceptance"]),
          "tokens_per_round": med(lambda r: r[name]["tokens_per_round"]),
          "ids_equal_target": sum(r[name]["ids"] == r["target"]["ids"] for r in rows),
          "records": len(rows)}
    out[kind] = per
  return out


def settings(thresholds: Sequence[float], caps: Sequence[int],
             fixed: Sequence[int]) -> dict[str, dict[str, Any]]:
  """Each configuration's name and its `jspec.generate` options, target-only first.

  Args:
    thresholds: the confidence policy's `min_confidence` values.
    caps: its caps (`gamma`); names carry the cap unless it is only the default's.
    fixed: fixed gammas run beside them.

  Returns:
    {"target": {...}, "c0.5" or "c0.5_g8": {...}, ..., "fixed2": {...}, ...}.
  """
  out: dict[str, dict[str, Any]] = {"target": {"method": "target"}}
  for g in caps:
    for t in thresholds:
      name = f"c{t:g}" + (f"_g{g}" if list(caps) != [options.DEFAULT_GAMMA["confidence"]] else "")
      out[name] = {"min_confidence": t, "gamma": g}
  for g in fixed:
    out[f"fixed{g}"] = {"policy": "fixed", "gamma": g}
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the sweep, writes the JSON after every repetition, prints the summary.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0, or 1 where some ids differ from target-only's.
  """
  ap = argparse.ArgumentParser(prog="python -m bench.tools.confidence_sweep",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--thresholds", default="0.5,0.65,0.8")
  ap.add_argument("--gammas", default=str(options.DEFAULT_GAMMA["confidence"]),
                  help="the confidence policy's caps (default: the default's)")
  ap.add_argument("--fixed", default="", help="fixed gammas to run beside them")
  ap.add_argument("--prompts", default="code,chat")
  ap.add_argument("--max-new-tokens", type=int, default=96)
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--temperature", type=float, default=0.0,
                  help="0 (greedy, the default) or a sampling temperature; sampling runs seed 0, "
                       "and its ids are not expected to equal target-only's")
  ap.add_argument("--out", type=pathlib.Path,
                  default=pathlib.Path("bench/results/confidence_sweep_cpu.json"))
  args = ap.parse_args(argv)
  try:
    thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
  except ValueError:
    ap.error(f"--thresholds {args.thresholds!r}: expected comma-separated numbers in [0, 1]")
  if not thresholds or not all(0.0 <= t <= 1.0 for t in thresholds):
    ap.error(f"--thresholds {args.thresholds!r}: expected comma-separated numbers in [0, 1]")
  try:
    caps = [int(g) for g in args.gammas.split(",") if g.strip()]
    fixed = [int(g) for g in args.fixed.split(",") if g.strip()]
    bad = not caps or not all(1 <= g <= options.MAX_GAMMA for g in caps + fixed)
  except ValueError:
    bad = True
  if bad:
    ap.error(f"--gammas {args.gammas!r} / --fixed {args.fixed!r}: expected comma-separated "
             f"integers in [1, {options.MAX_GAMMA}]")
  if args.reps < 1 or args.max_new_tokens < 2:
    ap.error("--reps must be at least 1 and --max-new-tokens at least 2")
  try:
    options.Options(temperature=args.temperature)
  except ValueError as e:
    ap.error(f"--temperature: {e}")
  chosen = prompts_lib.select(prompts_lib.SUITE, args.prompts)
  bundle = jspec.load(progress=False)
  ids = {p.name: prompts_lib.encode(p, bundle.tokenizer) for p in chosen}
  n = args.max_new_tokens
  configs = {name: lambda x, kw=kw: _run(bundle, x, n, args.temperature, **kw)
             for name, kw in settings(thresholds, caps, fixed).items()}
  doc: dict[str, Any] = {"command": "python -m bench.tools.confidence_sweep "
                                    + " ".join(argv if argv is not None else sys.argv[1:]),
                         "thresholds": thresholds, "gammas": caps, "fixed": fixed,
                         "temperature": args.temperature}
  return compare(configs, chosen, ids, args.reps, args.out, doc,
                 check_ids=args.temperature == 0.0)


def compare(configs: dict[str, Callable[[list[int]], dict[str, Any]]],
            chosen: Sequence[Any], ids: dict[str, list[int]], reps: int, out: pathlib.Path,
            doc: dict[str, Any], check_ids: bool = True) -> int:
  """Runs configurations on each prompt in a rotated order, writes and prints the summary.

  The first run of the first prompt compiles every configuration's programs
  (untimed); then per repetition and prompt the configurations run in an
  order rotated by both, so that host drift falls on all alike.

  Args:
    configs: name -> run of a prompt's ids (`_run`); "target" first, the
      paired ratios' reference next.
    chosen: the prompts (`bench.prompts.Prompt`).
    ids: each prompt's token ids by name.
    reps: repetitions.
    out: the JSON written after every repetition.
    doc: the document to fill ("records", "summary").
    check_ids: whether every configuration's ids must equal target-only's
      (greedy); sampled runs draw other tokens, and only the counts are compared.

  Returns:
    0, or 1 where ids should and some differ from target-only's.
  """
  names = [name for name in configs if name != "target"]
  for p in chosen[:1]:
    for run in configs.values():
      run(ids[p.name])
  records: list[dict[str, Any]] = []
  for rep in range(reps):
    for i, p in enumerate(chosen):
      order = list(configs)
      shift = (rep + i) % len(order)
      order = order[shift:] + order[:shift]
      rec: dict[str, Any] = {"prompt": p.name, "kind": p.kind, "rep": rep, "order": order}
      for name in order:
        rec[name] = configs[name](ids[p.name])
      records.append(rec)
      print(f"rep {rep} {p.name}: " + ", ".join(
          f"{k} {rec[k]['tok_s']:.2f}" for k in configs), flush=True)
    doc.update(records=records, summary=summarize(records, names))
    results.write(doc, out)
  for kind, per in doc["summary"].items():
    for name, s in per.items():
      print(f"{kind} {name}: x target {s['speedup_over_target']:.3f}, over {names[0]} "
            f"{s['over_first_paired']:.3f}, acceptance {s['acceptance']:.3f}, tokens/round "
            f"{s['tokens_per_round']:.2f}, ids equal {s['ids_equal_target']}/{s['records']}")
  equal = not check_ids or all(s["ids_equal_target"] == s["records"]
                               for per in doc["summary"].values() for s in per.values())
  return 0 if equal else 1


if __name__ == "__main__":
  sys.exit(main())
