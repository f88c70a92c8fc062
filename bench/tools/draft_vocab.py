"""The frequency-ranked draft vocabulary (`--draft-vocab K`) or the 4-bit draft against the whole-head draft, one process.

    python -m bench.tools.draft_vocab [--k 16384,32768,65536] [--draft-int4]
        [--prompts code,chat] [--max-new-tokens 128] [--reps 2] [--step-reps 30]
        [--out bench/results/draft_vocab_ranked_cpu.json]

Loads the default pair once, and the same draft restricted to each K
(`jspec.Settings(draft_vocab=K)`) beside the same target; with
`--draft-int4` also the draft in 4 bits (`jspec.Settings(draft_int4=True)`),
with its whole head as "int4" and restricted to each K as "int4_kK" (`--k ""`
for "int4" alone), and with `--int4-head` the int8 draft with only its head
taken from the 4-bit one (the table too where tied), named "int4_head" (a
measurement: no setting loads it). "full" and "kK" are the int8 draft
(`draft_int4=False`), "full" with its whole head (`draft_vocab=0`): every
ratio "over_full" is over it. Measures, all
greedy and alternated within each repetition so that host drift falls on
every configuration alike:

  step      one draft forward of one token (the draft's step, params passed
            as arguments), each draft in turn, and the target's greedy step;
            then one row through each draft's matrices alone (every layer's
            and the head) and through its head alone; medians over
            `--step-reps`;
  suite     for each prompt: target-only, then the default speculative mode
            with the full draft and with each K, in a rotated order;
            acceptance, tokens per round, decode tokens/s, the speedup over
            target-only and whether the ids equal target-only's;
  coverage  the share of the target's greedy tokens on the prompts that
            fall inside each K's subset.

Writes the JSON (atomically) after every repetition and prints a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from bench import prompts as prompts_lib
from convert import store
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import decode
from jspec import model
from jspec import weights

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results" / "draft_vocab_ranked_cpu.json"


def _step_seconds(models: dict[str, bundle_lib.Model], reps: int, greedy: dict[str, bool]
                  ) -> dict[str, float]:
  """Median seconds of one one-token forward of each model, alternated over `reps` rounds.

  Args:
    models: name -> prepared model.
    reps: timed rounds (after one untimed, compiling, call each).
    greedy: name -> whether the forward is a greedy one (the target's step).

  Returns:
    name -> median seconds.
  """
  fns, caches = {}, {}
  for name, m in models.items():
    arch = m.arch
    fns[name] = jax.jit(lambda p, t, c, arch=arch, g=greedy[name]: model.forward(
        arch, p, t, c, greedy=g)[0])
    caches[name] = cache_lib.with_lengths(cache_lib.init(m.cfg, 1, 512),
                                          jnp.full((1,), 200, jnp.int32))
  tokens = jnp.asarray([[198]], jnp.int32)
  for name, m in models.items():
    jax.block_until_ready(fns[name](m.params, tokens, caches[name]))
  times: dict[str, list[float]] = {n: [] for n in models}
  for _ in range(reps):
    for name, m in models.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name](m.params, tokens, caches[name]))
      times[name].append(time.perf_counter() - t0)
  return {n: statistics.median(v) for n, v in times.items()}


def _product_seconds(models: dict[str, bundle_lib.Model], reps: int) -> dict[str, dict[str, float]]:
  """Median seconds of one row through each model's matrices alone, alternated over `reps` rounds.

  Args:
    models: name -> prepared draft.
    reps: timed rounds (after one untimed, compiling, call each).

  Returns:
    name -> {"all": every layer's matrices and the head (a tied table
    once, as the head; an untied model's table, which a step only reads by
    rows, not), "head": the head alone}.
  """
  fns = {}
  for name, m in models.items():
    skip = ("vocab_head", "greedy_head") + (() if m.cfg.tie_word_embeddings else ("embed",))
    mats = [w for w in jax.tree.leaves({k: v for k, v in m.params.items() if k not in skip},
                                       is_leaf=weights.is_leaf) if weights.is_leaf(w)]
    head = model.head_of(model.merge(m.cfg, m.params))
    for part, ws in (("all", mats), ("head", [head])):
      fns[(name, part)] = (jax.jit(lambda ws, x: [weights.dot(x[:, :w.shape[0]], w) for w in ws]),
                           ws)
  x = jnp.ones((1, max(w.shape[0] for _, ws in fns.values() for w in ws)), jnp.float32)
  for fn, ws in fns.values():
    jax.block_until_ready(fn(ws, x))
  times: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
  for _ in range(reps):
    for key, (fn, ws) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(ws, x))
      times[key].append(time.perf_counter() - t0)
  out: dict[str, dict[str, float]] = {}
  for (name, part), v in times.items():
    out.setdefault(name, {})[part] = statistics.median(v)
  return out


def _summary(records: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
  """Per kind and configuration: medians of the per-prompt ratios and of the round figures."""
  out: dict[str, Any] = {}
  for kind in sorted({r["kind"] for r in records}):
    rows = [r for r in records if r["kind"] == kind]
    per: dict[str, Any] = {}
    for name in names:
      runs = [r["runs"][name] for r in rows if name in r["runs"]]
      base = [r["runs"]["target"]["decode_tok_s"] for r in rows if name in r["runs"]]
      full = [r["runs"]["full"]["decode_tok_s"] for r in rows if name in r["runs"]]
      per[name] = {
          "speedup_over_target": statistics.median(x["decode_tok_s"] / b for x, b in zip(runs, base)),
          "over_full_draft": statistics.median(x["decode_tok_s"] / f for x, f in zip(runs, full)),
          "over_full_draft_paired": statistics.median(x["over_full_paired"] for x in runs),
          "decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs),
          "acceptance": statistics.median(x.get("acceptance", 1.0) for x in runs),
          "tokens_per_round": statistics.median(x["tokens_per_round"] for x in runs),
          "ids_equal_target": sum(x["ids_equal_target"] for x in runs), "records": len(runs)}
    out[kind] = per
  return out


def main(argv=None) -> int:
  """Runs the comparison and writes the JSON.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.draft_vocab", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--k", default="16384,32768,65536",
                      help="comma-separated K values (\"\" for none, with --draft-int4)")
  parser.add_argument("--draft-int4", action="store_true",
                      help="also the draft in 4 bits (jspec.Settings(draft_int4=True)), as \"int4\" "
                      "and at each K as \"int4_kK\"")
  parser.add_argument("--int4-head", action="store_true",
                      help="with --draft-int4, also the default draft with the 4-bit draft's "
                      "head, as \"int4_head\"")
  parser.add_argument("--prompts", default="code,chat",
                      help="suite prompts by name or kind (bench.prompts.select)")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--step-reps", type=int, default=30)
  parser.add_argument("--out", default=str(RESULTS))
  args = parser.parse_args(argv)
  try:
    ks = [int(k) for k in args.k.split(",") if k.strip()]
    chosen = prompts_lib.select(prompts_lib.SUITE, args.prompts)
  except ValueError as e:
    parser.error(str(e))
  if ((not ks and not args.draft_int4) or any(k < 1 for k in ks) or args.reps < 1
      or args.max_new_tokens < 2):
    parser.error("--k needs positive ints (or none, with --draft-int4); --reps at least 1; "
                 "--max-new-tokens at least 2")
  if args.int4_head and not args.draft_int4:
    parser.error("--int4-head needs --draft-int4")

  t0 = time.perf_counter()
  # Each draft's storage is named, not the default's: the int8 draft, or with
  # --draft-int4 the 4-bit one.
  full = jspec.load(progress=False, settings=jspec.Settings(draft_vocab=0, draft_int4=False))
  bundles = {"full": full}
  for k in ks:
    cut = jspec.load(progress=False, settings=jspec.Settings(draft_vocab=k, draft_int4=False))
    bundles[f"k{k}"] = bundle_lib.Bundle(full.target, cut.draft, full.tokenizer)
  if args.draft_int4:
    int4 = jspec.load(progress=False, settings=jspec.Settings(draft_int4=True, draft_vocab=0))
    bundles["int4"] = bundle_lib.Bundle(full.target, int4.draft, full.tokenizer)
    for k in ks:
      cut = jspec.load(progress=False, settings=jspec.Settings(draft_int4=True, draft_vocab=k))
      bundles[f"int4_k{k}"] = bundle_lib.Bundle(full.target, cut.draft, full.tokenizer)
    if args.int4_head:  # the int8 layers, the 4-bit head: where the 4-bit form gains
      params = dict(full.draft.params)
      if full.draft.cfg.tie_word_embeddings:
        params["embed"] = {**params["embed"], "table": int4.draft.params["embed"]["table"]}
      else:
        params["head"] = {**params["head"], "w": int4.draft.params["head"]["w"]}
      bundles["int4_head"] = bundle_lib.Bundle(
          full.target, dataclasses.replace(full.draft, params=params), full.tokenizer)
  load_s = time.perf_counter() - t0
  names = list(bundles)
  subsets = {n: set(np.asarray(b.draft.params["vocab_ids"]).tolist())
             for n, b in bundles.items() if b.draft.params.get("vocab_head") is not None}

  models = {"target": full.target, **{n: b.draft for n, b in bundles.items()}}
  step = _step_seconds(models, args.step_reps, {n: n == "target" for n in models})
  step_out = {"target_step_s": step["target"],
              **{f"{n}_draft_step_s": step[n] for n in names},
              **{f"{n}_draft_over_target": step[n] / step["target"] for n in names},
              **{f"{n}_draft_step_over_full": step[n] / step["full"] for n in names},
              **{f"{n}_draft_bytes": weights.nbytes(b.draft.params) for n, b in bundles.items()},
              "target_bytes": weights.nbytes(full.target.params)}
  products = _product_seconds({n: b.draft for n, b in bundles.items()}, args.step_reps)
  step_out.update({f"{n}_products_{part}_s": s for n, parts in products.items()
                   for part, s in parts.items()})
  print(json.dumps({"step": step_out}, indent=1), flush=True)

  kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0)
  encoded = {p.name: prompts_lib.encode(p, full.tokenizer) for p in chosen}
  # Compile every program once, untimed: programs are shared by the prompts of one buffer width.
  seen = set()
  for p in chosen:
    width = decode.buffer_width(len(encoded[p.name]), args.max_new_tokens, 8)
    if width not in seen:
      seen.add(width)
      jspec.generate(full, encoded[p.name], method="target", **kw)
      for b in bundles.values():
        jspec.generate(b, encoded[p.name], **kw)
  records = {p.name: {"name": p.name, "kind": p.kind, "reps": []} for p in chosen}
  result: dict[str, Any] = {}
  for rep in range(args.reps):
    for i, p in enumerate(chosen):
      ids = encoded[p.name]
      order = names[(i + rep) % len(names):] + names[:(i + rep) % len(names)]
      runs = {}
      base = jspec.generate(full, ids, method="target", **kw)
      runs["target"] = {"decode_tok_s": (base.stats["new_tokens"] - 1) / base.stats["decode_s"],
                        "tokens_per_round": 1.0, "ids_equal_target": True}
      for name in order:
        r = jspec.generate(bundles[name], ids, **kw)
        runs[name] = {"decode_tok_s": (r.stats["new_tokens"] - 1) / r.stats["decode_s"],
                      "acceptance": r.stats["acceptance_rate"],
                      "tokens_per_round": r.stats["mean_tokens_per_round"],
                      "ids_equal_target": r.token_ids == base.token_ids}
      records[p.name]["reps"].append(runs)
      records[p.name]["target_ids"] = base.token_ids
      line = " ".join(f"{n} {runs[n]['decode_tok_s']:.2f}/{runs[n].get('acceptance', 1):.2f}"
                      for n in ["target", *names])
      print(f"rep {rep} {p.name}: tok/s/acceptance {line}", flush=True)
    # Per prompt, the median over repetitions of each figure.
    flat = []
    for rec in records.values():
      runs = {}
      for n in ["target", *names]:
        xs = [r[n] for r in rec["reps"]]
        runs[n] = {k: (statistics.median(x[k] for x in xs) if k != "ids_equal_target"
                       else all(x[k] for x in xs)) for k in xs[0]}
        # Within each repetition against the full draft run beside it: host drift cancels.
        runs[n]["over_full_paired"] = statistics.median(
            r[n]["decode_tok_s"] / r["full"]["decode_tok_s"] for r in rec["reps"])
      flat.append({"name": rec["name"], "kind": rec["kind"], "runs": runs})
    coverage = {}
    for n, keep in subsets.items():
      by_kind: dict[str, list[int]] = {}
      for rec in records.values():
        by_kind.setdefault(rec["kind"], []).extend(t in keep for t in rec["target_ids"])
      coverage[n] = {k: float(np.mean(v)) for k, v in by_kind.items()}
      coverage[n]["all"] = float(np.mean([x for v in by_kind.values() for x in v]))
      coverage[n]["size"] = len(keep)
    result = {"command": "python -m bench.tools.draft_vocab " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "argv": vars(args), "load_s": load_s, "reps_done": rep + 1, "step": step_out,
              "coverage": coverage, "summary": _summary(flat, names), "prompts": flat,
              "raw": list(records.values()),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    text = json.dumps(result, indent=1)
    store.write_file_atomic(pathlib.Path(args.out), lambda tmp: pathlib.Path(tmp).write_text(text))
  print(json.dumps({"coverage": result["coverage"], "summary": result["summary"]}, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
