"""jspec modes on one prompt: a warm-up when a mode compiles, then interleaved repetitions and their medians.

Compile time is already outside jspec's timings (`generate` compiles before it
starts the clock, and reports compile_s apart). A call that did compile is
still thrown away as a warm-up, so a freshly built program's first run never
counts; a call that reused a compiled program (an earlier prompt of the same
length bucket) is a repetition like any other.

Repetitions are interleaved across modes (target, A, B, target, A, B, ...):
this machine's memory bandwidth is shared and swings by a third over minutes,
and a memory-bound target-only step feels it more than a verify does, so
timing each mode's repetitions back to back put a swing on whichever mode
happened to run during it, and the ratios with it. A bundle is prepared
once at load and no call changes it, so alternating modes costs nothing.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import jspec
from bench import memory
from bench import modes as modes_lib
from convert import config as config_lib
from jspec import api
from jspec import options as options_lib


def _median(values: Sequence[float]) -> float:
  return float(statistics.median(values)) if values else float("nan")


def run_modes(bundle: jspec.Bundle, ids: list[int], modes: Sequence[modes_lib.Mode],
              max_new_tokens: int, reps: int, stop_at_eos: bool, target_bytes: int,
              draft_bytes: Mapping[str, Optional[int]],
              read_roof: Optional[Callable[[], Optional[float]]] = None,
              bundles: Optional[Mapping[str, jspec.Bundle]] = None
              ) -> dict[str, dict[str, Any]]:
  """Measures jspec modes on one prompt.

  Every mode's programs are compiled first, all before any runs; then every
  mode gets one call that is thrown away if it compiled (there or then);
  then repetition r of every mode runs before repetition r + 1 of any. A mode's
  compiled programs are kept until the caller releases them
  (`jspec.programs.release`), so alternating compiles nothing.

  Args:
    bundle: the loaded pair.
    ids: prompt token ids.
    modes: jspec modes.
    max_new_tokens: tokens to generate.
    reps: timed repetitions (>= 1); figures are their medians.
    stop_at_eos: end at the tokenizer's EOS tokens (the run's stopping rule).
    target_bytes: weight bytes one target forward reads (`memory.forward_bytes`).
    draft_bytes: mode name -> the draft's weight bytes per draft forward
      (None without one).
    read_roof: a memory bandwidth read (GB/s, or None where it failed),
      taken just before and just after each target-only call: each timed
      repetition then gets the mean of its two reads (`_paired_roof`).
    bundles: mode name -> the bundle that mode runs where it is not
      `bundle` (a float-draft mode's, `bench.models.Loaded.bundle_for`).

  Returns:
    Mode name -> its record for the results JSON: token_ids (of the first
    timed repetition), reps_identical, new_tokens, medians (tokens_per_s,
    decode_tokens_per_s, prefill_s, decode_s), per-repetition timings, the
    engine's counters (rounds, acceptance, histogram, gamma trace),
    compile_s and warmup_s, and achieved_gbs (with read_roof, target-only's
    paired_roofline_fraction too).
  """
  bundles = bundles or {}
  runs: dict[str, list] = {m.name: [] for m in modes}
  roofs: dict[str, list] = {m.name: [] for m in modes}  # per timed call: [before, after] GB/s
  warm: dict[str, tuple] = {}
  # Every mode's programs compile before any mode runs: a compile's working
  # memory then comes before the weights' pages are read, not on top of
  # them (docs/decisions-compact.md, "Peak memory of a first run").
  kwargs = {m.name: dict(max_new_tokens=max_new_tokens, temperature=0.0, stop_at_eos=stop_at_eos,
                         **m.kwargs) for m in modes}  # each mode's `jspec.generate` options
  compiled = {m.name: api.request(bundles.get(m.name, bundle), ids,
                                  options_lib.make(None, **kwargs[m.name])).compile_seconds()
              for m in modes}  # seconds compiling now (0 where ready); nothing runs

  def call(m: modes_lib.Mode) -> None:
    paired = read_roof is not None and m.kwargs.get("method") == "target"
    before = read_roof() if paired else None
    t0 = time.perf_counter()
    result = jspec.generate(bundles.get(m.name, bundle), ids, **kwargs[m.name])
    wall = time.perf_counter() - t0
    after = read_roof() if paired else None
    fresh = compiled[m.name] > 0 or result.stats["compile_s"] > 0  # a freshly built program
    if m.name not in warm and fresh:
      warm[m.name] = (result, wall, compiled[m.name] + result.stats["compile_s"])
    else:
      runs[m.name].append(result)
      roofs[m.name].append([before, after])

  while any(len(runs[m.name]) < reps for m in modes):
    for m in modes:
      if len(runs[m.name]) < reps:
        call(m)
  one_row = one_row_bytes(bundle.target.cfg, bundle.target.params, target_bytes)
  records = {m.name: _record(m, runs[m.name], warm.get(m.name), target_bytes,
                             draft_bytes[m.name], one_row)
             for m in modes}
  for m in modes:
    if read_roof is not None and m.kwargs.get("method") == "target":
      _paired_roof(records[m.name], roofs[m.name])
  return records


def _paired_roof(record: dict[str, Any], reads: list[list[Optional[float]]]) -> None:
  """Adds each repetition's roof and the median of their roofline fractions to a target-only record.

  The machine's bandwidth swings between about 40 and 70 GB/s within a
  minute (the same forward took 85 and 131 ms in processes minutes apart),
  and a prompt's records take minutes: a roof read on either side of them
  (`runner._bracket`) meets a repetition at another moment than the one it
  ran in. Read just before and just after each repetition, the roof is
  taken at the rep's own time; the fraction of each repetition is its
  weight bytes per second over the mean of its two reads, and the record's
  is the median of those, as its speed is the median of its repetitions'.

  Args:
    record: a target-only record of `_record` (changed in place: each
      reps entry gets roof_gbs and achieved_gbs, the record
      paired_roofline_fraction, None if no repetition had a read).
    reads: per timed repetition, [before, after] GB/s (None where a read failed).
  """
  fractions = []
  for rep, pair in zip(record["reps"], reads):
    ok = [r for r in pair if r is not None]
    rep["roof_gbs"] = sum(ok) / len(ok) if ok else None
    rep["achieved_gbs"] = (record["bytes_read_decode"] / rep["decode_s"] / 1e9
                           if rep["decode_s"] > 0 else None)
    if rep["roof_gbs"] and rep["achieved_gbs"] is not None:
      fractions.append(rep["achieved_gbs"] / rep["roof_gbs"])
  record["paired_roofline_fraction"] = _median(fractions) if fractions else None


def one_row_bytes(cfg: config_lib.Qwen2Config, params: dict,
                  target_bytes: int) -> Optional[int]:
  """Weight bytes of a greedy one-row target forward that reads the int8 head (`jspec.greedy_head`).

  Args:
    cfg: the target's config.
    params: the target's params as prepared.
    target_bytes: weight bytes of one target forward (the float32 head read
      whole, `memory.forward_bytes`).

  Returns:
    target_bytes with the float32 head's bytes replaced by the greedy
    head's (the candidates' few float rows not counted), or None when the
    target carries no greedy head.
  """
  if params.get("greedy_head") is None:
    return None
  return int(target_bytes - memory.head_bytes(cfg, params) + memory.greedy_head_bytes(params))


def _record(mode: modes_lib.Mode, runs: list, warm: Optional[tuple], target_bytes: int,
            draft_bytes: Optional[int], one_row: Optional[int]) -> dict[str, Any]:
  """One mode's record from its timed calls and its warm-up (see `run_modes`)."""
  compile_s = 0.0
  warmup_s, warmup_ids = None, None
  if warm is not None:
    result, warmup_s, compile_s = warm
    warmup_ids = result.token_ids
  first, last = runs[0], runs[-1]
  every_ids = [r.token_ids for r in runs] + ([warmup_ids] if warmup_ids is not None else [])
  stats = last.stats
  n_new = len(first.token_ids)
  prefill = [r.stats["prefill_s"] for r in runs]
  decode = [r.stats["decode_s"] for r in runs]
  # Tokens per second over prefill + decode (what a user waits for; compile
  # excluded), and over the decode loop alone, where the first token (emitted
  # by the prefill) does not count.
  tps = [r.stats["tokens_per_s"] for r in runs]
  dtps = [(len(r.token_ids) - 1) / r.stats["decode_s"] for r in runs if r.stats["decode_s"] > 0]
  record = {
      "engine": "jspec",
      "token_ids": list(first.token_ids),
      "reps_identical": all(i == first.token_ids for i in every_ids),  # warm-up included
      "new_tokens": n_new,
      "tokens_per_s": _median(tps),
      "decode_tokens_per_s": _median(dtps),
      "prefill_s": _median(prefill),
      "decode_s": _median(decode),
      "reps": [{"prefill_s": r.stats["prefill_s"], "decode_s": r.stats["decode_s"],
                "tokens_per_s": r.stats["tokens_per_s"]} for r in runs],
      "compile_s": compile_s,
      "warmup_s": warmup_s,
      "rounds": stats["rounds"],
      "drafted": stats["drafted"],
      "accepted": stats["accepted"],
      "acceptance_rate": stats["acceptance_rate"],
      "mean_tokens_per_round": stats["mean_tokens_per_round"],
      "accepted_histogram": list(stats["accepted_histogram"]),
      "gamma_trace": list(stats["gamma_trace"]),
  }
  # One round's cost: what a speculative round of this gamma costs on these
  # shapes whatever the weights (see bench.derive).
  record["round_s"] = record["decode_s"] / stats["rounds"] if stats["rounds"] else float("nan")
  record["bytes_read_decode"] = decode_bytes(mode, stats, target_bytes, draft_bytes, one_row)
  record["achieved_gbs"] = (record["bytes_read_decode"] / record["decode_s"] / 1e9
                            if record["decode_s"] > 0 else float("nan"))
  return record


def decode_bytes(mode: modes_lib.Mode, stats: dict[str, Any], target_bytes: int,
                 draft_bytes: Optional[int], one_row: Optional[int] = None) -> int:
  """Weight bytes the decode loop read: per round one target forward, plus the draft's steps.

  Per round the target runs one forward (a single token for target-only, the
  gamma + 1 verify positions otherwise: its weights are read once either way)
  and the draft model runs one forward per draft it proposed. The drafted
  count is exact for fixed gamma and the heuristic policy, and a lower bound
  for the confidence policy (the step whose confidence stops a row was run
  too). The prefill is not counted: decode_s does not include it. A greedy
  one-row forward (every target-only round; a prompt-lookup round that found
  nothing to copy) reads the int8 head instead of the float32 one where the
  target has it (`one_row`).

  Args:
    mode: the mode.
    stats: `Result.stats` of one call.
    target_bytes: weight bytes of one target forward.
    draft_bytes: weight bytes of one draft forward (None without a draft).
    one_row: weight bytes of a greedy one-row target forward (`one_row_bytes`),
      or None when it reads what any other does.

  Returns:
    Bytes.
  """
  method = mode.kwargs.get("method")
  single = 0  # rounds whose verify is one row
  if one_row is not None and method == "target":
    single = stats["rounds"]
  elif one_row is not None and method == "prompt_lookup":
    single = sum(1 for g in stats["gamma_trace"] if g == 0)
  total = (stats["rounds"] - single) * target_bytes + single * (one_row or 0)
  if mode.uses_draft and draft_bytes:
    total += stats["drafted"] * draft_bytes
  return int(total)
