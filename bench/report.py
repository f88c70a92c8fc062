"""The tables a run prints: suite medians per mode, a prompt x mode matrix, llama.cpp, the verdicts."""

from __future__ import annotations

from typing import Any, Optional

from bench import results

_SHORT = {"target": "target", "heuristic": "heur", "confidence": "conf",
          "prompt_lookup": "lookup", "lookup_model": "lkp+mdl", "hf_target": "hf",
          "hf_assisted": "hf+asst", "llamacpp_target": "lcpp", "llamacpp_spec": "lcpp+spec"}


def short(mode: str) -> str:
  """A column header for a mode name."""
  return _SHORT.get(mode, mode.replace("spec_", ""))


def _fmt(value: Optional[float], spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
  widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
  line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths)))
  return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def summary_table(doc: dict[str, Any]) -> str:
  """Medians over the suite, one row per mode.

  Args:
    doc: a finalized results document.

  Returns:
    The table as text; derived rows end in "*".
  """
  summary = doc.get("summary", {})
  llama = [m for m in results.LLAMACPP_BASELINES if m in summary]
  header = ["mode", "n", "tok/s", "dec tok/s", "x target", "x hf", "x hf+asst"]
  header += [f"x {short(m)}" for m in llama]
  header += ["accept", "tok/round", "GB/s", "roofline", "compile s"]
  rows = []
  for mode, r in summary.items():
    rows.append([mode + ("*" if r.get("derived") else ""), str(r["prompts"]),
                 _fmt(r["tokens_per_s"], ".2f"), _fmt(r["decode_tokens_per_s"], ".2f"),
                 _fmt(r["speedup_vs_target"], ".2f"), _fmt(r["speedup_vs_hf_target"], ".2f"),
                 _fmt(r["speedup_vs_hf_assisted"], ".2f")]
                + [_fmt(r.get(f"speedup_vs_{m}"), ".2f") for m in llama]
                + [_fmt(r["acceptance_rate"], ".2f"),
                   _fmt(r["mean_tokens_per_round"], ".2f"), _fmt(r["achieved_gbs"], ".1f"),
                   _fmt(r["roofline_fraction"], ".0%"), _fmt(r.get("compile_s"), ".1f")])
  return _table(header, rows)


def prompt_table(doc: dict[str, Any], mode_order: list[str]) -> str:
  """One row per prompt: the target's tokens/s, then every other mode's speedup over it.

  Args:
    doc: a finalized results document.
    mode_order: modes in column order.

  Returns:
    The table as text.
  """
  shown = [m for m in mode_order if m != "target"]
  header = ["prompt", "kind", "tok", "target tok/s"] + [f"x {short(m)}" for m in shown]
  rows = []
  for name, entry in doc["prompts"].items():
    recs = entry.get("modes", {})
    base = recs.get("target", {})
    row = [name, entry["kind"], str(base.get("new_tokens", "-")),
           _fmt(base.get("tokens_per_s"), ".2f")]
    for m in shown:
      rec = recs.get(m)
      row.append("-" if rec is None else
                 _fmt(results.value(rec, "speedup_vs_target"), ".2f")
                 + ("*" if rec and "derived" in rec else ""))
    rows.append(row)
  return _table(header, rows)


def _jspec_modes(doc: dict[str, Any]) -> list[str]:
  """The jspec modes of the summary, in its order."""
  return [m for m in doc.get("summary", {})
          if any(e.get("modes", {}).get(m, {}).get("engine") == "jspec"
                 for e in doc["prompts"].values())]


def _pair(rec: dict[str, Any], field: str, llama: list[str]) -> str:
  """A record's ratios over each llama.cpp mode, joined by '/'."""
  return "/".join(_fmt(rec.get(f"{field}_vs_{m}"), ".2f") for m in llama)


def llamacpp_tables(doc: dict[str, Any]) -> str:
  """jspec against the llama.cpp peers: suite medians, medians per prompt kind, each prompt.

  Args:
    doc: a finalized results document.

  Returns:
    The tables as text, or "" when no llama.cpp record is in the document.
  """
  summary = doc.get("summary", {})
  llama = [m for m in results.LLAMACPP_BASELINES if m in summary]
  if not llama:
    return ""
  jmodes = _jspec_modes(doc)
  names = "/".join(short(m) for m in llama)
  header = (["mode", "n", "dec tok/s"] + [f"x {short(m)} dec" for m in llama]
            + [f"x {short(m)}" for m in llama])
  rows = [[m, str(summary[m]["prompts"]), _fmt(summary[m]["decode_tokens_per_s"], ".2f")]
          + [_fmt(summary[m].get(f"decode_speedup_vs_{b}"), ".2f") for b in llama]
          + [_fmt(summary[m].get(f"speedup_vs_{b}"), ".2f") for b in llama] for m in jmodes]
  rows += [[m, str(summary[m]["prompts"]), _fmt(summary[m]["decode_tokens_per_s"], ".2f")]
           + ["-"] * (2 * len(llama)) for m in llama]
  kinds = sorted({k for m in jmodes for k in summary[m].get("by_kind", {})})
  kind_rows = [[m] + [_pair(summary[m]["by_kind"].get(k, {}), "decode_speedup", llama)
                      for k in kinds] for m in jmodes]
  prompt_rows = []
  agree = doc.get("llamacpp_agreement", {})
  for name, entry in doc["prompts"].items():
    recs = entry.get("modes", {})
    if not any(m in recs for m in llama):
      continue
    texts = agree.get(name, {})
    same = lambda key: ("-" if key not in texts else "yes" if texts[key]["equal"]
                        else f"no@{texts[key]['first_diff_char']}")
    prompt_rows.append([name, entry["kind"]]
                       + [_fmt((recs.get(m) or {}).get("decode_tokens_per_s"), ".2f")
                          for m in llama]
                       + [same("llamacpp_target"), same("llamacpp_spec")]
                       + [_pair(recs[m], "decode_speedup", llama) if m in recs else "-"
                          for m in jmodes])
  return "\n\n".join([
      "llama.cpp on the same GGUF files and prompts (x = jspec over llama.cpp; dec: decode "
      "tokens/s, llama.cpp's as it reports its eval speed; without dec: prefill + decode, "
      "each engine's own clock, loading and compiling excluded):",
      _table(header, rows),
      f"Medians per prompt kind (x {names} dec):",
      _table(["mode"] + kinds, kind_rows),
      f"Per prompt (decode tok/s of {names}; text equal to jspec target-only's, spec's to "
      f"lcpp's, no@<char offset> where they part; x {names} dec):",
      _table(["prompt", "kind"] + [f"{short(m)} dec" for m in llama]
             + ["text=jspec", "spec=lcpp"] + [short(m) for m in jmodes], prompt_rows)])


def verdicts(doc: dict[str, Any]) -> str:
  """The correctness gate, HF agreement, memory and bandwidth, and the issue's targets."""
  lines = []
  gate = doc.get("gate", {})
  if gate.get("passed") and not gate.get("checked"):  # target-only alone: only its reps agree
    lines.append("CORRECTNESS: PASS - each mode's repetitions gave the same ids; no other jspec "
                 "mode ran beside target-only, so none was compared with it")
  elif gate.get("passed"):
    lines.append(f"CORRECTNESS: PASS - every jspec mode's greedy ids equal jspec target-only's "
                 f"({gate.get('checked', 0)} records checked)")
  else:
    lines.append(f"CORRECTNESS: FAIL - {len(gate.get('mismatches', []))} mismatch(es):")
    for m in gate.get("mismatches", []):
      lines.append(f"  {m['prompt']} / {m['mode']}: {m['reason']}"
                   + (f" at new token {m['first_diff']} (expected {m.get('expected')}, "
                      f"got {m.get('got')})" if m.get("first_diff") is not None else ""))
  agree = doc.get("hf_agreement", {})
  if agree:
    parts = [f"{p}: {v['hf_target']['agree_len']}/{v['hf_target']['length']}"
             for p, v in agree.items() if "hf_target" in v]
    equal = sum(1 for v in agree.values() if v.get("hf_target", {}).get("equal"))
    lines.append(f"HF target-only ids equal jspec target-only's on {equal}/{len(parts)} prompts "
                 f"(informative; tokens in agreement: {', '.join(parts)})")
  lines += _llamacpp_verdicts(doc)
  bw = doc.get("bandwidth") or {}
  if bw.get("gbs"):
    lines.append(f"memory bandwidth: {bw['gbs']:.1f} GB/s, the best of numpy sum "
                 f"{bw.get('numpy_gbs', 0):.1f}, XLA sum {bw.get('jax_sum_gbs', 0):.1f}, "
                 f"XLA matvec {bw.get('jax_matvec_gbs', 0):.1f} at the start")
  around = [e["bandwidth"]["gbs"] for e in doc.get("prompts", {}).values()
            if (e.get("bandwidth") or {}).get("gbs")]
  if around:
    lines.append(f"roofline: each prompt's records over the mean of the reads just before and "
                 f"after them ({min(around):.1f}-{max(around):.1f} GB/s over "
                 f"{len(around)} prompts)")
  elif bw.get("gbs"):
    lines.append("roofline: over the read at the start")
  paired = [rep["roof_gbs"] for e in doc.get("prompts", {}).values()
            for rep in (e.get("modes", {}).get("target") or {}).get("reps", [])
            if rep.get("roof_gbs")]
  if paired:
    lines.append(f"target-only roofline: each repetition over the reads just before and after "
                 f"it ({min(paired):.1f}-{max(paired):.1f} GB/s over {len(paired)} repetitions)")
  mem = doc.get("memory", {})
  if mem.get("peak_rss_bytes"):
    ratio = mem.get("peak_rss_over_param_bytes")
    lines.append(f"peak RSS (jspec process): {mem['peak_rss_bytes'] / 2**30:.2f} GiB"
                 + (f" = {ratio:.2f}x both models' parameter bytes" if ratio else ""))
  hf = doc.get("hf", {})
  if hf.get("peak_rss_bytes"):
    lines.append(f"peak RSS (HF child): {hf['peak_rss_bytes'] / 2**30:.2f} GiB")
  if doc.get("derived"):
    lines.append(f"* derived: speculative tokens/s from random-weight round costs and the real "
                 f"pair's histograms in {doc['derived']['source']} (see bench/derive.py)")
  tg = doc.get("targets", {})
  if tg:
    lines.append("issue 6 targets (informative):")
    for name, t in tg.items():
      if isinstance(t, dict):
        state = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        how = ""
        if t.get("paired"):
          how = (f" [each target-only repetition over the reads just before and after it, "
                 f"the median; over the reads around the prompt's records: "
                 f"{_fmt(t.get('around_prompt'), '.3g')}]")
        if t.get("bracketed"):
          how = (f" [jspec timed before and after the HF phase, the mean; before only: "
                 f"{_fmt(t.get('before_hf_only'), '.3g')}]")
        lines.append(f"  {name}: {_fmt(t['value'], '.3g')} (goal {t['goal']}) {state}{how}")
      else:
        lines.append(f"  {name}: {t}")
  return "\n".join(lines)


def _llamacpp_verdicts(doc: dict[str, Any]) -> list[str]:
  """Lines on the llama.cpp peers: why they did not run, or how their texts compare."""
  info = doc.get("llamacpp") or {}
  lines = []
  if info.get("skipped"):
    lines.append(f"llama.cpp peers skipped: {info['skipped']}")
  if info.get("error"):
    lines.append(f"llama.cpp peers failed: {info['error']}")
  agree = doc.get("llamacpp_agreement", {})
  for key, what in (("llamacpp_target", "llama.cpp target-only text equals jspec target-only's "
                                        "(its ids decoded up to their first EOS)"),
                    ("llamacpp_spec", "llama.cpp speculative text agrees with llama.cpp "
                                      "target-only's")):
    rows = {p: v[key] for p, v in agree.items() if key in v}
    if not rows:
      continue
    equal = sum(1 for v in rows.values() if v["equal"])
    lines.append(f"{what} on {equal}/{len(rows)} prompts (informative)")
    for p, v in rows.items():
      if not v["equal"]:
        lines.append(f"  {p}: they part at char {v['first_diff_char']} (of {v['lengths'][0]} and "
                     f"{v['lengths'][1]}); from char {v['excerpt_from']}: expected "
                     f"{v['expected']!r}, got {v['got']!r}")
  ids = [e["modes"]["llamacpp_target"].get("prompt_ids_equal") for e in doc["prompts"].values()
         if "llamacpp_target" in e.get("modes", {})]
  if ids:
    lines.append(f"llama.cpp's prompt ids equal jspec's on {sum(1 for i in ids if i)}/{len(ids)} "
                 "prompts")
  return lines


def render(doc: dict[str, Any], mode_order: list[str]) -> str:
  """Everything printed at the end of a run.

  Args:
    doc: a finalized results document.
    mode_order: modes in report order.

  Returns:
    The text.
  """
  s = doc["settings"]
  head = (f"jspec bench: {len(doc['prompts'])} prompts, {s['max_new_tokens']} new tokens, "
          f"median of {s['reps']} reps, {s['dtype']}, "
          f"{'random weights' if s.get('random_weights') else 'smoke models' if s.get('smoke') else s.get('model') or 'custom pair'}")
  parts = [head, "Suite medians (ratios taken per prompt, then the median):",
           summary_table(doc), "Per prompt (x = speedup over jspec target-only):",
           prompt_table(doc, mode_order), llamacpp_tables(doc), verdicts(doc)]
  return "\n\n".join(p for p in parts if p)
