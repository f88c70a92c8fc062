"""Logits -> probabilities (temperature, top-k, top-p) and sampling from them.

The same `Sampling` settings are applied to the target (p) and the draft (q):
rejection sampling then reproduces exactly the target's *filtered*
distribution. Greedy decoding (temperature 0) is the one-hot limit: p and q
become point masses at their argmax, so the same acceptance rule accepts a
draft iff it equals the target's argmax, with no 0/0 anywhere.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Static sampling settings (hashable: part of the compiled program's key).

  Attributes:
    temperature: 0 for greedy, else > 0.
    top_k: keep the k most likely tokens; 0 disables.
    top_p: keep the smallest set of most likely tokens whose mass reaches
      top_p (nucleus); 1.0 disables.
    vocab_limit: tokens at or past this id are padding rows of the embedding
      (e.g. 151936 real tokens in a 152064-row table) and get probability 0;
      None keeps all.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  vocab_limit: int | None = None

  def __post_init__(self):
    t = self.temperature
    if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
      raise ValueError(f"temperature={t!r}: expected a finite number >= 0 (0 = greedy)")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 = off)")
    p = self.top_p
    if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
      raise ValueError(f"top_p={p!r}: expected a number in (0, 1] (1 = off)")

  @property
  def greedy(self) -> bool:
    """True when decoding takes the argmax."""
    return self.temperature == 0

  @property
  def nucleus(self) -> bool:
    """True when top_p filtering is on (it sorts the vocabulary: part of the program)."""
    return self.top_p < 1.0

  def program(self) -> "Sampling":
    """These settings with the values that are data (`Traced`) replaced by placeholders.

    Whether decoding is greedy, top_k and whether top_p is on shape the
    compiled program; the temperature and the top_p value are only numbers
    in it. Programs keyed by `program()` are shared by every temperature
    and top_p, which then arrive as arrays (`traced`).

    Returns:
      Sampling with temperature 0 or 1 and top_p 1 or 0.5.
    """
    return dataclasses.replace(self, temperature=0.0 if self.greedy else 1.0,
                               top_p=0.5 if self.nucleus else 1.0)

  def traced(self, temperature: jax.Array, top_p: jax.Array) -> "Traced":
    """These settings' program structure, with temperature and top_p taken from arrays.

    Args:
      temperature: [] float32 (unused when greedy).
      top_p: [] float32 (unused unless `nucleus`).

    Returns:
      A `Traced` that `probs` and `sample` accept in place of this Sampling.
    """
    return Traced(temperature=temperature, top_p=top_p, greedy=self.greedy, top_k=self.top_k,
                  nucleus=self.nucleus, vocab_limit=self.vocab_limit)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Traced:
  """Sampling settings inside a compiled program: the structure static, temperature and top_p data.

  Attributes:
    temperature: [] float32.
    top_p: [] float32.
    greedy, top_k, nucleus, vocab_limit: as `Sampling`'s (static).
  """

  temperature: jax.Array
  top_p: jax.Array
  greedy: bool = dataclasses.field(default=False, metadata=dict(static=True))
  top_k: int = dataclasses.field(default=0, metadata=dict(static=True))
  nucleus: bool = dataclasses.field(default=False, metadata=dict(static=True))
  vocab_limit: int | None = dataclasses.field(default=None, metadata=dict(static=True))


def _limit(logits: jax.Array, s: Sampling | Traced) -> jax.Array:
  """logits [..., V] with the ids at or past `vocab_limit` at -inf."""
  v = logits.shape[-1]
  if s.vocab_limit is not None and s.vocab_limit < v:
    return jnp.where(jnp.arange(v) < s.vocab_limit, logits, -jnp.inf)
  return logits


def argmax(logits: jax.Array, s: Sampling | Traced) -> jax.Array:
  """The greedy token: the most likely id below `vocab_limit`.

  Args:
    logits: [..., V] logits.
    s: sampling settings (only vocab_limit is read).

  Returns:
    [...] int32 token ids, the point masses of `probs` when greedy.
  """
  return jnp.argmax(_limit(logits, s), axis=-1).astype(jnp.int32)


def probs(logits: jax.Array, s: Sampling | Traced) -> jax.Array:
  """The distribution tokens are sampled from.

  Args:
    logits: [..., V] float32 logits.
    s: sampling settings (a `Traced` inside the decode programs).

  Returns:
    [..., V] float32 probabilities summing to 1 (one-hot at the argmax when greedy).
  """
  v = logits.shape[-1]
  if s.greedy:
    return jax.nn.one_hot(argmax(logits, s), v, dtype=jnp.float32)
  logits = _limit(logits, s).astype(jnp.float32) / s.temperature
  if s.top_k and s.top_k < v:
    # Ties at the k-th value are all kept, as in HF's TopKLogitsWarper.
    kth = jax.lax.top_k(logits, s.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  p = jax.nn.softmax(logits, axis=-1)
  if s.nucleus:
    sorted_p = jnp.sort(p, axis=-1)[..., ::-1]  # descending
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    # The smallest threshold whose tokens reach top_p; the most likely token
    # always survives (mass_before is 0 there).
    kept = jnp.where(mass_before < s.top_p, sorted_p, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    p = jnp.where(p >= threshold, p, 0.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
  return p


def sample(key: jax.Array, p: jax.Array, s: Sampling | Traced) -> jax.Array:
  """Draws one token per distribution.

  Args:
    key: PRNG key.
    p: [..., V] probabilities (from `probs`, or a normalised residual).
    s: sampling settings; greedy takes the argmax and uses no randomness.

  Returns:
    [...] int32 token ids.
  """
  if s.greedy:
    return jnp.argmax(p, axis=-1).astype(jnp.int32)
  # log(0) = -inf: zero-probability tokens are never drawn.
  return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)
