"""The settings a run measures: jspec modes (each a `jspec.generate` call) and the peers.

Mode names are the keys of the results JSON:
  target            jspec, the target alone (the baseline every ratio and the
                    correctness gate refer to)
  spec_g<G>         jspec, draft model, fixed gamma G
  heuristic         jspec, draft model, gamma +2 after a fully accepted round, -1 otherwise
  confidence        jspec, draft model, drafting stops when the draft's top
                    probability falls below --min-confidence
  confidence_f32    the same with a second draft loaded with its float
                    weights, where the default drafts with int8 ones on CPU
                    (--float-draft; `jspec.Settings(draft_int8=False)`)
  prompt_lookup     jspec, drafts copied from earlier n-grams (no draft model)
  lookup_model      jspec, prompt lookup where the last n-gram occurred before,
                    the draft model (confidence policy) where it did not (up
                    to --lookup-model-gamma-max drafts)
  hf_target         HF transformers `generate`, the target alone
  hf_assisted       HF transformers `generate` with `assistant_model=` the draft
  llamacpp_target   llama.cpp's llama-completion, the target GGUF alone, greedy
                    (`bench.llamacpp`; only where its tools are built)
  llamacpp_spec     llama.cpp's llama-speculative-simple with the draft GGUF,
                    at most --llamacpp-draft-max drafts per step (given
                    several, each prompt keeps its fastest)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

from jspec import options as options_lib

HF_MODES = ("hf_target", "hf_assisted")
LLAMACPP_MODES = ("llamacpp_target", "llamacpp_spec")
GROUPS = {
    "spec": "every spec_g<G> of --gammas",
    "adaptive": "heuristic and confidence (and confidence_f32 with --float-draft)",
    "lookup": "prompt_lookup and lookup_model",
    "hf": "hf_target and hf_assisted",
    "llamacpp": "llamacpp_target and llamacpp_spec",
    "jspec": "every jspec mode",
}


@dataclasses.dataclass(frozen=True)
class Mode:
  """One measured setting.

  Attributes:
    name: key in the results (see the module docstring).
    engine: "jspec", "hf" or "llamacpp".
    group: "target", "spec", "adaptive", "lookup", "hf" or "llamacpp".
    kwargs: fields of `jspec.Options`, as keyword arguments of
      `jspec.generate` (jspec modes); llama.cpp's settings, threads and
      draft_max (llama.cpp modes); empty for the HF peers.
    gamma: the fixed gamma of a spec_g<G> mode, else None.
    draft_int8: how the draft this mode runs is loaded
      (`jspec.Settings.draft_int8`): None the run's bundle (int8 on CPU),
      False a second draft with its float weights.
  """

  name: str
  engine: str
  group: str
  kwargs: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
  gamma: Optional[int] = None
  draft_int8: Optional[bool] = None

  @property
  def uses_draft(self) -> bool:
    """Whether the draft model runs every round (its weight reads count in GB/s).

    lookup_model runs it only in some rounds, which the stats do not tell
    apart: its GB/s counts the target's reads alone (a lower bound).
    """
    return self.engine == "jspec" and self.kwargs.get("method") == "model"


def all_modes(gammas: Sequence[int], adaptive_gamma_max: int, min_confidence: float,
              lookup_gamma: int, ngram: int, float_draft: bool = False,
              lookup_model_gamma_max: int = 16,
              llamacpp_draft_max: Union[int, Sequence[int]] = (4, 8),
              llamacpp_threads: int = 2, confidence_gamma: Optional[int] = None) -> list[Mode]:
  """Every mode a default run measures, in report order.

  Args:
    gammas: fixed gammas for the spec_g<G> modes.
    adaptive_gamma_max: static gamma bound of the heuristic policy.
    min_confidence: threshold of the "confidence" policy.
    lookup_gamma: drafts per round of prompt lookup.
    ngram: n-gram length of prompt lookup.
    float_draft: one more confidence mode whose draft keeps its float
      weights, to compare with the int8 draft of the default in one run.
    lookup_model_gamma_max: static gamma bound of lookup_model.
    llamacpp_draft_max: llama.cpp's drafts per step (--spec-draft-n-max) in
      llamacpp_spec: one, or several of which each prompt keeps the fastest
      (`bench.llamacpp.peer_records`).
    llamacpp_threads: CPU threads of the llama.cpp peers (target and draft).
    confidence_gamma: the "confidence" mode's cap (None: the library's
      default, so that the mode is `jspec.generate`'s default).

  Returns:
    The modes.
  """
  draft = {"method": "model"}
  modes = [Mode("target", "jspec", "target", {"method": "target"})]
  for g in gammas:
    modes.append(Mode(f"spec_g{g}", "jspec", "spec",
                      {**draft, "gamma": g, "policy": "fixed"}, gamma=g))
  g_max = adaptive_gamma_max
  modes.append(Mode("heuristic", "jspec", "adaptive",
                    {**draft, "gamma": min(4, g_max), "gamma_max": g_max,
                     "policy": "heuristic"}))
  # gamma = gamma_max: the confidence policy drafts while the row wants more
  # (gamma) and stays confident, so a smaller gamma would cap it below G.
  g_conf = options_lib.DEFAULT_GAMMA["confidence"] if confidence_gamma is None else confidence_gamma
  modes.append(Mode("confidence", "jspec", "adaptive",
                    {**draft, "gamma": g_conf, "gamma_max": g_conf,
                     "policy": "confidence", "min_confidence": min_confidence}))
  if float_draft:
    modes.append(Mode("confidence_f32", "jspec", "adaptive", dict(modes[-1].kwargs),
                      draft_int8=False))
  modes.append(Mode("prompt_lookup", "jspec", "lookup",
                    {"method": "prompt_lookup", "gamma": lookup_gamma, "ngram": ngram,
                     "policy": "fixed"}))
  g_lookup = lookup_model_gamma_max
  modes.append(Mode("lookup_model", "jspec", "lookup",
                    {**draft, "method": "lookup_model", "gamma": g_lookup, "gamma_max": g_lookup,
                     "ngram": ngram, "policy": "confidence", "min_confidence": min_confidence}))
  modes.append(Mode("hf_target", "hf", "hf"))
  modes.append(Mode("hf_assisted", "hf", "hf"))
  modes.append(Mode("llamacpp_target", "llamacpp", "llamacpp", {"threads": llamacpp_threads}))
  lengths = ((llamacpp_draft_max,) if isinstance(llamacpp_draft_max, int)
             else tuple(llamacpp_draft_max))
  modes.append(Mode("llamacpp_spec", "llamacpp", "llamacpp",
                    {"threads": llamacpp_threads,
                     "draft_max": lengths[0] if len(lengths) == 1 else lengths}))
  return modes


def select(modes: Sequence[Mode], spec: Optional[str], hf: bool = True,
           llamacpp: bool = True) -> list[Mode]:
  """Picks modes by a `--modes` value; "target" is always kept (the baseline).

  Args:
    modes: from `all_modes`.
    spec: None (all) or comma-separated mode names and group names (see GROUPS).
    hf: False drops the HF peers (`--no-hf`).
    llamacpp: False drops the llama.cpp peers (`--no-llamacpp`).

  Returns:
    The chosen modes, in report order.

  Raises:
    ValueError: an unknown name (the message lists the known names).
  """
  chosen = list(modes)
  if spec:
    wanted = {w.strip() for w in spec.split(",") if w.strip()}
    names = {m.name for m in modes}
    unknown = sorted(wanted - names - set(GROUPS))
    if unknown:
      raise ValueError(f"unknown modes {unknown}; known: {sorted(names)} and groups "
                       f"{sorted(GROUPS)}")
    chosen = [m for m in modes if m.name == "target" or m.name in wanted or m.group in wanted
              or ("jspec" in wanted and m.engine == "jspec")]
  if not hf:
    chosen = [m for m in chosen if m.engine != "hf"]
  if not llamacpp:
    chosen = [m for m in chosen if m.engine != "llamacpp"]
  return chosen


def describe(mode: Mode) -> dict[str, Any]:
  """The settings of a mode as recorded in the results JSON.

  Args:
    mode: the mode.

  Returns:
    Its engine, group, gamma and `jspec.generate` arguments, and
    draft_int8 where the mode loads its own draft.
  """
  out = {"engine": mode.engine, "group": mode.group, "gamma": mode.gamma, **mode.kwargs}
  if mode.draft_int8 is not None:
    out["draft_int8"] = mode.draft_int8
  return out
