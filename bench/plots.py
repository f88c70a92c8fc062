"""PNG plots beside the results JSON (matplotlib, Agg backend: no display needed).

  <name>.speedup_vs_gamma.png   speedup over jspec target-only against gamma,
                                one line per prompt, the suite median in black
  <name>.tokens_per_s.png       tokens/s of every mode and peer: suite median
                                bars, one dot per prompt
  <name>.histograms.png         accepted drafts per round, one panel per mode,
                                summed over the prompts
  <name>.vs_llamacpp.png        (with llama.cpp records) each jspec mode's decode
                                speedup over llamacpp_target and llamacpp_spec:
                                suite median bars, one dot per prompt
Derived figures (--random-weights) are hatched or dashed and say so.
"""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

from bench import results


def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def _spec_modes(doc: dict[str, Any]) -> list[tuple[int, str]]:
  modes = {m for e in doc["prompts"].values() for m in e.get("modes", {})}
  return sorted((int(m[len("spec_g"):]), m) for m in modes if m.startswith("spec_g"))


def speedup_vs_gamma(doc: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
  """Speedup over jspec target-only against gamma, per prompt.

  Args:
    doc: a finalized results document.
    path: the PNG to write.

  Returns:
    path.
  """
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 5))
  spec = _spec_modes(doc)
  derived = False
  for name, entry in doc["prompts"].items():
    pts = [(g, results.value(entry["modes"][m], "speedup_vs_target")) for g, m in spec
           if m in entry.get("modes", {})]
    pts = [(g, v) for g, v in pts if v is not None]
    derived |= any("derived" in entry["modes"][m] for _, m in spec if m in entry["modes"])
    if pts:
      ax.plot(*zip(*pts), marker="o", alpha=0.45, linewidth=1,
              linestyle="--" if derived else "-", label=f"{name} ({entry['kind']})")
  med = [(g, doc.get("summary", {}).get(m, {}).get("speedup_vs_target")) for g, m in spec]
  med = [(g, v) for g, v in med if v is not None]
  if med:
    ax.plot(*zip(*med), color="black", linewidth=3, marker="s", label="suite median")
  summary = doc.get("summary", {})
  for mode, color in (("heuristic", "tab:purple"), ("confidence", "tab:green"),
                      ("prompt_lookup", "tab:orange"), ("lookup_model", "tab:brown"),
                      ("hf_assisted", "tab:red"), ("llamacpp_target", "tab:olive"),
                      ("llamacpp_spec", "tab:green")):
    value = results.value(summary[mode], "speedup_vs_target") if mode in summary else None
    if value is not None:  # modes without a fixed gamma: their suite median as a level
      ax.axhline(value, color=color, linestyle=":", label=f"{mode} (median)")
  ax.axhline(1.0, color="grey", linewidth=0.8)
  ax.set_xticks([g for g, _ in spec])
  ax.set_xlabel("gamma (drafts per round)")
  ax.set_ylabel("speedup over jspec target-only" + (" (derived)" if derived else ""))
  ax.set_title("Speculative decoding: speedup vs gamma" + (" - derived" if derived else ""))
  ax.legend(fontsize=7, ncol=2)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def tokens_per_s(doc: dict[str, Any], path: pathlib.Path, mode_order: list[str]) -> pathlib.Path:
  """Tokens/s of every mode and peer: the suite median as a bar, each prompt as a dot.

  Args:
    doc: a finalized results document.
    path: the PNG to write.
    mode_order: modes in bar order.

  Returns:
    path.
  """
  plt = _pyplot()
  modes = [m for m in mode_order if m in doc.get("summary", {})]
  fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(modes) + 2), 5))
  for i, mode in enumerate(modes):
    vals = [results.value(e["modes"][mode], "tokens_per_s") for e in doc["prompts"].values()
            if mode in e.get("modes", {})]
    vals = [v for v in vals if v is not None]
    if not vals:
      continue
    derived = doc["summary"][mode].get("derived")
    color = ("tab:red" if mode.startswith("hf") else "tab:grey" if mode == "target"
             else "tab:green" if mode.startswith("llamacpp") else "tab:blue")
    med = statistics.median(vals)
    ax.bar(i, med, color=color, alpha=0.6, hatch="//" if derived else None)
    ax.annotate(f"{med:.3g}", (i, med), ha="center", va="bottom", fontsize=8,
                xytext=(0, 2), textcoords="offset points")
    ax.scatter([i] * len(vals), vals, color="black", s=8, zorder=3)
  ax.set_xticks(range(len(modes)))
  ax.set_xticklabels([m + ("*" if doc["summary"][m].get("derived") else "") for m in modes],
                     rotation=45, ha="right")
  ax.set_ylabel("tokens/s (prefill + decode, compile excluded)")
  title = "Tokens/s per mode (bars: suite median; dots: prompts)"
  if any(doc["summary"][m].get("derived") for m in modes):
    title += "\n* hatched: derived from round cost and real histograms"
  ax.set_title(title)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def histograms(doc: dict[str, Any], path: pathlib.Path, mode_order: list[str]) -> pathlib.Path:
  """Accepted drafts per round, one panel per speculative mode, summed over the prompts.

  Args:
    doc: a finalized results document.
    path: the PNG to write.
    mode_order: modes in panel order.

  Returns:
    path.
  """
  plt = _pyplot()
  panels = []
  for mode in mode_order:
    total: list[int] = []
    for e in doc["prompts"].values():
      rec = e.get("modes", {}).get(mode)
      hist = ((rec.get("derived") or {}).get("histogram") or rec.get("accepted_histogram")
              if rec else None)
      if hist and mode != "target":
        total = [a + b for a, b in zip(total + [0] * (len(hist) - len(total)),
                                       hist + [0] * (len(total) - len(hist)))]
    if sum(total):
      panels.append((mode, total))
  cols = min(4, max(1, len(panels)))
  rows = max(1, -(-len(panels) // cols))
  fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
  for ax in axes.flat:
    ax.axis("off")
  for ax, (mode, hist) in zip(axes.flat, panels):
    ax.axis("on")
    n = sum(hist)
    ax.bar(range(len(hist)), [h / n for h in hist], color="tab:blue")
    ax.set_title(f"{mode} ({n} rounds)", fontsize=9)
    ax.set_xlabel("drafts accepted in a round", fontsize=8)
    ax.set_xticks(range(len(hist)))
    ax.tick_params(labelsize=7)
  fig.suptitle("Accepted-length histograms (fraction of rounds, all prompts)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def vs_llamacpp(doc: dict[str, Any], path: pathlib.Path, mode_order: list[str]) -> pathlib.Path:
  """Each jspec mode's decode speedup over the llama.cpp peers: suite median bars, a dot per prompt.

  Args:
    doc: a finalized results document with llama.cpp records.
    path: the PNG to write.
    mode_order: modes in bar order (the jspec ones are drawn).

  Returns:
    path.
  """
  plt = _pyplot()
  llama = [m for m in results.LLAMACPP_BASELINES if m in doc.get("summary", {})]
  modes = [m for m in mode_order if m in doc.get("summary", {})
           and any(e.get("modes", {}).get(m, {}).get("engine") == "jspec"
                   for e in doc["prompts"].values())]
  width = 0.8 / max(1, len(llama))
  fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(modes) + 2), 5))
  for j, (base, color) in enumerate(zip(llama, ("tab:olive", "tab:green"))):
    field = f"decode_speedup_vs_{base}"
    for i, mode in enumerate(modes):
      vals = [e["modes"][mode].get(field) for e in doc["prompts"].values()
              if mode in e.get("modes", {})]
      vals = [v for v in vals if v is not None]
      if not vals:
        continue
      x = i - 0.4 + width * (j + 0.5)
      med = statistics.median(vals)
      ax.bar(x, med, width, color=color, alpha=0.6, label=f"over {base}" if i == 0 else None)
      ax.annotate(f"{med:.2f}", (x, med), ha="center", va="bottom", fontsize=7,
                  xytext=(0, 2), textcoords="offset points")
      ax.scatter([x] * len(vals), vals, color="black", s=8, zorder=3)
  ax.axhline(1.0, color="grey", linewidth=0.8)
  ax.set_xticks(range(len(modes)))
  ax.set_xticklabels(modes, rotation=45, ha="right")
  ax.set_ylabel("jspec decode tok/s over llama.cpp's")
  ax.set_title("jspec over llama.cpp, the same GGUF files and prompts\ndecode tok/s, llama.cpp's "
               "as it reports its eval speed; bars: median, dots: prompts", fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def write_all(doc: dict[str, Any], json_path: pathlib.Path, mode_order: list[str]) -> list[str]:
  """Writes every plot beside the JSON file.

  Args:
    doc: a finalized results document.
    json_path: the results file; plots are named after its stem.
    mode_order: modes in report order.

  Returns:
    The paths written.
  """
  json_path = pathlib.Path(json_path)
  stem = json_path.with_suffix("")
  out = [tokens_per_s(doc, pathlib.Path(f"{stem}.tokens_per_s.png"), mode_order),
         histograms(doc, pathlib.Path(f"{stem}.histograms.png"), mode_order)]
  if _spec_modes(doc):
    out.append(speedup_vs_gamma(doc, pathlib.Path(f"{stem}.speedup_vs_gamma.png")))
  if any(m in doc.get("summary", {}) for m in results.LLAMACPP_BASELINES):
    out.append(vs_llamacpp(doc, pathlib.Path(f"{stem}.vs_llamacpp.png"), mode_order))
  return [str(p) for p in out]
