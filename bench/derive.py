"""Derived speculative figures for runs on random weights (`--random-weights --histograms CPU.json`).

With random weights the draft and the target never agree, so a speculative
round emits one token, but it costs exactly what a real round of the same
gamma costs (G draft steps and one verify of G + 1 positions; cost depends on
shapes, not values). What random weights cannot give is how many tokens a
round emits; the real pair measured that on CPU, in its accepted-length
histograms. So, for mode spec_g<G> on a prompt:

  E          = sum_k (k + 1) * hist[k] / sum_k hist[k]
               (k drafts accepted, plus the token the target adds, per round;
               hist from the real pair's record of the same prompt and mode,
               or the suite's summed histogram when the prompt is missing)
  round_s    = decode_s / rounds, measured here on random weights
  decode_s'  = (new_tokens - 1) / E * round_s
  tokens/s'  = new_tokens / (prefill_s + decode_s')     (the figure compared)
  decode tokens/s' = E / round_s

Every such figure sits under record["derived"] and is labelled "derived" in
tables and plots; the measured ones stay beside it.
"""

from __future__ import annotations

from typing import Any, Optional

MODE_PREFIX = "spec_g"


def tokens_per_round(hist: list[int]) -> Optional[float]:
  """Mean tokens a round emits, from an accepted-length histogram.

  Args:
    hist: hist[k] = rounds in which k drafts were accepted.

  Returns:
    E, or None for an empty histogram.
  """
  rounds = sum(hist)
  if not rounds:
    return None
  return sum((k + 1) * h for k, h in enumerate(hist)) / rounds


def _suite_histogram(source: dict[str, Any], mode: str) -> Optional[list[int]]:
  """The histograms of one mode summed over every prompt of a results document."""
  total: list[int] = []
  for entry in source.get("prompts", {}).values():
    rec = entry.get("modes", {}).get(mode)
    if rec and rec.get("accepted_histogram"):
      hist = rec["accepted_histogram"]
      total = [a + b for a, b in zip(total + [0] * (len(hist) - len(total)),
                                     hist + [0] * (len(total) - len(hist)))]
  return total or None


def apply(doc: dict[str, Any], source: dict[str, Any], source_name: str) -> dict[str, Any]:
  """Adds record["derived"] to every spec_g<G> record of a random-weights run.

  Args:
    doc: the random-weights results document (changed in place).
    source: a results document of the real pair (the --histograms file).
    source_name: its path, recorded with the figures.

  Returns:
    A note for doc["derived"]: source, formula, which records were derived
    and from which histogram.
  """
  used = []
  for name, entry in doc["prompts"].items():
    for mode, rec in entry.get("modes", {}).items():
      if not mode.startswith(MODE_PREFIX) or not rec.get("rounds"):
        continue
      real = source.get("prompts", {}).get(name, {}).get("modes", {}).get(mode)
      hist, origin = (real or {}).get("accepted_histogram"), "prompt"
      if not hist:
        hist, origin = _suite_histogram(source, mode), "suite"
      e = tokens_per_round(hist) if hist else None
      if e is None:
        continue
      round_s = rec["decode_s"] / rec["rounds"]
      n = rec["new_tokens"]
      decode_s = (n - 1) / e * round_s
      rec["derived"] = {
          "tokens_per_s": n / (rec["prefill_s"] + decode_s),
          "decode_tokens_per_s": e / round_s,
          "mean_tokens_per_round": e,
          "acceptance_rate": (real or {}).get("acceptance_rate") if origin == "prompt" else None,
          "round_s": round_s,
          "decode_s": decode_s,
          "histogram": hist,
          "histogram_from": origin,
      }
      used.append({"prompt": name, "mode": mode, "histogram_from": origin})
  note = {"source": source_name, "records": used,
          "formula": "tokens/s = new_tokens / (prefill_s + (new_tokens - 1) / E * round_s); "
                     "E = sum_k (k+1) hist[k] / sum_k hist[k] from the real pair's histogram; "
                     "round_s measured on random weights of the real shapes"}
  doc["derived"] = note
  return note
