"""The lossy int8 target (`--target-int8`) against the full-precision one: quality and speed, one run.

    python -m bench.tools.target_int8 --max-new-tokens 64 --no-speed \\
        --out bench/results/target_int8_quality_cpu.json
    python -m bench.tools.target_int8 --prompts 3 --max-new-tokens 64 --reps 1 \\
        --out bench/results/target_int8_speed_cpu.json

Loads the default pair twice: the target as jspec stores it by default (the
reference: on CPU its GGUF's own numbers, which are the float32 model's)
and quantized with a scale per output (`jspec.Settings(target_int8=True)`),
each beside the same int8 draft. For every prompt it measures:

  quality  along the reference's greedy path (its own generated tokens),
           from one forward of each target over prompt + path: top-1
           agreement (the int8 target's argmax is the reference's) and the
           mean and largest KL(reference || int8) over those positions;
  speed    decode tokens/s of target-only and of the default speculative
           mode with each target, alternated in a rotated order.

Prints the table and writes the JSON after every prompt.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import model


@functools.partial(jax.jit, static_argnames=("arch",))
def _logits(arch: model.Arch, params: Any, tokens: jax.Array, at: jax.Array) -> jax.Array:
  """[1, T] tokens -> [1, G, V] float32 logits at positions `at` ([1, G]), from an empty cache."""
  cache = cache_lib.init(arch.cfg, 1, tokens.shape[1], jnp.dtype(arch.backend.dtype))
  logits, _ = model.forward(arch, params, tokens, cache, logits_at=at, fresh=True)
  return logits.astype(jnp.float32)


def quality(reference: bundle_lib.Model, other: bundle_lib.Model, ids: list[int], start: int,
            vocab_limit: Optional[int] = None) -> dict[str, Any]:
  """How far `other`'s next-token distributions are from `reference`'s along one sequence.

  Args:
    reference: the full-precision target.
    other: the target compared with it (the same config).
    ids: prompt + the reference's greedy continuation.
    start: the continuation's first index; positions start-1 .. len-2 are scored
      (each predicts the next token).
    vocab_limit: ids at or past it are padding, never chosen (`Bundle.vocab_limit`).

  Returns:
    {"positions", "top1_agreement" (the two argmaxes equal), "reference_follows_path"
    (the reference's argmax is the path's next token: 1.0 but for summation-order
    near-ties), "mean_kl", "max_kl" (KL(reference || other) in nats)}.
  """
  if not 0 < start < len(ids):
    raise ValueError(f"start={start}: expected 0 < start < len(ids) = {len(ids)}")
  tokens = jnp.asarray([ids], jnp.int32)  # [1, T]
  at = jnp.arange(start - 1, len(ids) - 1, dtype=jnp.int32)[None]  # [1, G]
  p = _logits(reference.arch, reference.params, tokens, at)[0]  # [G, V]
  q = _logits(other.arch, other.params, tokens, at)[0]  # [G, V]
  if vocab_limit is not None and vocab_limit < p.shape[-1]:
    keep = jnp.arange(p.shape[-1]) < vocab_limit
    p, q = jnp.where(keep, p, -jnp.inf), jnp.where(keep, q, -jnp.inf)
  logp, logq = jax.nn.log_softmax(p, axis=-1), jax.nn.log_softmax(q, axis=-1)
  kl = jnp.sum(jnp.where(jnp.isfinite(logp), jnp.exp(logp) * (logp - logq), 0.0), axis=-1)  # [G]
  top_p, top_q = jnp.argmax(p, axis=-1), jnp.argmax(q, axis=-1)  # [G]
  nxt = jnp.asarray(ids[start:], jnp.int32)  # [G]
  return {"positions": int(kl.shape[0]),
          "top1_agreement": float(jnp.mean(top_p == top_q)),
          "reference_follows_path": float(jnp.mean(top_p == nxt)),
          "mean_kl": float(jnp.mean(kl)), "max_kl": float(jnp.max(kl))}


def _run(bundle, ids: list[int], n: int, method: str) -> dict[str, Any]:
  """One greedy generation, timed by jspec's own stats (decode only)."""
  import jspec  # pylint: disable=import-outside-toplevel
  r = jspec.generate(bundle, ids, max_new_tokens=n, method=method, stop_at_eos=True)
  s = r.stats
  return {"ids": r.token_ids, "tok_s": len(r.token_ids) / s["decode_s"] if s["decode_s"] > 0
          else None, "tokens_per_round": s.get("mean_tokens_per_round")}


def _median(xs):
  xs = [x for x in xs if x is not None]
  return float(statistics.median(xs)) if xs else None


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text}: expected an integer >= 1")
  return value


def main(argv: Optional[list[str]] = None) -> int:
  """Runs the comparison; prints a table. Returns 0."""
  import jspec  # pylint: disable=import-outside-toplevel
  from bench import memory  # pylint: disable=import-outside-toplevel
  from bench import prompts as prompts_lib  # pylint: disable=import-outside-toplevel
  from bench import results  # pylint: disable=import-outside-toplevel

  ap = argparse.ArgumentParser(prog="python -m bench.tools.target_int8",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--prompts", default=None, help="as for python -m bench (default: all 12)")
  ap.add_argument("--max-new-tokens", type=_positive, default=64)
  ap.add_argument("--reps", type=_positive, default=2, help="timed repetitions (default: 2)")
  ap.add_argument("--no-speed", action="store_true", help="quality only")
  ap.add_argument("--out", type=pathlib.Path, default=None)
  args = ap.parse_args(argv)
  try:
    chosen = prompts_lib.select(prompts_lib.SUITE, args.prompts)
  except ValueError as e:
    ap.error(f"--prompts: {e}")

  ref = jspec.load(progress=False)
  q8 = jspec.load(progress=False, settings=bundle_lib.Settings(target_int8=True))
  bundles = {"reference": ref, "int8": q8}
  doc: dict[str, Any] = {
      "kind": "target_int8", "date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
      "forward_bytes": {k: memory.forward_bytes(b.target.cfg, b.target.params)
                        for k, b in bundles.items()}, "prompts": {}}
  engines = {f"{method}_{name}": (b, method) for name, b in bundles.items()
             for method in ("target", "model")}
  names = list(engines)
  for p in chosen:
    ids = prompts_lib.encode(p, ref.tokenizer)
    path = _run(ref, ids, args.max_new_tokens, "target")["ids"]
    rec: dict[str, Any] = quality(ref.target, q8.target, ids + path, len(ids), ref.vocab_limit)
    rec["kind"] = p.kind
    if not args.no_speed:
      for name in names:  # compile
        b, method = engines[name]
        _run(b, ids, args.max_new_tokens, method)
      runs: dict[str, list] = {n: [] for n in names}
      for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
          b, method = engines[name]
          runs[name].append(_run(b, ids, args.max_new_tokens, method))
      rec["tok_s"] = {n: _median([r["tok_s"] for r in rs]) for n, rs in runs.items()}
      rec["tokens_per_round"] = {n: rs[0]["tokens_per_round"] for n, rs in runs.items()}
      rec["int8_ids_equal_reference"] = runs["target_int8"][0]["ids"] == path
      rec["int8_spec_equals_int8_target"] = (runs["model_int8"][0]["ids"]
                                             == runs["target_int8"][0]["ids"])
    rec["loadavg_1m"] = os.getloadavg()[0]
    doc["prompts"][p.name] = rec
    print(p.name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                   if k not in ("tok_s", "tokens_per_round")}, rec.get("tok_s"),
          file=sys.stderr, flush=True)
    recs = list(doc["prompts"].values())
    doc["summary"] = {
        "top1_agreement": sum(r["top1_agreement"] * r["positions"] for r in recs)
        / sum(r["positions"] for r in recs),
        "mean_kl": sum(r["mean_kl"] * r["positions"] for r in recs)
        / sum(r["positions"] for r in recs),
        "max_kl": max(r["max_kl"] for r in recs),
        "prompts_with_identical_greedy_output": (  # known only where the int8 target ran
            None if args.no_speed else sum(bool(r["int8_ids_equal_reference"]) for r in recs)),
        "prompts_int8_spec_equals_int8_target": (
            None if args.no_speed else sum(bool(r["int8_spec_equals_int8_target"]) for r in recs)),
        "tok_s_median": ({n: _median([r["tok_s"][n] for r in recs]) for n in names}
                         if not args.no_speed else None),
        "peak_rss_bytes": memory.peak_rss_bytes(), "complete": len(recs) == len(chosen)}
    if args.out:
      results.write(doc, args.out)
  s = doc["summary"]
  print(f"\nover {len(chosen)} prompts: top-1 agreement {s['top1_agreement']:.4f}, mean KL "
        f"{s['mean_kl']:.5f} nats (largest {s['max_kl']:.4f}); greedy output identical on "
        f"{s['prompts_with_identical_greedy_output'] if not args.no_speed else '- (not run)'}; "
        f"int8 speculative = int8 target-only on "
        f"{s['prompts_int8_spec_equals_int8_target'] if not args.no_speed else '- (not run)'}; "
        f"target bytes per forward: reference "
        f"{doc['forward_bytes']['reference'] / 1e9:.2f} GB, int8 "
        f"{doc['forward_bytes']['int8'] / 1e9:.2f} GB")
  if s["tok_s_median"]:
    base = s["tok_s_median"]["target_reference"]
    print("\n| mode | decode tok/s (median) | x reference target-only |\n|---|---|---|")
    for n, v in s["tok_s_median"].items():
      print(f"| {n} | {v:.2f} | {v / base:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
