"""Generation options: one validated object, one set of defaults, shared by every entry point.

`jspec.generate`, `jspec.stream`, the `jspec` command and the bench all build
an `Options`; its checks run when it is made, before anything is loaded or
compiled, and `spec` turns it into the static `decode.Spec` a program is
compiled for.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from jspec import decode
from jspec import model
from jspec import sampling

METHODS = decode.METHODS  # "model", "prompt_lookup", "lookup_model", "target"
POLICIES = decode.POLICIES  # "fixed", "heuristic", "confidence"
# The default policy, its gamma and threshold, chosen by the bench on the
# real pair (docs/decisions.md, "Default policy"): on two cores a verify is
# bound by its multiply-adds, so a long round costs about what it returns.
DEFAULT_POLICY = "confidence"
DEFAULT_GAMMA = {"fixed": 4, "heuristic": 4, "confidence": 5}
DEFAULT_MIN_CONFIDENCE = 0.7
# method "lookup_model" with the confidence policy copies up to this many
# tokens a round: a copied span costs one verify however long it is
# (docs/decisions.md, "lookup_model").
DEFAULT_LOOKUP_MODEL_GAMMA = 16
HEURISTIC_GAMMA_MAX = 8  # the heuristic's bound when gamma_max is not given
# Bounds on what a user can ask for, so that nothing huge is compiled: every
# draft slot is a [B, V] distribution and a verify position, and no policy
# measured gained past 16 (docs/decisions.md, "Bounds").
MAX_GAMMA = 32
MAX_NGRAM = 16
MAX_BATCH = 64
# Temperatures are divided into float32 logits: below this the scaled logits
# overflow, above it the distribution is uniform to float32 precision.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3
MAX_SEED = 2**32 - 1


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class Options:
  """How to generate: every option of `jspec.generate`, checked when made.

  Attributes:
    max_new_tokens: tokens to generate per row (fewer if EOS comes first).
    temperature: 0 for greedy, else in [MIN_TEMPERATURE, MAX_TEMPERATURE].
    top_k: keep the k most likely tokens (0: off).
    top_p: nucleus mass in (0, 1] (1: off).
    method: "model" (a draft model), "prompt_lookup" (copies of earlier
      n-grams, no draft model), "lookup_model" (copies where the last
      n-gram occurred before, the draft model elsewhere), or "target" (the
      target alone: the baseline).
    gamma: drafts per round: the fixed value, the heuristic's start, the
      confidence policy's cap (default `DEFAULT_GAMMA` of the policy; at
      least `DEFAULT_LOOKUP_MODEL_GAMMA` for "lookup_model" with the
      confidence policy). At most `MAX_GAMMA`.
    gamma_max: static bound on gamma (default: gamma; `HEURISTIC_GAMMA_MAX`
      for the heuristic). At most `MAX_GAMMA`.
    policy: "fixed", "heuristic" (+2 after a fully accepted round, -1
      otherwise) or "confidence" (a row stops drafting when the draft's top
      probability falls below min_confidence).
    min_confidence: the confidence policy's threshold, in [0, 1].
    ngram: longest suffix prompt lookup matches, 1..MAX_NGRAM (shorter
      matches draft half as many per token shorter; "lookup_model" copies
      only after a full match).
    seed: one seed reproduces one generation exactly; 0..2**32 - 1.
    stop_at_eos: end a row at the tokenizer's (or config's) EOS tokens.
  """

  max_new_tokens: int = 128
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  method: str = "model"
  gamma: Optional[int] = None
  gamma_max: Optional[int] = None
  policy: str = DEFAULT_POLICY
  min_confidence: float = DEFAULT_MIN_CONFIDENCE
  ngram: int = 3
  seed: int = 0
  stop_at_eos: bool = True

  def __post_init__(self):
    if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected an integer >= 1")
    t = self.temperature
    if not _is_number(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
      raise ValueError(f"temperature={t!r}: expected 0 (greedy) or a number in "
                       f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]")
    if not _is_int(self.top_k) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 = off)")
    if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p!r}: expected a number in (0, 1] (1 = off)")
    if self.method not in METHODS:
      raise ValueError(f"method={self.method!r}: expected one of {', '.join(METHODS)}")
    if self.policy not in POLICIES:
      raise ValueError(f"policy={self.policy!r}: expected one of {', '.join(POLICIES)}")
    for name in ("gamma", "gamma_max"):
      value = getattr(self, name)
      if value is not None and (not _is_int(value) or not 1 <= value <= MAX_GAMMA):
        raise ValueError(f"{name}={value!r}: expected an integer in [1, {MAX_GAMMA}]")
    if (self.gamma is not None and self.gamma_max is not None
        and self.gamma > self.gamma_max):
      raise ValueError(f"gamma={self.gamma} exceeds gamma_max={self.gamma_max}")
    if not _is_number(self.min_confidence) or not 0 <= self.min_confidence <= 1:
      raise ValueError(f"min_confidence={self.min_confidence!r}: expected a probability in [0, 1]")
    if not _is_int(self.ngram) or not 1 <= self.ngram <= MAX_NGRAM:
      raise ValueError(f"ngram={self.ngram!r}: expected an integer in [1, {MAX_NGRAM}]")
    if not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
      raise ValueError(f"seed={self.seed!r}: expected an integer in [0, {MAX_SEED}]")
    if not isinstance(self.stop_at_eos, bool):
      raise ValueError(f"stop_at_eos={self.stop_at_eos!r}: expected True or False")

  @property
  def uses_draft(self) -> bool:
    """Whether this method runs a draft model."""
    return self.method in decode.DRAFT_METHODS

  def gammas(self) -> tuple[int, int]:
    """(gamma, gamma_max) after the defaults: what a round drafts and the static bound.

    Returns:
      (0, 0) for method "target".
    """
    if self.method == "target":
      return 0, 0
    gamma = self.gamma
    if gamma is None:
      gamma = DEFAULT_GAMMA[self.policy]
      if self.method == "lookup_model" and self.policy == "confidence":
        gamma = max(gamma, DEFAULT_LOOKUP_MODEL_GAMMA)
      if self.gamma_max is not None:
        gamma = min(gamma, self.gamma_max)
    g_max = gamma if self.gamma_max is None else self.gamma_max
    if self.policy == "heuristic" and self.gamma_max is None:
      g_max = max(gamma, HEURISTIC_GAMMA_MAX)
    if self.policy in decode.STOPPING_POLICIES:
      # The confidence policy drafts up to gamma while the draft stays
      # sure: gamma is its cap, and the verify width G + 1 should match it.
      gamma = g_max
    return gamma, g_max

  def spec(self, target: model.Arch, draft: Optional[model.Arch],
           vocab_limit: Optional[int] = None) -> decode.Spec:
    """The static description of the programs these options need.

    EOS ids are data (`decode.State.eos`), so the configs go in without
    them: a new stop token reuses the compiled program.

    Args:
      target: the target's arch.
      draft: the draft's arch (None: only "target" and "prompt_lookup" run).
      vocab_limit: ids at or past it are never sampled (`jspec.bundle.check_pair`).

    Returns:
      The `decode.Spec`.

    Raises:
      ValueError: a method that needs a draft model and there is none.
    """
    if self.uses_draft and draft is None:
      raise ValueError(f"method {self.method!r} needs a draft model; this bundle has none "
                       "(use method='prompt_lookup' or 'target')")
    strip = lambda arch: dataclasses.replace(arch, cfg=dataclasses.replace(arch.cfg,
                                                                            eos_token_ids=()))
    samp = sampling.Sampling(float(self.temperature), self.top_k, float(self.top_p), vocab_limit)
    gamma, g_max = self.gammas()
    return decode.Spec(strip(target), strip(draft) if self.uses_draft else None, self.method,
                       samp, g_max, gamma, self.policy, float(self.min_confidence), self.ngram)


def make(options: Optional[Options] = None, **kwargs) -> Options:
  """An `Options` from keyword arguments, or `options` with them replaced.

  Args:
    options: a base `Options` (None: the defaults).
    **kwargs: fields of `Options`.

  Returns:
    The checked `Options`.

  Raises:
    TypeError: an unknown option name.
    ValueError: a bad value (see `Options`).
  """
  fields = {f.name for f in dataclasses.fields(Options)}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise TypeError(f"unknown options {unknown}; expected some of {sorted(fields)}")
  if options is not None and not isinstance(options, Options):
    raise TypeError(f"options must be a jspec.Options, got {type(options).__name__}")
  return dataclasses.replace(options or Options(), **kwargs)
