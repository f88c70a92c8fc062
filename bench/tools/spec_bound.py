"""How fast the default speculative mode could decode on this host: a floor from reads and arithmetic.

    python -m bench.tools.spec_bound RESULTS [--mode confidence] [--kind code] [--reps 3]
                                     [--out bench/results/spec_bound_cpu.json]

Issue 33 asks jspec's default speculative mode to decode at 1.5x llama.cpp's
plain decode and 2x its speculative decode of the same GGUF files. RESULTS is
a `python -m bench` document of this host with the jspec mode `--mode` and the
llama.cpp peers (`llamacpp_target`, `llamacpp_spec`) on the prompts of
`--kind`. From it the tool takes, per prompt, the acceptance the real pair
reached (drafts proposed and accepted, rounds, tokens per round) and the
llama.cpp decode tokens/s, and from its `models` the bytes a forward of the
target and of the draft reads. It then measures the host's fastest float32
multiply-add rate (`serve_bound`'s register FMA loop and XLA product, best of
`--reps` x 5), and takes as the read rate the fastest seen anywhere in the run:
the bench's bandwidth probe, any jspec record's achieved read rate, and the
rate llama.cpp's own plain decode implies (its GGUF's tensors, less the token
table it reads by rows, per decoded token).

An exact jspec forward of T positions must read its weights once and multiply
every weight once per position in float32, so it takes at least

  v(T) = max(bytes / read rate, T x multiply-adds / FMA rate)

and a draft step at least d = v_draft(1). Per prompt the floor of the decode
rate is the higher of

  as_run   the measured policy's tokens per round over (drafts per round x d +
           v(drafts per round + 1)); v is convex, so the mean draft count
           gives a time no higher than the rounds' own (a true floor);
  best_g   the best fixed draft length g for the measured acceptance a,
           drafts accepted independently: (1 - a^(g+1)) / (1 - a) tokens
           over g x d + v(g + 1);

and `perfect` is best_g at a = 1. Attention, norms, sampling and the loop are
left out, so the true ceiling is lower still. The summary compares the
medians with 1.5x llama.cpp's plain and 2x its speculative decode, and finds
the draft step (as a fraction of a target step's floor) at which best_g
would reach the first. Every figure but the FMA rate comes from RESULTS: run
the tool right after the bench, on the same host.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from typing import Any, Callable, Optional, Sequence

from bench import results
from bench.tools import serve_bound

PLAIN_TARGET = 1.5  # issue 33: the default at 1.5x llama.cpp's plain decode
SPEC_TARGET = 2.0  # and 2x its speculative decode
MAX_DRAFTS = 32  # fixed draft lengths tried by best_g


def macs_per_token(cfg: dict[str, Any]) -> int:
  """Multiply-adds per token through a model's layers and head.

  Args:
    cfg: a `models.<role>.config` of a bench document.

  Returns:
    The count (attention scores left out).
  """
  d, f = cfg["hidden_size"], cfg["intermediate_size"]
  qo, kv = cfg["num_heads"] * cfg["head_dim"], cfg["num_kv_heads"] * cfg["head_dim"]
  return cfg["num_layers"] * (2 * d * qo + 2 * d * kv + 3 * d * f) + d * cfg["vocab_size"]


def forward_floor(nbytes: float, macs: float, read: float, fma: float) -> Callable[[float], float]:
  """v(T): the least seconds a forward of T positions takes, reads and multiply-adds.

  Args:
    nbytes: bytes the forward reads once.
    macs: multiply-adds per position.
    read: bytes/s.
    fma: multiply-adds/s.

  Returns:
    The function of T.
  """
  return lambda t: max(nbytes / read, t * macs / fma)


def expected_tokens(accept: float, drafts: int) -> float:
  """Tokens a round yields with `drafts` drafts, each accepted with probability `accept` in turn."""
  if accept >= 1.0:
    return drafts + 1.0
  return (1.0 - accept ** (drafts + 1)) / (1.0 - accept)


def best_fixed(accept: float, draft_s: float, verify: Callable[[float], float]) -> tuple[float, int]:
  """The fastest fixed draft length's floor.

  Args:
    accept: per-draft acceptance.
    draft_s: a draft step's floor, seconds.
    verify: v(T) of the target.

  Returns:
    (tokens/s, the draft length reaching it).
  """
  rates = [(expected_tokens(accept, g) / (g * draft_s + verify(g + 1)), g)
           for g in range(1, MAX_DRAFTS + 1)]
  return max(rates)


def prompt_floor(rec: dict[str, Any], draft_s: float,
                 verify: Callable[[float], float]) -> dict[str, Any]:
  """One prompt's floors from its jspec speculative record.

  Args:
    rec: the mode's record (`rounds`, `drafted`, `accepted`, `mean_tokens_per_round`).
    draft_s: a draft step's floor, seconds.
    verify: v(T) of the target.

  Returns:
    {"acceptance", "drafts_per_round", "tokens_per_round", "as_run",
    "best_g", "best_g_drafts", "floor"} (tokens/s).
  """
  rounds, drafted, accepted = rec["rounds"], rec["drafted"], rec["accepted"]
  if not rounds or not drafted:
    raise ValueError("a speculative record without rounds or drafts: expected the jspec "
                     "speculative mode's record (rounds, drafted, accepted)")
  g = drafted / rounds
  tau = rec["mean_tokens_per_round"]
  as_run = tau / (g * draft_s + verify(g + 1))
  accept = accepted / drafted
  best, best_g = best_fixed(accept, draft_s, verify)
  return {"acceptance": accept, "drafts_per_round": g, "tokens_per_round": tau,
          "as_run": as_run, "best_g": best, "best_g_drafts": best_g, "floor": max(as_run, best)}


def llamacpp_read_rate(doc: dict[str, Any], plain_tok_s: float) -> Optional[float]:
  """Bytes/s llama.cpp's plain decode implies: its GGUF's tensors but the token table, per token.

  Args:
    doc: the bench document (its `models.target.path`, a GGUF file).
    plain_tok_s: llama.cpp's plain decode tokens/s.

  Returns:
    The rate, or None where the file cannot be read here.
  """
  path = pathlib.Path(doc["models"]["target"].get("path") or "")
  if path.suffix != ".gguf" or not path.is_file():
    return None
  import gguf  # pylint: disable=import-outside-toplevel

  reader = gguf.GGUFReader(str(path))
  nbytes = sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")
  return nbytes * plain_tok_s


def bound(doc: dict[str, Any], mode: str, kind: str, fma: float,
          read_probe: Optional[float] = None) -> dict[str, Any]:
  """The floors of every prompt of `kind` and their summary.

  Args:
    doc: a `python -m bench` document with `mode` and the llama.cpp peers.
    mode: the jspec speculative mode.
    kind: the prompts' kind ("code", "chat", "edit").
    fma: the host's fastest multiply-adds/s.
    read_probe: a read rate measured beside it (bytes/s), or None.

  Returns:
    {"read_bytes_per_s", "read_from", "fma_macs_per_s", "prompts": {...}, "summary": {...}}.

  Raises:
    ValueError: no prompt of `kind` holds `mode` and llama.cpp's plain decode.
  """
  models = doc["models"]
  t_bytes, d_bytes = models["target"]["forward_bytes"], models["draft"]["forward_bytes"]
  t_macs, d_macs = macs_per_token(models["target"]["config"]), macs_per_token(models["draft"]["config"])
  chosen = {name: p for name, p in doc["prompts"].items()
            if p["kind"] == kind and mode in p["modes"] and "llamacpp_target" in p["modes"]}
  if not chosen:
    raise ValueError(f"no {kind} prompt in the results holds both {mode!r} and llamacpp_target: "
                     "expected a `python -m bench --modes target,"
                     f"{mode},llamacpp_target,llamacpp_spec` run")
  plain = {n: p["modes"]["llamacpp_target"]["decode_tokens_per_s"] for n, p in chosen.items()}
  reads = {"bench_probe": doc.get("bandwidth", {}).get("gbs", 0.0) * 1e9,
           "jspec_records": max((r.get("achieved_gbs") or 0.0) * 1e9 for p in chosen.values()
                                for r in p["modes"].values() if r.get("engine") == "jspec"),
           "llamacpp_plain": llamacpp_read_rate(doc, max(plain.values())) or 0.0,
           "probe_here": read_probe or 0.0}
  read_from = max(reads, key=reads.get)
  read = reads[read_from]
  verify = forward_floor(t_bytes, t_macs, read, fma)
  draft_s = forward_floor(d_bytes, d_macs, read, fma)(1)
  rows = {}
  for name, p in chosen.items():
    row = prompt_floor(p["modes"][mode], draft_s, verify)
    row["measured"] = p["modes"][mode].get("decode_tokens_per_s")
    row["llamacpp_plain"] = plain[name]
    row["llamacpp_spec"] = p["modes"].get("llamacpp_spec", {}).get("decode_tokens_per_s")
    rows[name] = row
  med = lambda key: statistics.median(r[key] for r in rows.values() if r[key] is not None)
  want = PLAIN_TARGET * med("llamacpp_plain")
  # The draft step (a fraction of the target step's floor) at which best_g's median reaches `want`.
  step = verify(1)

  def median_at(fraction: float) -> float:
    return statistics.median(best_fixed(r["acceptance"], fraction * step, verify)[0]
                             for r in rows.values())

  needed = None
  if median_at(0.0) >= want:
    lo, hi = 0.0, draft_s / step
    if median_at(hi) >= want:
      needed = hi
    else:
      for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if median_at(mid) >= want else (lo, mid)
      needed = lo
  perfect = best_fixed(1.0, draft_s, verify)
  spec_med = (med("llamacpp_spec")
              if any(r["llamacpp_spec"] is not None for r in rows.values()) else None)
  summary = {
      "prompts": len(rows),
      "target_step_floor_s": step, "draft_step_floor_s": draft_s,
      "draft_step_floor_over_target_step": draft_s / step,
      "target_only_floor_tok_s": 1.0 / step,
      "floor_tok_s": med("floor"), "as_run_tok_s": med("as_run"), "best_g_tok_s": med("best_g"),
      "perfect_draft_tok_s": perfect[0], "perfect_draft_drafts": perfect[1],
      "measured_tok_s": med("measured") if any(r["measured"] for r in rows.values()) else None,
      "llamacpp_plain_tok_s": med("llamacpp_plain"), "llamacpp_spec_tok_s": spec_med,
      "floor_over_llamacpp_plain": med("floor") / med("llamacpp_plain"),
      "floor_over_llamacpp_spec": med("floor") / spec_med if spec_med else None,
      "target_over_llamacpp_plain": PLAIN_TARGET, "target_over_llamacpp_spec": SPEC_TARGET,
      # None: even a free draft at this acceptance would not reach 1.5x plain.
      "draft_step_needed_over_target_step": needed,
  }
  return {"read_bytes_per_s": read, "read_from": read_from, "reads": reads,
          "fma_macs_per_s": fma, "target_forward_bytes": t_bytes, "draft_forward_bytes": d_bytes,
          "target_macs_per_token": t_macs, "draft_macs_per_token": d_macs,
          "prompts": rows, "summary": summary}


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Measures the FMA rate, prints the bound and writes it as JSON.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0, or 2 for results that lack what the bound needs.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.spec_bound", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("results", type=pathlib.Path, help="a python -m bench results JSON")
  parser.add_argument("--mode", default="confidence", help="the jspec speculative mode")
  parser.add_argument("--kind", default="code", choices=("code", "chat", "edit"))
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path("bench/results/spec_bound_cpu.json"))
  args = parser.parse_args(argv)
  if args.reps < 1:
    parser.error("--reps must be at least 1")
  try:
    doc = results.load(args.results)
  except (OSError, ValueError) as e:
    print(f"spec_bound: cannot read {args.results}: {e}", file=sys.stderr)
    return 2
  loop = serve_bound.fma_loop_macs_per_s(args.reps)
  xla = serve_bound.roof_macs_per_s(args.reps)
  fma = max(xla["best"], loop["best"] if loop else 0.0)
  try:
    out = bound(doc, args.mode, args.kind, fma)
  except (KeyError, ValueError) as e:
    print(f"spec_bound: {args.results}: {e}", file=sys.stderr)
    return 2
  out["fma_loop"], out["xla_product"] = loop, xla
  out["command"] = "python -m bench.tools.spec_bound " + " ".join(argv or sys.argv[1:])
  out["results"] = str(args.results)
  results.write(out, args.out)
  s = out["summary"]
  print(f"read {out['read_bytes_per_s'] / 1e9:.1f} GB/s ({out['read_from']}), "
        f"FMA {fma / 1e9:.1f} G/s; floors: target step {s['target_step_floor_s'] * 1e3:.1f} ms, "
        f"draft step {s['draft_step_floor_s'] * 1e3:.1f} ms")
  needed = s["draft_step_needed_over_target_step"]
  if needed is None:
    reach = "not even with a free draft at this acceptance"
  elif needed >= s["draft_step_floor_over_target_step"]:
    reach = "the current draft's step is enough at the floors"
  else:
    reach = f"a draft step of at most {needed:.3f} target steps"
  print(f"{args.kind} medians, tok/s: floor {s['floor_tok_s']:.1f} (perfect draft "
        f"{s['perfect_draft_tok_s']:.1f}), measured {s['measured_tok_s']:.1f}, llama.cpp plain "
        f"{s['llamacpp_plain_tok_s']:.1f} -> floor {s['floor_over_llamacpp_plain']:.2f}x "
        f"(target {PLAIN_TARGET}x): {reach}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
