"""The results document: one JSON file, rewritten atomically after every measured record.

Layout (every figure of the run is in it):

  settings      what was asked (modes with their jspec arguments, prompts,
                gammas, max_new_tokens, reps, dtype, stopping rule, ...)
  command, git, machine, versions, bandwidth
  models        configs, parameter bytes, weight bytes read per forward, load time
  memory        peak RSS of the jspec process against both models' parameter bytes
  hf            the HF child: load times, versions, assistant settings, peak RSS
  llamacpp      the llama.cpp peers: its build, GGUF files, threads, environment,
                stopping rule; or {"skipped": reason} or an "error"
  prompts       name -> {kind, chat, prompt_ids, text, modes: {mode -> record}}
  gate          the correctness verdict: every jspec mode's greedy ids equal
                jspec target-only's, per prompt
  hf_agreement  informative: HF target-only ids against jspec target-only ids
  llamacpp_agreement  informative: llama.cpp's greedy text against jspec
                target-only's, and its speculative text against its own target's
  summary       per mode, medians over the prompts (all, and by kind)
  targets       issue 6's CPU targets against this run's figures (informative)
  derived       (--random-weights) speculative figures derived from histograms

Ratios are taken per prompt inside the run (a mode's tokens/s over the
baseline's tokens/s on the same prompt) and then summarised by their median,
so a slow prompt and a fast one weigh the same. Against the llama.cpp peers
there are two: speedup_vs_llamacpp_<mode> (tokens/s, prefill + decode, by
each engine's own clock) and decode_speedup_vs_llamacpp_<mode> (decode
tokens/s, llama.cpp's as it reports its eval speed).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
from typing import Any, Iterable, Optional

SCHEMA = 1
LLAMACPP_BASELINES = ("llamacpp_target", "llamacpp_spec")
BASELINES = ("target", "hf_target", "hf_assisted") + LLAMACPP_BASELINES
# Settings that must match for --resume to reuse records measured earlier.
RESUME_KEYS = ("model", "target", "draft", "suite", "max_new_tokens", "reps", "dtype",
               "device", "stop_at_eos", "random_weights", "smoke", "draft_vocab",
               "draft_int4")


def new(settings: dict[str, Any]) -> dict[str, Any]:
  """An empty document for a run.

  Args:
    settings: the run's settings (see the module docstring).

  Returns:
    The document.
  """
  return {"schema": SCHEMA, "status": "running", "settings": settings, "prompts": {},
          "gate": {"passed": True, "mismatches": [], "checked": 0}}


def _clean(value: Any) -> Any:
  """NaN and infinities -> None, so the file is strict JSON."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _clean(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_clean(v) for v in value]
  return value


def write(doc: dict[str, Any], path: pathlib.Path) -> None:
  """Writes the document atomically: a temporary file beside it, then a rename.

  Args:
    doc: the document.
    path: destination; its directory is created.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(_clean(doc), indent=1) + "\n")
  os.replace(tmp, path)


def load(path: pathlib.Path) -> dict[str, Any]:
  """Reads a results document.

  Args:
    path: a file `write` wrote.

  Returns:
    The document.
  """
  return json.loads(pathlib.Path(path).read_text())


def resume(path: pathlib.Path, settings: dict[str, Any]) -> Optional[dict[str, Any]]:
  """An earlier run's document to continue, if it exists and was asked the same.

  Args:
    path: the --out file.
    settings: this run's settings.

  Returns:
    The earlier document (its records are kept and not measured again), or
    None if there is no file.

  Raises:
    ValueError: the file's settings differ in a way that makes its figures
      incomparable (the message names the keys).
  """
  path = pathlib.Path(path)
  if not path.exists():
    return None
  doc = load(path)
  old = doc.get("settings", {})
  differ = [k for k in RESUME_KEYS if old.get(k) != settings.get(k)]
  old_args, new_args = old.get("mode_args", {}), settings.get("mode_args", {})
  differ += [f"mode {m}" for m in sorted(set(old_args) & set(new_args))
             if old_args[m] != new_args[m]]
  if differ:
    raise ValueError(f"{path} was written with different settings ({', '.join(differ)}); "
                     "choose another --out or drop --resume")
  doc["settings"] = {**settings,
                     "prompts": list(dict.fromkeys(old.get("prompts", []) + settings["prompts"])),
                     "mode_args": {**old_args, **new_args}}
  doc["status"] = "running"
  return doc


def has(doc: dict[str, Any], prompt: str, mode: str) -> bool:
  """Whether a record of `mode` on `prompt` is already in the document."""
  return mode in doc["prompts"].get(prompt, {}).get("modes", {})


def put(doc: dict[str, Any], prompt: str, mode: str, record: dict[str, Any]) -> None:
  """Stores one record.

  Args:
    doc: the document (its prompt entry must exist).
    prompt: prompt name.
    mode: mode name.
    record: the measured figures.
  """
  doc["prompts"][prompt].setdefault("modes", {})[mode] = record


def common_prefix(a: list[int], b: list[int]) -> int:
  """Length of the longest common prefix of two id lists."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def gate(doc: dict[str, Any]) -> dict[str, Any]:
  """Checks every jspec mode's greedy ids against jspec target-only's, prompt by prompt.

  Repetitions of one mode must agree too (greedy decoding is deterministic).

  Args:
    doc: the document.

  Returns:
    {"passed", "checked": records compared, "mismatches": [{prompt, mode,
    first_diff, expected, got} ...]} (also stored in doc["gate"]).
  """
  mismatches, checked = [], 0
  for name, entry in doc["prompts"].items():
    records = entry.get("modes", {})
    base = records.get("target")
    for mode, rec in records.items():
      if rec.get("engine") != "jspec":
        continue
      if not rec.get("reps_identical", True):
        mismatches.append({"prompt": name, "mode": mode, "first_diff": None,
                           "reason": "repetitions of this mode gave different ids"})
      after = rec.get("after_hf")
      if after is not None and not (after.get("token_ids_equal")
                                    and after.get("reps_identical", True)):
        mismatches.append({"prompt": name, "mode": mode, "first_diff": None,
                           "reason": "timed again after the HF peers, it gave other ids"})
      if base is None or mode == "target":
        continue
      checked += 1
      want, got = base["token_ids"], rec["token_ids"]
      if want != got:
        i = common_prefix(want, got)
        mismatches.append({"prompt": name, "mode": mode, "first_diff": i,
                           "expected": want[i:i + 4], "got": got[i:i + 4],
                           "lengths": [len(want), len(got)],
                           "reason": "greedy ids differ from jspec target-only"})
  doc["gate"] = {"passed": not mismatches, "checked": checked, "mismatches": mismatches}
  return doc["gate"]


def hf_agreement(doc: dict[str, Any]) -> dict[str, Any]:
  """HF's greedy ids against jspec target-only's (informative, not a gate).

  Float differences between two implementations can flip a near-tie, after
  which the continuations differ; the agreement length says how far they
  went together.

  Args:
    doc: the document.

  Returns:
    prompt -> {mode -> {"equal", "agree_len", "length"}} (also stored in doc).
  """
  out = {}
  for name, entry in doc["prompts"].items():
    records = entry.get("modes", {})
    base = records.get("target")
    if base is None:
      continue
    for mode in ("hf_target", "hf_assisted"):
      if mode in records:
        ids = records[mode]["token_ids"]
        out.setdefault(name, {})[mode] = {
            "equal": ids == base["token_ids"],
            "agree_len": common_prefix(ids, base["token_ids"]),
            "length": len(base["token_ids"])}
  doc["hf_agreement"] = out
  return out


LLAMACPP_RATIOS = tuple(f"{kind}speedup_vs_{base}" for base in LLAMACPP_BASELINES
                        for kind in ("", "decode_"))
EXCERPT_CHARS = 40  # of each text, from just before the first difference


def text_diff(want: str, got: str, overshoot_ok: bool = False) -> dict[str, Any]:
  """Where two greedy texts part, so a mismatch can be read without the whole texts.

  Args:
    want: the reference text.
    got: the text compared with it.
    overshoot_ok: `got` may run on past `want` (a speculative run's last
      draft is not cut to the budget): equal when `want` is its prefix.

  Returns:
    {"equal", "first_diff_char" (None where equal), "excerpt_from" (the
    character offset the excerpts start at, a few before the difference),
    "expected" and "got" (up to EXCERPT_CHARS of each from there), "lengths"
    ([chars of want, chars of got])}.
  """
  n = 0
  for a, b in zip(want, got):
    if a != b:
      break
    n += 1
  equal = got.startswith(want) if overshoot_ok else got == want
  start = max(0, n - 10)
  return {"equal": equal, "first_diff_char": None if equal else n,
          "excerpt_from": None if equal else start,
          "expected": None if equal else want[start:start + EXCERPT_CHARS],
          "got": None if equal else got[start:start + EXCERPT_CHARS],
          "lengths": [len(want), len(got)]}


def llamacpp_agreement(doc: dict[str, Any]) -> dict[str, Any]:
  """llama.cpp's greedy texts against jspec target-only's and each other (informative, not a gate).

  llama.cpp gives text, not ids: its target-alone text is compared with
  jspec target-only's ids decoded up to their first EOS (llama.cpp stops
  there; the text is "jspec_text" in the llama.cpp records), and its
  speculative text with its target-alone text, which it may run past by
  its last draft where the target did not stop at end of generation.
  Quantized kernels of two implementations can flip a near-tie, after
  which the texts part; the offset says how far they went together.

  Args:
    doc: the document.

  Returns:
    prompt -> {"llamacpp_target": `text_diff` against jspec,
    "llamacpp_spec": `text_diff` against llamacpp_target (or, without
    that record, against jspec)} (also stored in doc).
  """
  out: dict[str, Any] = {}
  for name, entry in doc["prompts"].items():
    records = entry.get("modes", {})
    target, spec = records.get("llamacpp_target"), records.get("llamacpp_spec")
    row = {}
    if target is not None and target.get("jspec_text") is not None:
      row["llamacpp_target"] = {"vs": "target", **text_diff(target["jspec_text"], target["text"])}
    if spec is not None and target is not None:
      row["llamacpp_spec"] = {"vs": "llamacpp_target", **text_diff(
          target["text"], spec["text"], overshoot_ok=not target["stopped_at_eog"])}
    elif spec is not None and spec.get("jspec_text") is not None:
      row["llamacpp_spec"] = {"vs": "target", **text_diff(
          spec["jspec_text"], spec["text"], overshoot_ok=not spec.get("jspec_reached_eos"))}
    if row:
      out[name] = row
  doc["llamacpp_agreement"] = out
  return out


def _median(values: Iterable[Optional[float]]) -> Optional[float]:
  values = [v for v in values if v is not None and math.isfinite(v)]
  return float(statistics.median(values)) if values else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
  if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b <= 0:
    return None
  return a / b


def ratios(doc: dict[str, Any]) -> None:
  """Adds per-record speedups over each baseline and the roofline fraction.

  speedup_vs_<baseline> = the record's tokens/s over the baseline's on the
  same prompt (prefill + decode, compile excluded on both). roofline_fraction
  = achieved GB/s over the bandwidth read around its prompt's records
  (entry["bandwidth"], from `runner._bracket`), or over the run's first read
  where the prompt has none (results from before those reads). A record with
  derived figures (--random-weights) gets its derived speedups inside
  record["derived"], beside the measured ones.

  decode_speedup_vs_llamacpp_<mode> = the record's decode tokens/s over
  that llama.cpp mode's (its reported eval tokens/s) on the same prompt.

  A target-only record timed again after the HF phase (record["after_hf"],
  `runner._target_after_hf`) also gets bracketed_tokens_per_s, the mean of
  its two times' tokens/s, an estimate of its speed while HF ran, and
  speedup_vs_hf_target_bracketed = that over HF target-only's tokens/s
  (after_hf gets its own speedup_vs_hf_target too).

  Args:
    doc: the document (changed in place).
  """
  run_bandwidth = (doc.get("bandwidth") or {}).get("gbs")
  for entry in doc["prompts"].values():
    bandwidth = (entry.get("bandwidth") or {}).get("gbs") or run_bandwidth
    records = entry.get("modes", {})
    for rec in records.values():
      for base in BASELINES:
        base_rec = records.get(base)
        base_tps = base_rec.get("tokens_per_s") if base_rec else None
        rec[f"speedup_vs_{base}"] = _ratio(rec.get("tokens_per_s"), base_tps)
        if "derived" in rec:
          rec["derived"][f"speedup_vs_{base}"] = _ratio(rec["derived"].get("tokens_per_s"),
                                                       base_tps)
      for base in LLAMACPP_BASELINES:
        base_rec = records.get(base)
        rec[f"decode_speedup_vs_{base}"] = _ratio(
            rec.get("decode_tokens_per_s"), base_rec.get("decode_tokens_per_s") if base_rec else None)
      if rec.get("achieved_gbs") is not None:
        rec["roofline_fraction"] = _ratio(rec["achieved_gbs"], bandwidth)
    base, hf = records.get("target"), records.get("hf_target")
    after = (base or {}).get("after_hf")
    if base is not None and after is None:  # recomputed from the records alone
      base.pop("bracketed_tokens_per_s", None)
      base.pop("speedup_vs_hf_target_bracketed", None)
    if after is not None:
      hf_tps = hf.get("tokens_per_s") if hf else None
      both = [base.get("tokens_per_s"), after.get("tokens_per_s")]
      base["bracketed_tokens_per_s"] = (sum(both) / 2 if None not in both else None)
      base["speedup_vs_hf_target_bracketed"] = _ratio(base["bracketed_tokens_per_s"], hf_tps)
      after["speedup_vs_hf_target"] = _ratio(after.get("tokens_per_s"), hf_tps)


def value(rec: dict[str, Any], field: str) -> Optional[float]:
  """A record's figure, the derived one where the record has it (--random-weights)."""
  derived = rec.get("derived") or {}
  return derived[field] if field in derived else rec.get(field)


def summary(doc: dict[str, Any], mode_order: list[str]) -> dict[str, Any]:
  """Per mode, medians over the prompts (all prompts, and each kind).

  Args:
    doc: the document (ratios already added).
    mode_order: mode names in report order.

  Returns:
    mode -> figures (also stored in doc["summary"]).
  """
  fields = ("tokens_per_s", "decode_tokens_per_s", "speedup_vs_target", "speedup_vs_hf_target",
            "speedup_vs_hf_assisted", "acceptance_rate", "mean_tokens_per_round",
            "achieved_gbs", "roofline_fraction", "speedup_vs_hf_target_bracketed",
            "paired_roofline_fraction", "wall_tokens_per_s") + LLAMACPP_RATIOS
  out = {}
  for mode in mode_order:
    recs = [(e["kind"], e["modes"][mode]) for e in doc["prompts"].values()
            if mode in e.get("modes", {})]
    if not recs:
      continue
    row: dict[str, Any] = {"prompts": len(recs)}
    for f in fields:
      row[f] = _median(value(r, f) for _, r in recs)
    row["derived"] = any("derived" in r for _, r in recs)
    compiles = [r["compile_s"] for _, r in recs if r.get("compile_s") is not None]
    row["compile_s"] = max(compiles) if compiles else None  # the first call's compile
    row["by_kind"] = {}
    for kind in sorted({k for k, _ in recs}):
      sub = [r for k, r in recs if k == kind]
      row["by_kind"][kind] = {
          "prompts": len(sub),
          **{f: _median(value(r, f) for r in sub)
             for f in ("tokens_per_s", "decode_tokens_per_s", "speedup_vs_target",
                       "speedup_vs_hf_target", "speedup_vs_hf_assisted", "acceptance_rate")
             + LLAMACPP_RATIOS}}
    out[mode] = row
  doc["summary"] = out
  return out


def finalize(doc: dict[str, Any], mode_order: list[str]) -> None:
  """Recomputes everything derived from the records: ratios, gate, HF and llama.cpp agreement, summary.

  Args:
    doc: the document (changed in place).
    mode_order: mode names in report order.
  """
  ratios(doc)
  gate(doc)
  hf_agreement(doc)
  llamacpp_agreement(doc)
  summary(doc, mode_order)
  targets(doc)


def targets(doc: dict[str, Any]) -> dict[str, Any]:
  """Issue 6's CPU targets, checked against this run's figures (informative; never a gate).

  The "best default setting" is the draft-model mode (fixed or adaptive)
  with the highest median speedup over jspec target-only on the code
  prompts: one setting for the whole suite, not one per prompt.

  Args:
    doc: the document (summary already computed).

  Returns:
    name -> {"value", "goal", "met"} (also stored in doc["targets"]).
  """
  s = doc.get("summary", {})
  out: dict[str, Any] = {}

  def check(name, value, goal, at_most=False):
    met = None if value is None else (value <= goal if at_most else value >= goal)
    out[name] = {"value": value, "goal": goal, "met": met}

  base = s.get("target", {})
  # Over each repetition's own reads where the run took them
  # (`engine._paired_roof`); over the reads around the prompt's records,
  # the figure before those, beside it.
  paired = base.get("paired_roofline_fraction")
  check("target_roofline_fraction",
        paired if paired is not None else base.get("roofline_fraction"), 0.85)
  out["target_roofline_fraction"].update(paired=paired is not None,
                                         around_prompt=base.get("roofline_fraction"))
  # Bracketed where jspec target-only was timed on both sides of the HF
  # phase (`ratios`); the single-phase ratio stays beside it.
  bracketed = base.get("speedup_vs_hf_target_bracketed")
  check("target_speedup_vs_hf_target",
        bracketed if bracketed is not None else base.get("speedup_vs_hf_target"), 2.0)
  out["target_speedup_vs_hf_target"].update(
      bracketed=bracketed is not None, before_hf_only=base.get("speedup_vs_hf_target"))
  drafted = {m: r for m, r in s.items()
             if m.startswith(("spec_g", "confidence")) or m == "heuristic"}
  code = {m: r.get("by_kind", {}).get("code", {}) for m, r in drafted.items()}
  best = max((m for m in code if code[m].get("speedup_vs_target") is not None),
             key=lambda m: code[m]["speedup_vs_target"], default=None)
  out["best_speculative_mode"] = best
  if best is not None:
    check("best_speculative_speedup_vs_target_code", code[best]["speedup_vs_target"], 2.0)
    check("best_speculative_speedup_vs_hf_assisted_code",
          code[best].get("speedup_vs_hf_assisted"), 2.0)
  edit = s.get("prompt_lookup", {}).get("by_kind", {}).get("edit", {})
  check("prompt_lookup_speedup_vs_target_edit", edit.get("speedup_vs_target"), 2.5)
  # Lookup with the draft model where nothing matches: reported beside the
  # target above, which is about prompt lookup alone.
  hybrid = s.get("lookup_model", {}).get("by_kind", {}).get("edit", {})
  check("lookup_model_speedup_vs_target_edit", hybrid.get("speedup_vs_target"), 2.5)
  # Every speculative program counts, the lookup ones too (lookup_model's,
  # with the draft model, catch-up widths and verify widths, is the largest).
  compiles = [r["compile_s"] for m, r in s.items()
              if m != "target" and not m.startswith("hf_") and r.get("compile_s")]
  check("max_first_call_compile_s_speculative", max(compiles) if compiles else None, 60.0,
        at_most=True)
  mem = doc.get("memory", {})
  check("peak_rss_over_param_bytes", mem.get("peak_rss_over_param_bytes"), 1.3, at_most=True)
  doc["targets"] = out
  return out
