"""The whole run: bandwidth, the jspec phase, the peers' phases, the verdicts, JSON, tables, plots.

Order and memory: the jspec process loads the pair and measures every jspec
mode on every prompt, writing the JSON after each record; then it releases
the weights, llama.cpp's tools run on the same GGUF files (one process per
generation, where they are built), and the HF peers run in a child process,
whose records are merged as they arrive. Each mode's compiled programs are released as soon as
it is measured, so the peak RSS is the weights plus one mode's programs. A
run that dies leaves a usable JSON; `--resume` continues it, measuring only
the records it lacks.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import random
import sys
import time
from typing import Any, Callable, Optional

import jax

from bench import derive
from bench import engine
from bench import finalize
from bench import llamacpp
from bench import machine
from bench import memory
from bench import models
from bench import modes as modes_lib
from bench import peers
from bench import plots
from bench import prompts as prompts_lib
from bench import report
from bench import results
from jspec import bundle as bundle_lib
from jspec import cpu_kernels
from jspec import distill_data
from jspec import options as options_lib
from jspec import programs
from jspec import tokenizer as tokenizer_lib


class UsageError(ValueError):
  """The options ask for something that does not exist (a prompt, a mode) or cannot be resumed."""


def _log(msg: str) -> None:
  print(f"bench: {msg}", file=sys.stderr, flush=True)


def _prompt_list(opts: argparse.Namespace) -> list[prompts_lib.Prompt]:
  if opts.suite == "humaneval":
    pool = prompts_lib.humaneval(opts.limit)
  else:
    pool = list(prompts_lib.SUITE)
    if opts.limit:
      pool = pool[:opts.limit]
  if opts.smoke and not opts.prompts:
    # One prompt of each kind keeps the smoke run to seconds.
    pool = [next(p for p in pool if p.kind == k) for k in prompts_lib.KINDS
            if any(p.kind == k for p in pool)]
  return prompts_lib.select(pool, opts.prompts)


def _draft_int4(asked: Optional[bool]) -> bool:
  """Whether this run's draft is stored in 4 bits: the flag, or what its default resolves to here.

  Recorded resolved, so that `--resume` never joins records of an int8 draft
  to a 4-bit one's (the default moved from the one to the other).

  Args:
    asked: `--draft-int4` / `--no-draft-int4`, or None for the default.

  Returns:
    The storage `jspec.load` gives the draft on this host.
  """
  kernels = jax.default_backend() == "cpu" and cpu_kernels.available()
  return bundle_lib.draft_int4(bundle_lib.Settings(draft_int4=asked), kernels)


def _settings(opts, chosen, prompt_list) -> dict[str, Any]:
  return {
      "model": None if (opts.target or opts.smoke) else opts.model,
      "target": opts.target, "draft": opts.draft,
      "suite": opts.suite, "limit": opts.limit,
      "prompts": [p.name for p in prompt_list],
      "modes": [m.name for m in chosen],
      "mode_args": {m.name: modes_lib.describe(m) for m in chosen},
      "gammas": opts.gammas, "max_new_tokens": opts.max_new_tokens, "reps": opts.reps,
      "dtype": opts.dtype, "device": opts.device, "stop_at_eos": opts.stop_at_eos,
      "draft_vocab": getattr(opts, "draft_vocab", None),
      "draft_int4": _draft_int4(getattr(opts, "draft_int4", None)),
      "stopping_rule": ("EOS on both sides (jspec stop_at_eos=True, HF eos_token_id = the same "
                        "ids)" if opts.stop_at_eos else
                        "EOS disabled on both sides (jspec stop_at_eos=False, HF "
                        "eos_token_id=None): every generation is max_new_tokens long"),
      "random_weights": opts.random_weights, "smoke": opts.smoke,
      "histograms": opts.histograms, "hf": not opts.no_hf, "llamacpp": not opts.no_llamacpp,
      "allow_mismatch": opts.allow_mismatch,
  }


def _random_ids(prompt: prompts_lib.Prompt, vocab: int) -> list[int]:
  """Stand-in ids for a prompt without a tokenizer: about one token per 3.5 characters."""
  rng = random.Random(prompt.name)
  return [rng.randrange(1000, min(vocab, 100_000)) for _ in range(max(1, len(prompt.text) * 2 // 7))]


def _prompt_ids(prompt, loaded: models.Loaded, hist_doc: Optional[dict]) -> tuple[list[int], str]:
  """The ids a prompt is run with, and where they came from."""
  tok = loaded.bundle.tokenizer
  if tok is not None:
    return prompts_lib.encode(prompt, tok), "tokenizer"
  if hist_doc and prompt.name in hist_doc.get("prompts", {}):
    # The real run's ids: the same lengths, so the same costs.
    return list(hist_doc["prompts"][prompt.name]["prompt_ids"]), "histograms file"
  if loaded.bundle.target.cfg.vocab_size <= 512:
    return prompts_lib.encode(prompt, None), "bytes"
  return _random_ids(prompt, loaded.bundle.target.cfg.vocab_size), "random (length ~ text/3.5)"


def _mode_order(doc: dict[str, Any], chosen: list[modes_lib.Mode]) -> list[str]:
  order = [m.name for m in chosen]
  return order + [m for m in finalize.mode_order(doc) if m not in order]


def _progress(where: str, name: str, mode: str, rec: dict[str, Any], base: Optional[dict]):
  speed = ""
  if base and base.get("tokens_per_s") and rec.get("tokens_per_s"):
    speed = f" x{rec['tokens_per_s'] / base['tokens_per_s']:.2f}"
  extra = ""
  if rec.get("acceptance_rate") is not None and rec.get("drafted"):
    extra = f" accept {rec['acceptance_rate']:.2f} tok/round {rec['mean_tokens_per_round']:.2f}"
  compile_s = f" compile {rec['compile_s']:.1f}s" if rec.get("compile_s") else ""
  _log(f"{where}{name} {mode}: {rec['tokens_per_s']:.2f} tok/s{speed}{extra}{compile_s}")


def _draft_bytes(loaded: models.Loaded, mode: modes_lib.Mode) -> Optional[int]:
  """Weight bytes of one draft step in this mode: those of the draft it runs, int8 or float.

  Args:
    loaded: the run's models.
    mode: a jspec mode.

  Returns:
    Bytes (`memory.forward_bytes`), or None when the mode runs no draft model.
  """
  draft = loaded.bundle_for(mode).draft
  if draft is None or not options_lib.Options(**mode.kwargs).uses_draft:
    return None
  return memory.forward_bytes(draft.cfg, draft.params)


def _platform(opts) -> Optional[str]:
  """JAX_PLATFORMS for the bench's child processes ("cpu", "cuda"), or None to inherit."""
  return {"cpu": "cpu", "gpu": "cuda"}.get(opts.device)


def _bandwidth_read(opts) -> Optional[float]:
  """One memory bandwidth read (`memory.bandwidth`, best of 5) in GB/s, or None if it failed."""
  return memory.bandwidth(opts.bandwidth_bytes, 5, _platform(opts)).get("gbs")


def _bracket(before: Optional[float], after: Optional[float]) -> dict[str, Any]:
  """The roof of one prompt's records: the mean of the reads just before and after them.

  This shared machine's bandwidth moves by a third over minutes, so a roof
  read once at the start of a 20-minute run is not the one a prompt's
  decode met (the target-only roofline fraction swung 68-100% over runs of
  one build that way). Reads on both sides of the prompt's records bound
  the window they ran in.

  Args:
    before, after: GB/s, or None where a read failed.

  Returns:
    {"before_gbs", "after_gbs", "gbs": the mean of those that succeeded (None if neither)}.
  """
  reads = [r for r in (before, after) if r is not None]
  return {"before_gbs": before, "after_gbs": after,
          "gbs": sum(reads) / len(reads) if reads else None}


def _jspec_phase(opts, doc, out, chosen, prompt_list, hist_doc, order,
                 after_prompt: Optional[Callable[[Any], None]] = None) -> bool:
  """Measures every missing jspec record. Returns False if the gate stopped the run.

  `after_prompt(p)` runs after each prompt's records are written while the
  gate holds (the llama.cpp peers on that prompt: `run`).
  """
  jmodes = [m for m in chosen if m.engine == "jspec"]
  need = any(not results.has(doc, p.name, m.name) for p in prompt_list for m in jmodes)
  need = need or any(p.name not in doc["prompts"] for p in prompt_list)
  if not need:
    _log("every jspec record is already in the results; skipping the jspec phase")
    return True
  _log("loading models")
  loaded = models.load(opts.model, opts.target, opts.draft, opts.dtype, opts.random_weights,
                       opts.smoke, float_draft=any(m.draft_int8 is False for m in jmodes),
                       draft_vocab=getattr(opts, "draft_vocab", None),
                       draft_int4=getattr(opts, "draft_int4", None))
  # The ids jspec stops at under --stop-at-eos (as `jspec.generate` picks
  # them), so that the HF peers stop at the same ones.
  eos = (getattr(loaded.bundle.tokenizer, "eos_token_ids", ())
         or loaded.bundle.target.cfg.eos_token_ids)
  doc["models"] = {**loaded.info, "hf_source": loaded.hf_source,
                   "hf_skip_reason": loaded.hf_skip_reason, "eos_token_ids": list(eos)}
  _log(f"loaded in {loaded.info['load_s']:.1f}s ({loaded.info['source']})")
  bundle = loaded.bundle
  t_bytes = loaded.info["target"]["forward_bytes"]
  for p in prompt_list:
    if p.name not in doc["prompts"]:
      ids, origin = _prompt_ids(p, loaded, hist_doc)
      doc["prompts"][p.name] = {"kind": p.kind, "chat": p.chat, "text": p.text,
                                "prompt_ids": ids, "prompt_ids_from": origin,
                                "prompt_tokens": len(ids), "modes": {}}
  results.write(doc, out)
  total = len(prompt_list) * len(jmodes)
  done = 0
  d_bytes = {m.name: _draft_bytes(loaded, m) for m in jmodes}
  bundles = {m.name: loaded.bundle_for(m) for m in jmodes}
  last_read = None  # the bandwidth read just after the previous prompt's records
  for p in prompt_list:
    entry = doc["prompts"][p.name]
    todo = [m for m in jmodes if not results.has(doc, p.name, m.name)]
    before = (last_read if last_read is not None else _bandwidth_read(opts)) if todo else None
    read_roof = None if opts.no_paired_reads else lambda: _bandwidth_read(opts)
    recs = engine.run_modes(bundle, entry["prompt_ids"], todo, opts.max_new_tokens, opts.reps,
                            opts.stop_at_eos, t_bytes, d_bytes, read_roof,
                            bundles) if todo else {}
    # The prompt's programs go once it is measured: kept for the next
    # prompts they pile up (about 150 MB per program pair, some 30 pairs over
    # the suite) to 1.6x the weights in peak RSS. A later prompt of the same
    # bucket compiles again (mostly a load from the persistent cache), and
    # its first call is a warm-up.
    programs.release()
    memory.release_freed()
    if todo:
      last_read = _bandwidth_read(opts)
      entry["bandwidth"] = _bracket(before, last_read)
    for m in jmodes:
      done += 1
      if m.name not in recs:
        continue
      rec = recs[m.name]
      if m.name == "target" and bundle.tokenizer is not None:
        entry["target_text"] = bundle.tokenizer.decode(rec["token_ids"])
      results.put(doc, p.name, m.name, rec)
      _progress(f"[{done}/{total}] ", p.name, m.name, rec, entry["modes"].get("target"))
    results.finalize(doc, order)
    results.write(doc, out)
    if not doc["gate"]["passed"] and not opts.allow_mismatch:
      _log(f"greedy ids differ from jspec target-only on {p.name}; stopping "
           "(--allow-mismatch finishes the run)")
      break
    if after_prompt is not None:
      after_prompt(p)
  peak = memory.peak_rss_bytes()
  both = loaded.info["target"]["param_bytes"] + loaded.info["draft"]["param_bytes"]
  float_draft = loaded.info.get("float_draft", {}).get("param_bytes")
  held = both + (float_draft or 0)
  doc["memory"] = {"peak_rss_bytes": peak, "param_bytes_both": both,
                   "param_bytes_float_draft": float_draft,
                   "peak_rss_over_param_bytes": peak / held if held else None,
                   "device_peak_bytes": memory.device_peak_bytes(),
                   "note": "peak RSS of the jspec process over the whole run (loading, "
                           "compiling, decoding) over the parameter bytes of the models it "
                           "held, as prepared at load (the target with its greedy head, the "
                           "draft in int8 on CPU, and the float draft of a --float-draft run); "
                           "the HF peers run in a child process"}
  del loaded, bundle, bundles
  gc.collect()
  memory.release_freed()
  # What the jspec process still holds while the HF child runs beside it.
  doc["memory"]["rss_after_release_bytes"] = memory.rss_bytes()
  return doc["gate"]["passed"] or opts.allow_mismatch


def _hf_phase(opts, doc, out, chosen, prompt_list, order) -> list[str]:
  """Runs the HF peers in a child for every prompt that lacks one of their records.

  Returns:
    The prompts whose HF target-only record this call measured.
  """
  hmodes = [m.name for m in chosen if m.engine == "hf"]
  if opts.random_weights:
    hmodes = [m for m in hmodes if m == "hf_target"]  # acceptance ~0: assisted says nothing
  todo = [p for p in prompt_list if p.name in doc["prompts"]
          and any(not results.has(doc, p.name, m) for m in hmodes)]
  if not hmodes or not todo:
    return []
  source = doc["models"].get("hf_source")
  reason = doc["models"].get("hf_skip_reason")
  if source is None:
    _log(f"skipping the HF peers: {reason}")
    doc["hf"] = {"skipped": reason}
    return []
  device = "cuda" if opts.device == "gpu" or (opts.device == "auto" and _on_gpu()) else "cpu"
  eos = (doc["models"].get("eos_token_ids") or None) if opts.stop_at_eos else None
  job = peers.job(source, [{"name": p.name, "ids": doc["prompts"][p.name]["prompt_ids"]}
                           for p in todo], hmodes, opts.max_new_tokens, opts.reps,
                  opts.dtype if opts.dtype not in (None, "exact") else "float32",
                  device, eos)
  _log(f"HF peers ({', '.join(hmodes)}) on {len(todo)} prompts, in a child process")
  hf = doc.setdefault("hf", {})
  measured = []
  try:
    for msg in peers.run(job, out.parent):
      if msg["type"] == "load":
        hf.update({k: v for k, v in msg.items() if k != "type"})
        _log(f"HF models loaded ({msg['target_load_s']:.0f}s + {msg['draft_load_s'] or 0:.0f}s)")
      elif msg["type"] == "record":
        results.put(doc, msg["prompt"], msg["mode"], msg["record"])
        if msg["mode"] == "hf_target":
          measured.append(msg["prompt"])
        base = doc["prompts"][msg["prompt"]]["modes"].get("target")
        _progress("[HF] ", msg["prompt"], msg["mode"], msg["record"], base)
        results.finalize(doc, order)
        results.write(doc, out)
      elif msg["type"] == "done":
        hf.update({k: v for k, v in msg.items() if k != "type"})
  except RuntimeError as e:  # the peers failed (no CUDA torch, out of memory): keep jspec's figures
    _log(f"the HF peers failed: {e}; their traceback is above")
    hf["error"] = str(e)
  return measured


LLAMACPP_TIMEOUT_S = 900  # per llama.cpp process


def _llamacpp_skip_reason(doc: dict[str, Any], tools: Optional[llamacpp.Tools]) -> Optional[str]:
  """Why the llama.cpp peers cannot run in this run, in one line, or None when they can.

  Args:
    doc: the document (its "models" recorded by the jspec phase).
    tools: `llamacpp.find_built()`.

  Returns:
    The reason, or None.
  """
  source = doc.get("models", {}).get("hf_source") or {}
  if source.get("kind") != "gguf":
    return (f"llama.cpp runs GGUF files, and this run's models are not a GGUF pair "
            f"({doc.get('models', {}).get('source', 'unknown source')})")
  if tools is None:
    return (f"llama.cpp's tools are not built on this host; `{llamacpp.BUILD_COMMAND}` builds "
            "them once (about 10 minutes), and a bench run never builds them")
  return None


def _eos_cut(ids: list[int], eos: list[int]) -> tuple[list[int], bool]:
  """The ids before the first EOS id, and whether there was one (llama.cpp stops there)."""
  for i, t in enumerate(ids):
    if t in eos:
      return ids[:i], True
  return ids, False


def _llamacpp_phase(opts, doc, out, chosen, prompt_list, order,
                    memo: Optional[dict] = None) -> None:
  """Runs the llama.cpp peers on every prompt that lacks one of their records.

  `run` calls it for each prompt right after jspec's records of that prompt
  (the host's speed drifts over minutes: a ratio of figures taken a phase
  apart is partly the drift), then once more for any prompt still lacking
  them (a resumed run). `memo` carries the wait-policy probe and the
  tokenizer between those calls, so that the probe runs once per run.

  They run on the GGUF files jspec loaded, with the prompt text jspec
  tokenized (`llamacpp.prompt_text`), max_new_tokens and reps as jspec's
  modes; llama.cpp always stops at end of generation, so its text is
  compared with jspec target-only's up to its first EOS. Never builds
  llama.cpp: where its tools are not built, or the models are no GGUF pair,
  doc["llamacpp"] says why and nothing runs.

  Args:
    opts: the run's options.
    doc: the document (records are added and it is written after each prompt).
    out: the results path.
    chosen: the run's modes.
    prompt_list: the run's prompts.
    order: mode names in report order.
    memo: what earlier calls of this run found (the probe, the tokenizer).
  """
  lmodes = [m for m in chosen if m.engine == "llamacpp"]
  todo = [p for p in prompt_list if p.name in doc["prompts"]
          and any(not results.has(doc, p.name, m.name) for m in lmodes)]
  if not lmodes or not todo:
    return
  memo = {} if memo is None else memo
  if memo.get("failed"):  # one failure ends the peers for the run, as it did in one phase
    return
  tools = llamacpp.find_built()
  reason = _llamacpp_skip_reason(doc, tools)
  if reason is not None:
    if memo.get("skipped") != reason:
      _log(f"skipping the llama.cpp peers: {reason}")
    memo["skipped"] = reason
    doc.setdefault("llamacpp", {})["skipped"] = reason  # what an earlier run recorded stays
    return
  source = doc["models"]["hf_source"]
  eos = list(doc["models"].get("eos_token_ids") or [])
  info = doc.setdefault("llamacpp", {})
  info.pop("skipped", None)
  info.pop("error", None)
  # Spinning OpenMP threads win on a quiet host and lose on a busy one: the
  # peer runs under the policy that is faster here now, unless one is asked for.
  probe = None
  if opts.llamacpp_wait_policy == "fastest":
    if "probe" not in memo:
      try:
        memo["probe"] = llamacpp.fastest_wait_policy(tools, source["target"],
                                                     opts.llamacpp_threads)
      except llamacpp.LlamaCppError as e:
        info["error"] = memo["failed"] = str(e)
        _log(f"the llama.cpp peers did not run: {e}")
        return
      probe = memo["probe"]
      _log(f"llama.cpp's OpenMP wait policy: {probe['policy']} (llama-bench, {probe['n_gen']} "
           "tokens: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in probe["tokens_per_s"].items())
           + ")")
    probe = memo["probe"]
    policy = probe["policy"]
  else:
    policy = opts.llamacpp_wait_policy.upper()
  env = {"OMP_WAIT_POLICY": policy}
  info.update({
      "version": tools.version, "tools": str(tools.root), "build": llamacpp.manifest(tools),
      "target": source["target"], "draft": source["draft"], "env": env,
      "wait_policy_probe": probe,
      "modes": {m.name: dict(m.kwargs) for m in lmodes}, "timeout_s": LLAMACPP_TIMEOUT_S,
      "stopping_rule": "llama.cpp stops at end of generation whatever --stop-at-eos says; its "
                       "text is compared with jspec target-only's ids up to their first EOS id",
      "timing": "tokens_per_s: prefill + decode by llama.cpp's own timings (model loading "
                "excluded); decode_tokens_per_s: its reported eval (or decode) tokens/s; "
                "wall_tokens_per_s: over the whole process, loading included"})
  try:
    tok = memo["tokenizer"] = memo.get("tokenizer") or tokenizer_lib.from_gguf(source["target"])
  except tokenizer_lib.TokenizerError as e:
    info["error"] = memo["failed"] = str(e)
    _log(f"the llama.cpp peers did not run: {e}")
    return
  if not memo.get("announced"):
    memo["announced"] = True
    _log(f"llama.cpp peers ({', '.join(m.name for m in lmodes)}), tools in {tools.root}")
  for p in todo:
    entry = doc["prompts"][p.name]
    want = {m.name: m.kwargs for m in lmodes if not results.has(doc, p.name, m.name)}
    try:
      recs = llamacpp.peer_records(tools, source["target"], source["draft"],
                                   llamacpp.prompt_text(p, tok), opts.max_new_tokens, opts.reps,
                                   want, env, LLAMACPP_TIMEOUT_S)
    except (llamacpp.LlamaCppError, ValueError) as e:  # keep the records measured so far
      info["error"] = memo["failed"] = f"{p.name}: {e}"
      _log(f"the llama.cpp peers failed on {p.name}: {e}")
      results.write(doc, out)
      break
    target = entry.get("modes", {}).get("target")
    for name, rec in recs.items():
      ids = rec.pop("prompt_token_ids")
      if ids is not None:
        rec["prompt_ids_equal"] = ids == entry["prompt_ids"]
      if target is not None:
        cut, reached = _eos_cut(target["token_ids"], eos)
        rec["jspec_text"], rec["jspec_reached_eos"] = tok.decode(cut), reached
      results.put(doc, p.name, name, rec)
      base = target.get("decode_tokens_per_s") if target else None
      _log(f"[llama.cpp] {p.name} {name}: {_fmt_ratio(rec['decode_tokens_per_s'])} decode tok/s "
           f"(jspec target-only {_fmt_ratio(base)}), {_fmt_ratio(rec['wall_tokens_per_s'])} "
           f"over the whole process")
    results.finalize(doc, order)
    results.write(doc, out)


def _target_after_hf(opts, doc, out, chosen, measured, order) -> None:
  """Times jspec target-only again after the HF phase, on the prompts HF target-only ran.

  The HF peers run after the whole jspec phase, 20 minutes or more later,
  on a machine whose speed moves by a third over minutes (`_bracket`); a
  ratio of two figures taken that far apart is as much the machine's drift
  as the engines'. Timed on both sides of the HF phase, jspec's target-only
  speed while HF ran is estimated by the mean of the two
  (`results.ratios`: speedup_vs_hf_target_bracketed). The target is loaded
  and prepared again (the jspec phase freed it for the HF child), compiled
  and warmed up as before; its ids must equal the first measurement's (the gate).

  Args:
    opts: the run's options.
    doc: the document (changed in place: target records get "after_hf").
    out: the results path (written after each prompt).
    chosen: the run's modes.
    measured: the prompts whose HF target-only record this run measured.
    order: mode names in report order.
  """
  target = next((m for m in chosen if m.name == "target"), None)
  todo = [p for p in measured if target is not None
          and "target" in doc["prompts"].get(p, {}).get("modes", {})]
  if not todo or opts.no_bracket:
    return
  _log(f"jspec target-only again after the HF peers, on {len(todo)} prompts (the bracket)")
  loaded = models.load(opts.model, opts.target, opts.draft, opts.dtype, opts.random_weights,
                       opts.smoke, draft_vocab=getattr(opts, "draft_vocab", None),
                       draft_int4=getattr(opts, "draft_int4", None))
  t_bytes = loaded.info["target"]["forward_bytes"]
  last_read = _bandwidth_read(opts)
  for name in todo:
    entry = doc["prompts"][name]
    before = last_read
    rec = engine.run_modes(loaded.bundle, entry["prompt_ids"], [target], opts.max_new_tokens,
                           opts.reps, opts.stop_at_eos, t_bytes, {"target": None})["target"]
    programs.release()
    memory.release_freed()
    last_read = _bandwidth_read(opts)
    first = entry["modes"]["target"]
    first["after_hf"] = {
        **{k: rec.get(k) for k in ("tokens_per_s", "decode_tokens_per_s", "prefill_s",
                                   "decode_s", "round_s", "reps", "reps_identical")},
        "token_ids_equal": rec["token_ids"] == first["token_ids"],
        "bandwidth": _bracket(before, last_read)}
    results.finalize(doc, order)
    results.write(doc, out)
    _log(f"[after HF] {name}: target {rec['tokens_per_s']:.2f} tok/s (first "
         f"{first['tokens_per_s']:.2f}); x hf "
         f"{_fmt_ratio(first.get('speedup_vs_hf_target_bracketed'))} bracketed")
  del loaded
  gc.collect()
  memory.release_freed()


def _fmt_ratio(value: Optional[float]) -> str:
  return "-" if value is None else f"{value:.2f}"


def _compilation_cache_dir() -> Optional[str]:
  """JAX's persistent compilation cache, if on: with a warm one, compile_s is a cache load."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.config.jax_compilation_cache_dir or None


def _on_gpu() -> bool:
  import jax  # pylint: disable=import-outside-toplevel
  return jax.default_backend() == "gpu"


def run(opts: argparse.Namespace, argv: Optional[list[str]] = None) -> int:
  """Runs a benchmark as the options say.

  Args:
    opts: parsed options (see `bench.__main__`).
    argv: the command line (recorded in the JSON).

  Returns:
    The exit status: 0, or 1 if the correctness gate failed.
  """
  start = time.perf_counter()
  all_modes = modes_lib.all_modes(opts.gammas, opts.adaptive_gamma_max, opts.min_confidence,
                                  opts.lookup_gamma, opts.ngram, opts.float_draft,
                                  opts.lookup_model_gamma_max, opts.llamacpp_draft_max,
                                  opts.llamacpp_threads, opts.confidence_gamma)
  try:
    chosen = modes_lib.select(all_modes, opts.modes, hf=not opts.no_hf,
                              llamacpp=not opts.no_llamacpp)
    for m in chosen:  # a bad option fails here, before anything is loaded
      if m.engine == "jspec":
        options_lib.make(max_new_tokens=opts.max_new_tokens, stop_at_eos=opts.stop_at_eos,
                         **m.kwargs)
    prompt_list = _prompt_list(opts)
    # Never report a distilled draft on prompts it was trained on.
    if opts.draft:
      distill_data.check_held_out(opts.draft, {p.name: p.text for p in prompt_list})
    settings = _settings(opts, chosen, prompt_list)
    out = pathlib.Path(opts.out)
    doc = results.resume(out, settings) if opts.resume else None
  except (ValueError, FileNotFoundError) as e:
    raise UsageError(str(e)) from None
  if doc is None:
    doc = results.new(settings)
  doc["command"] = machine.command(argv)
  doc["git"] = machine.git()
  doc["machine"] = machine.describe()
  doc.setdefault("runs", []).append({"command": doc["command"], "commit": doc["git"]["commit"],
                                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
  hist_doc = results.load(opts.histograms) if opts.histograms else None
  phases = doc["runs"][-1]["phases_s"] = {}
  clock = time.perf_counter()

  def lap(name):
    nonlocal clock
    now = time.perf_counter()
    phases[name] = now - clock
    clock = now

  if not doc.get("bandwidth"):
    _log("measuring memory bandwidth")
    doc["bandwidth"] = memory.bandwidth(opts.bandwidth_bytes, 5, _platform(opts))
  results.write(doc, out)
  lap("bandwidth")

  order = _mode_order(doc, chosen)
  memo: dict = {}
  # Each prompt's llama.cpp records are taken right after jspec's (its time
  # is counted in the jspec phase), so both meet the host in the same state.
  after = ((lambda p: _llamacpp_phase(opts, doc, out, chosen, [p], order, memo))
           if any(m.engine == "llamacpp" for m in chosen) else None)
  ok = _jspec_phase(opts, doc, out, chosen, prompt_list, hist_doc, order, after)
  lap("jspec")
  if ok:
    _llamacpp_phase(opts, doc, out, chosen, prompt_list, order, memo)
    lap("llamacpp")
    measured = _hf_phase(opts, doc, out, chosen, prompt_list, order)
    lap("hf")
    _target_after_hf(opts, doc, out, chosen, measured, order)
    lap("target_after_hf")
  else:
    lap("hf")
  if hist_doc is not None:
    derive.apply(doc, hist_doc, str(opts.histograms))
  order = _mode_order(doc, chosen)
  results.finalize(doc, order)
  doc["status"] = "complete" if ok else "stopped"
  doc["runs"][-1]["compilation_cache_dir"] = _compilation_cache_dir()
  doc["plots"] = plots.write_all(doc, out, order)
  lap("plots")
  doc["runs"][-1]["wall_s"] = time.perf_counter() - start
  results.write(doc, out)
  print(report.render(doc, order))
  print(f"\nwall time {doc['runs'][-1]['wall_s']:.0f}s ("
        + ", ".join(f"{k} {v:.0f}s" for k, v in phases.items()) + ")")
  print(f"results: {out}  plots: {', '.join(doc['plots'])}")
  if not doc["gate"]["passed"]:
    print(f"FAILED: {len(doc['gate']['mismatches'])} greedy mismatch(es); see above and "
          f"gate.mismatches in {out}", file=sys.stderr)
    return 1
  return 0
