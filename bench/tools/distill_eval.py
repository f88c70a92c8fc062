"""The original draft against a distilled one, in one run, on held-out prompts only.

    python -m bench.tools.distill_eval --draft distilled.jspec.safetensors \\
        --suites suite,humaneval --reps 1 --max-new-tokens 128 \\
        --out bench/results/distill_cpu.json
    python -m bench.tools.distill_eval --draft distilled.jspec.safetensors \\
        --suites suite --min-confidence 0.5,0.7,0.85 --out bench/results/distill_confidence_cpu.json

Loads the known pair once (the target, the original draft stored as the
default stores it: int8 on CPU), and the distilled draft stored the same
way beside the same target. For every prompt of the stored suite (code,
edit, chat) and of HumanEval it runs jspec target-only, the default mode
(confidence policy, up to 5 drafts, p >= 0.7, greedy) with the original
draft, and the same mode with the distilled draft, repetitions interleaved
(`bench.engine.run_modes`), and records acceptance, tokens per round, tokens
per second and the speedup over target-only. With `--min-confidence` a
list of thresholds, both drafts run at each of them, all these modes
alternated on each prompt (the threshold travels as data: nothing new is
compiled); the default threshold's modes keep their names ("confidence",
"confidence_distilled"), another threshold t's are "confidence_p<t>" and
"confidence_distilled_p<t>", and the summary adds, per kind, each
threshold's gain and targets under "thresholds". Refuses, before loading
anything, to evaluate a draft on a prompt it was trained on (the hashes in
its file, `jspec.distill_data.check_held_out`). Writes the JSON after each
prompt (`--resume` continues a run that died), the summary per kind (medians
over prompts, the issue's targets beside them), the training cost from the
draft's record, and a plot of acceptance before and after, per prompt.
Exit status: 0; 1 if a mode's greedy ids differ from target-only's; 2 for
bad arguments or a draft trained on the prompts.
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
from typing import Any, Optional

from jspec import options as options_lib

# The targets (CPU, real pair, greedy, suite median, held-out prompts).
TARGETS = {"tokens_per_round_gain": {"chat": 0.15, "code": 0.10},
           "speedup": {"chat": 2.3, "code": 3.1}}
# The default mode, as `python -m bench` runs it: the library's policy.
MODE_KWARGS = {"method": "model", "gamma": options_lib.DEFAULT_GAMMA["confidence"],
               "gamma_max": options_lib.DEFAULT_GAMMA["confidence"], "policy": "confidence",
               "min_confidence": options_lib.DEFAULT_MIN_CONFIDENCE}
DEFAULT_MIN_CONFIDENCE = MODE_KWARGS["min_confidence"]


def parse_thresholds(text: str) -> list[float]:
  """A --min-confidence value: comma-separated probabilities in (0, 1], sorted.

  Args:
    text: e.g. "0.5,0.7,0.85".

  Returns:
    The thresholds, ascending.

  Raises:
    ValueError: one line (empty, not a number, outside (0, 1], given twice).
  """
  parts = [x.strip() for x in text.split(",")]
  if not text.strip() or any(not x for x in parts):
    raise ValueError(f"--min-confidence {text!r}: expected comma-separated probabilities "
                     "in (0, 1], e.g. 0.5,0.7,0.85")
  out = []
  for x in parts:
    try:
      t = float(x)
    except ValueError:
      raise ValueError(f"--min-confidence {text!r}: {x!r} is not a number") from None
    if not 0 < t <= 1:  # nan fails this too
      raise ValueError(f"--min-confidence {text!r}: {x} is not in (0, 1]")
    if t in out:
      raise ValueError(f"--min-confidence {text!r}: {x} given twice")
    out.append(t)
  return sorted(out)


def mode_names(threshold: float) -> tuple[str, str]:
  """The (original draft, distilled draft) mode names at a threshold (the default's unchanged)."""
  if threshold == DEFAULT_MIN_CONFIDENCE:
    return "confidence", "confidence_distilled"
  return f"confidence_p{threshold:g}", f"confidence_distilled_p{threshold:g}"


def _thresholds(doc: dict[str, Any]) -> list[float]:
  """The thresholds a results document was run at (a document from before the option: the default)."""
  return doc.get("settings", {}).get("min_confidence", [DEFAULT_MIN_CONFIDENCE])


def _write(doc: dict[str, Any], out: pathlib.Path) -> None:
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    json.dump(doc, f, indent=1)
  os.replace(tmp, out)


def _median(values: list[float]) -> Optional[float]:
  values = [v for v in values if v is not None]
  return float(statistics.median(values)) if values else None


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
  """Medians per kind of prompt (code = the suite's code prompts, humaneval, chat, edit, all code).

  Args:
    doc: the results document.

  Returns:
    {kind: {prompts, mode: {acceptance_rate, mean_tokens_per_round,
    speedup_vs_target} for each mode, and for the default threshold (when
    run) tokens_per_round_gain (distilled over original, minus 1) and
    targets}}; with thresholds other than the default, each kind also gets
    "thresholds": {str(t): {original, distilled (mode names),
    tokens_per_round_gain, targets}}.
  """
  groups: dict[str, list[dict]] = {}
  for entry in doc["prompts"].values():
    groups.setdefault(entry["group"], []).append(entry)
    if entry["group"] in ("code", "humaneval"):
      groups.setdefault("all_code", []).append(entry)
  thresholds = _thresholds(doc)
  out: dict[str, Any] = {}
  for kind, entries in sorted(groups.items()):
    row: dict[str, Any] = {"prompts": len(entries)}
    key = "chat" if kind == "chat" else "code" if kind in ("code", "humaneval", "all_code") else None
    per: dict[str, Any] = {}
    for t in thresholds:
      original, distilled = mode_names(t)
      for mode in (original, distilled):
        recs = [e["modes"].get(mode) for e in entries if e["modes"].get(mode)]
        row[mode] = {k: _median([r.get(k) for r in recs])
                     for k in ("acceptance_rate", "mean_tokens_per_round", "speedup_vs_target")}
      a = row[original]["mean_tokens_per_round"]
      b = row[distilled]["mean_tokens_per_round"]
      verdict: dict[str, Any] = {"tokens_per_round_gain": (b / a - 1) if a and b else None}
      if key:
        gain_goal = TARGETS["tokens_per_round_gain"][key]
        speed_goal = TARGETS["speedup"][key]
        gain, speed = verdict["tokens_per_round_gain"], row[distilled]["speedup_vs_target"]
        verdict["targets"] = {"tokens_per_round_gain": gain_goal, "speedup": speed_goal,
                              "met": bool(gain is not None and speed is not None
                                          and gain >= gain_goal and speed >= speed_goal)}
      if t == DEFAULT_MIN_CONFIDENCE:
        row.update(verdict)  # the shape the tool always had
      per[f"{t:g}"] = {"original": original, "distilled": distilled, **verdict}
    if thresholds != [DEFAULT_MIN_CONFIDENCE]:
      row["thresholds"] = per
    out[kind] = row
  return out


def plot(doc: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
  """Acceptance per prompt, original against distilled draft (a point per prompt, y = x drawn).

  Args:
    doc: the results document.
    path: the PNG.

  Returns:
    path.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  thresholds = _thresholds(doc)
  fig, axes = plt.subplots(len(thresholds), 2, figsize=(12, 5.5 * len(thresholds)),
                           squeeze=False)
  colors = {"code": "tab:blue", "humaneval": "tab:cyan", "chat": "tab:red", "edit": "tab:green"}
  panels = [(axes[i][j], key, label, t) for i, t in enumerate(thresholds)
            for j, (key, label) in enumerate((("acceptance_rate", "acceptance"),
                                              ("mean_tokens_per_round", "tokens per round")))]
  for ax, key, label, t in panels:
    original, distilled = mode_names(t)
    seen = set()
    lo, hi = float("inf"), 0.0
    for name, e in doc["prompts"].items():
      a = e["modes"].get(original, {}).get(key)
      b = e["modes"].get(distilled, {}).get(key)
      if a is None or b is None:
        continue
      lo, hi = min(lo, a, b), max(hi, a, b)
      g = e["group"]
      ax.scatter(a, b, color=colors.get(g, "gray"), alpha=0.7,
                 label=g if g not in seen else None)
      seen.add(g)
      if g in ("chat", "edit") or len(doc["prompts"]) <= 20:
        ax.annotate(name, (a, b), fontsize=7, alpha=0.7)
    if hi > 0:
      ax.plot([lo, hi], [lo, hi], color="black", linewidth=1)
    ax.set_xlabel(f"{label}, original draft")
    ax.set_ylabel(f"{label}, distilled draft")
    if len(thresholds) > 1:
      ax.set_title(f"p >= {t:g}")
    ax.legend()
    ax.grid(alpha=0.3)
  shown = ", ".join(f"{t:g}" for t in thresholds)
  fig.suptitle(f"Greedy, confidence policy (up to 8, p >= {shown}), int8 drafts: per prompt")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv: Optional[list[str]] = None) -> int:
  """Runs the comparison.

  Args:
    argv: arguments (None: sys.argv[1:]).

  Returns:
    The exit status.
  """
  p = argparse.ArgumentParser(prog="python -m bench.tools.distill_eval", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--draft", required=True, help="the distilled draft file")
  p.add_argument("--model", default="qwen2.5-coder", help="the known pair (default qwen2.5-coder)")
  p.add_argument("--suites", default="suite,humaneval", help="suite and/or humaneval")
  p.add_argument("--prompts", help="the suite's prompts to keep (as python -m bench --prompts)")
  p.add_argument("--humaneval-limit", type=int, help="the first N HumanEval tasks (default all)")
  p.add_argument("--reps", type=int, default=1, help="timed repetitions (medians; default 1)")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--dtype", default=None, choices=("exact", "float32", "bfloat16", "float16"),
                 help="the target's storage (default: jspec.load's, exact on CPU)")
  p.add_argument("--out", default="bench/results/distill_cpu.json")
  p.add_argument("--resume", action="store_true", help="keep the prompts already in --out")
  p.add_argument("--min-confidence", default=f"{DEFAULT_MIN_CONFIDENCE:g}",
                 help="the confidence policy's thresholds, comma-separated in (0, 1]: both "
                      "drafts run at each, alternated on each prompt (default "
                      f"{DEFAULT_MIN_CONFIDENCE:g}, the library's)")
  opts = p.parse_args(argv)
  try:
    thresholds = parse_thresholds(opts.min_confidence)
  except ValueError as e:
    p.error(str(e))
  from bench import prompts as prompts_lib  # pylint: disable=import-outside-toplevel
  from jspec import distill_data  # pylint: disable=import-outside-toplevel

  suites = [s.strip() for s in opts.suites.split(",") if s.strip()]
  if not suites or any(s not in ("suite", "humaneval") for s in suites):
    p.error(f"--suites {opts.suites!r}: expected suite and/or humaneval")
  chosen = []
  if "suite" in suites:
    chosen += [(q, q.kind) for q in prompts_lib.select(prompts_lib.SUITE, opts.prompts)]
  if "humaneval" in suites:
    chosen += [(q, "humaneval") for q in prompts_lib.humaneval(opts.humaneval_limit)]
  try:
    distill_data.check_held_out(opts.draft, {q.name: q.text for q, _ in chosen})
    record = distill_data.read_record(opts.draft)
  except ValueError as e:
    p.error(str(e))
  if not pathlib.Path(opts.draft).is_file():
    p.error(f"--draft {opts.draft}: no such file")

  import jspec  # pylint: disable=import-outside-toplevel
  from bench import engine  # pylint: disable=import-outside-toplevel
  from bench import machine  # pylint: disable=import-outside-toplevel
  from bench import memory  # pylint: disable=import-outside-toplevel
  from bench import models  # pylint: disable=import-outside-toplevel
  from bench import modes as modes_lib  # pylint: disable=import-outside-toplevel
  from jspec import bundle as bundle_lib  # pylint: disable=import-outside-toplevel
  from jspec import programs  # pylint: disable=import-outside-toplevel

  out = pathlib.Path(opts.out)
  doc: dict[str, Any] = {}
  if opts.resume and out.is_file():
    doc = json.loads(out.read_text())
  doc.setdefault("prompts", {})
  settings = {"reps": opts.reps, "max_new_tokens": opts.max_new_tokens,
              "target_dtype": opts.dtype,
              "mode": MODE_KWARGS, "stop_at_eos": False, "greedy": True}
  if thresholds != [DEFAULT_MIN_CONFIDENCE]:
    settings["min_confidence"] = thresholds  # "mode" holds the rest of each mode's options
  doc.update({"command": machine.command(sys.argv[1:] if argv is None else argv),
              "git": machine.git(), "machine": machine.describe(), "draft": opts.draft,
              "settings": settings,
              "training": None if record is None else {
                  k: record.get(k) for k in ("recipe", "steps", "stopped_early", "train_s",
                                             "trained_tokens", "data", "evals")},
              "targets": TARGETS})
  if record is not None:
    data = record.get("data", {})
    doc["training"]["cost"] = {
        "generated_tokens": data.get("generated_tokens"),
        "label_forward_tokens": data.get("label_forward_tokens"),
        "trained_tokens": record.get("trained_tokens"),
        "data_minutes": (data.get("data_s") or 0) / 60,
        "train_minutes": (record.get("train_s") or 0) / 60,
        "total_minutes": ((data.get("data_s") or 0) + (record.get("train_s") or 0)) / 60}
  t0 = time.perf_counter()
  loaded = models.load(opts.model, None, None, opts.dtype, False, False)
  tuned = models.prepare_checkpoint(opts.draft, "draft", bundle_lib.Settings())
  bundle = loaded.bundle
  tuned_bundle = jspec.Bundle(bundle.target, tuned, bundle.tokenizer)
  doc["load_s"] = time.perf_counter() - t0
  t_bytes = loaded.info["target"]["forward_bytes"]
  # Per threshold the original draft then the distilled one; run_modes
  # alternates them all on each prompt (and the repetitions, rep by rep).
  modes = [modes_lib.Mode("target", "jspec", "target", {"method": "target"})]
  d_bytes: dict[str, Optional[int]] = {"target": None}
  tuned_modes = {}
  original_bytes = memory.forward_bytes(bundle.draft.cfg, bundle.draft.params)
  tuned_bytes = memory.forward_bytes(tuned.cfg, tuned.params)
  for t in thresholds:
    original, distilled = mode_names(t)
    kwargs = dict(MODE_KWARGS, min_confidence=t)
    modes += [modes_lib.Mode(original, "jspec", "adaptive", dict(kwargs)),
              modes_lib.Mode(distilled, "jspec", "adaptive", dict(kwargs))]
    d_bytes.update({original: original_bytes, distilled: tuned_bytes})
    tuned_modes[distilled] = tuned_bundle
  mismatches = []
  for i, (q, group) in enumerate(chosen):
    if set(doc["prompts"].get(q.name, {}).get("modes", {})) >= {m.name for m in modes}:
      continue  # resumed: this prompt has every mode (one short of some is run again)
    ids = prompts_lib.encode(q, bundle.tokenizer)
    recs = engine.run_modes(bundle, ids, modes, opts.max_new_tokens, opts.reps, False, t_bytes,
                            d_bytes, None, tuned_modes)
    programs.release()
    base = recs["target"]["tokens_per_s"]
    entry = {"group": group, "chat": q.chat, "prompt_tokens": len(ids), "modes": {}}
    for name, rec in recs.items():
      keep = {k: rec.get(k) for k in ("tokens_per_s", "decode_tokens_per_s", "acceptance_rate",
                                      "mean_tokens_per_round", "rounds", "drafted", "accepted",
                                      "accepted_histogram", "compile_s", "reps_identical")}
      keep["speedup_vs_target"] = rec["tokens_per_s"] / base if base else None
      keep["ids_equal_target"] = rec["token_ids"] == recs["target"]["token_ids"]
      if not keep["ids_equal_target"]:
        mismatches.append(f"{q.name}:{name}")
      entry["modes"][name] = keep
    doc["prompts"][q.name] = entry
    doc["summary"] = summarize(doc)
    doc["mismatches"] = mismatches
    _write(doc, out)
    for t in thresholds:
      original, distilled = mode_names(t)
      c, d = entry["modes"][original], entry["modes"][distilled]
      at = f" p>={t:g}" if len(thresholds) > 1 else ""
      print(f"[{i + 1}/{len(chosen)}] {q.name} ({group}){at}: acceptance "
            f"{c['acceptance_rate']:.2f} -> {d['acceptance_rate']:.2f}, tokens/round "
            f"{c['mean_tokens_per_round']:.2f} -> {d['mean_tokens_per_round']:.2f}, x target "
            f"{c['speedup_vs_target']:.2f} -> {d['speedup_vs_target']:.2f}",
            file=sys.stderr, flush=True)
  doc["summary"] = summarize(doc)
  doc["plot"] = str(plot(doc, out.with_suffix(".acceptance.png")))
  doc["wall_s"] = time.perf_counter() - t0
  _write(doc, out)
  print(json.dumps(doc["summary"], indent=1))
  print(f"results: {out}  plot: {doc['plot']}")
  if mismatches:
    print(f"FAILED: greedy ids differ from target-only: {', '.join(mismatches)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
