"""The compact target end to end: exact storage against float32, and llama.cpp, in one run.

Loads the default pair twice, once with the target stored exactly as its
GGUF holds it (int8 blocks; `jspec.load`'s CPU default) and once widened to
float32, and alternates on each prompt: target-only and the default
speculative method with each target, then llama.cpp's plain decode and its
speculative decode of the same GGUF files (when its tools are built,
`python -m bench.llamacpp`). Each repetition runs every engine once, in a
rotated order, so that the host's swings fall on all of them alike; figures
are medians of decode tokens/s (prefill excluded for jspec; llama.cpp's own
eval figure). It also checks that the two storages give the same greedy ids.

  python -m bench.tools.compact_e2e --prompts code --max-new-tokens 128 --reps 2 \\
      --out bench/results/compact_e2e.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import jspec
from bench import llamacpp
from bench import memory
from bench import prompts as prompts_lib
from jspec import fetch


def _jspec_run(bundle: jspec.Bundle, ids: list[int], n: int, method: str) -> dict[str, Any]:
  """One greedy generation, timed by jspec's own stats."""
  r = jspec.generate(bundle, ids, max_new_tokens=n, method=method, stop_at_eos=True)
  s = r.stats
  return {"ids": r.token_ids, "n": len(r.token_ids), "decode_s": s["decode_s"],
          "tok_s": len(r.token_ids) / s["decode_s"] if s["decode_s"] > 0 else None,
          "tokens_per_round": s.get("mean_tokens_per_round")}


def _median(xs):
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


def main(argv: Optional[list[str]] = None) -> int:
  """Runs the comparison and prints a table. Returns the exit status (1: ids differ)."""
  ap = argparse.ArgumentParser(prog="python -m bench.tools.compact_e2e",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--prompts", default="code", help="as for python -m bench (default: code)")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--draft-max", type=int, default=8, help="llama.cpp --spec-draft-n-max")
  ap.add_argument("--no-llamacpp", action="store_true")
  ap.add_argument("--out", type=pathlib.Path, default=None)
  args = ap.parse_args(argv)
  chosen = prompts_lib.select(prompts_lib.SUITE, args.prompts)

  t0 = time.perf_counter()
  exact = jspec.load(progress=False)  # the CPU default: the target as its GGUF stores it
  load_exact_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  wide = jspec.load(dtype="float32", progress=False)
  load_f32_s = time.perf_counter() - t0
  bundles = {"exact": exact, "float32": wide}
  fwd = {k: memory.forward_bytes(b.target.cfg, b.target.params) for k, b in bundles.items()}
  tools = None if args.no_llamacpp else llamacpp.find_built()
  env = {"OMP_WAIT_POLICY": "PASSIVE"}
  target_gguf = fetch.assemble(fetch.get_source(llamacpp.TARGET_MODEL))
  draft_gguf = fetch.assemble(fetch.get_source(llamacpp.DRAFT_MODEL))

  engines: dict[str, Callable[[Any], dict[str, Any]]] = {}
  for storage, b in bundles.items():
    for method in ("target", "model"):
      engines[f"jspec_{method}_{storage}"] = (
          lambda p, b=b, m=method: _jspec_run(b, p["ids"], args.max_new_tokens, m))
  if tools is not None:
    engines["llamacpp_target"] = lambda p: llamacpp.generate(
        tools, target_gguf, p["text"], args.max_new_tokens, 2, env=env)
    engines["llamacpp_spec"] = lambda p: llamacpp.generate(
        tools, target_gguf, p["text"], args.max_new_tokens, 2, draft_gguf, args.draft_max,
        env=env)

  doc: dict[str, Any] = {"kind": "compact_e2e", "date": time.strftime("%Y-%m-%d"),
                         "argv": sys.argv, "load_s": {"exact": load_exact_s, "float32": load_f32_s},
                         "forward_bytes": fwd, "llamacpp": tools is not None,
                         "llamacpp_draft_max": args.draft_max, "prompts": {}}
  names = list(engines)
  same = True
  for p in chosen:
    item = {"text": llamacpp.prompt_text(p, exact.tokenizer)}
    item["ids"] = prompts_lib.encode(p, exact.tokenizer)
    for name in names:  # compile (jspec) and warm the page cache (llama.cpp)
      if name.startswith("jspec"):
        engines[name](item)
    runs: dict[str, list] = {n: [] for n in names}
    for rep in range(args.reps):
      order = names[rep % len(names):] + names[:rep % len(names)]
      for name in order:
        runs[name].append(engines[name](item))
    rec = {}
    for name, rs in runs.items():
      tok_s = [r.get("tok_s", r.get("tok_s_reported")) for r in rs]
      rec[name] = {"tok_s": _median(tok_s), "runs": tok_s, "n_tokens": rs[0].get("n", rs[0].get("n_tokens")),
                   "tokens_per_round": rs[0].get("tokens_per_round")}
    ids = {n: runs[n][0]["ids"] for n in names if n.startswith("jspec")}
    rec["ids_equal"] = len({tuple(v) for v in ids.values()}) == 1
    rec["loadavg_1m"] = os.getloadavg()[0]  # other work on a shared host slows every engine
    same &= rec["ids_equal"]
    doc["prompts"][p.name] = rec
    print(p.name, {n: round(rec[n]["tok_s"], 2) for n in names if rec[n]["tok_s"]},
          "ids equal" if rec["ids_equal"] else "IDS DIFFER", file=sys.stderr, flush=True)
    med = {n: _median([r[n]["tok_s"] for r in doc["prompts"].values()]) for n in names}
    doc.update(medians=med, peak_rss_bytes=memory.peak_rss_bytes(), all_ids_equal=same,
               complete=len(doc["prompts"]) == len(chosen))
    if args.out:  # after every prompt: a stopped run keeps the prompts it finished
      _write(doc, args.out)
  med = doc["medians"]
  print(f"\n| engine and mode | decode tok/s (median of {len(chosen)} prompts) | "
        "x float32 target-only |\n|---|---|---|")
  base = med["jspec_target_float32"]
  for n in names:
    ratio = f"{med[n] / base:.2f}" if med[n] and base else "-"
    print(f"| {n} | {med[n]:.2f} | {ratio} |" if med[n] else f"| {n} | - | - |")
  print(f"\ntarget bytes per forward: exact {fwd['exact'] / 1e9:.2f} GB, "
        f"float32 {fwd['float32'] / 1e9:.2f} GB; greedy ids equal across storages and "
        f"methods: {same}")
  return 0 if same else 1


def _write(doc: dict[str, Any], out: pathlib.Path) -> None:
  """Writes the results JSON atomically (a temporary file, then a rename)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as f:
    json.dump(doc, f, indent=1)
  os.chmod(f.name, 0o644)  # as a plain open() would leave it, not mkstemp's 0600
  os.replace(f.name, out)


if __name__ == "__main__":
  sys.exit(main())
