"""The exact greedy argmax of the output head, from about a quarter of its bytes.

A greedy target step (temperature 0) needs one thing from the output head:
the argmax of each row's logits, and a float32 head is a large share of
the bytes a one-token step reads (docs/decisions.md, "Greedy head"). So
the step first multiplies by an int8
copy of the head (one float32 scale per token; `make`), which reads a
quarter of the bytes, and bounds how far each estimate can be from the
float32 logit:

  |L_v - a_v| <= ||x|| * bound_v,   bound_v = ||r_v|| + 2 gamma_K (||w_v|| + s_v ||q_v||)

for token v's head row w_v = s_v q_v + r_v (q_v int8, r_v the rounding
residual), x the normed hidden state, L_v the float32 logit as any order of
K float32 multiply-adds computes it, and gamma_K = K u / (1 - K u) with u
= 2^-24 (the classic bound on a float dot product's rounding: it covers
both the estimate's own rounding and the full head's). By Cauchy-Schwarz,
|x . r_v| <= ||x|| ||r_v||. Every token whose upper bound reaches the best
lower bound of the row could be its argmax; every other one is strictly
below the maximum. Those candidates alone are then multiplied by jspec's
float32 kernel, over the float32 rows gathered into panels of their own:
the kernel's sums for one output column are the same multiply-adds in the
same order whatever the other columns and rows are, so each candidate's
logit is bit for bit what the full head gives, and so is the argmax, ties
included (the lowest id wins in both).

`logits` returns those exact logits at the candidates and -inf elsewhere,
which `sampling.probs` turns into the same one-hot as the full logits. If
more than `capacity` tokens are candidates in a call (never on the bench's
prompts with the real target: `python -m bench.tools.head_candidates`), it
computes the full head instead, so the result is exact every time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec import cpu_kernels
from jspec import weights

# Rows (batch x positions) a call may have: the estimate's kernel reads the
# int8 head once for all of them, but its float conversions grow with the
# rows, and a verify's many rows are bound by arithmetic, not by reading.
MAX_ROWS = 4
CAPACITY = 64  # candidate tokens per call computed exactly (a static shape)
_U = 2.0**-24  # unit roundoff of float32
_CHUNK = 256  # panels converted at a time by `make` (8192 tokens, 100 MB as float64)


def _gamma(k: int) -> float:
  """gamma_K: the relative rounding bound of a K-term float32 dot product."""
  return k * _U / (1 - k * _U)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GreedyHead:
  """The int8 copy of a float32 head and each token's error bound (`make`).

  Token v's estimate is scale_v * (x . q_v), within ||x|| * bound_v of its
  float32 logit (bound rounded up to float32).
  """

  qpanels: jax.Array  # [V/32, D, 32] int8, laid out as the float head's panels
  scale: jax.Array  # [V] float32
  bound: jax.Array  # [V] float32


def make(panels: jax.Array) -> GreedyHead:
  """The int8 copy of a float32 head and each token's error bound.

  Args:
    panels: [V/32, D, 32] float32 head panels (`weights.Panels`): token
      v's row is column v % 32 of panel v // 32.

  Returns:
    The `GreedyHead`.
  """
  p, d, width = panels.shape
  gamma = _gamma(d)
  qpanels = np.empty((p, d, width), np.int8)
  scale = np.empty((p, width), np.float32)
  bound = np.empty((p, width), np.float32)
  for start in range(0, p, _CHUNK):
    w = np.asarray(panels[start:start + _CHUNK], np.float64)  # [c, D, 32]
    s32 = (np.abs(w).max(axis=1) / 127).astype(np.float32)  # [c, 32]
    s32[s32 == 0] = 1  # an all-zero row: q = 0, estimate 0, exact
    s = s32.astype(np.float64)[:, None, :]
    q = np.clip(np.rint(w / s), -127, 127)  # [c, D, 32]
    residual = np.linalg.norm(w - q * s, axis=1)
    rows = np.linalg.norm(w, axis=1)
    ints = np.linalg.norm(q, axis=1) * s[:, 0, :]
    b = (residual + 2 * gamma * (rows + ints)) * (1 + 1e-6)
    b32 = b.astype(np.float32)
    b32 = np.where(b32.astype(np.float64) < b, np.nextafter(b32, np.float32(np.inf)), b32)
    qpanels[start:start + _CHUNK] = q.astype(np.int8)
    scale[start:start + _CHUNK] = s32
    bound[start:start + _CHUNK] = b32
  return GreedyHead(jnp.asarray(qpanels), jnp.asarray(scale.reshape(-1)),
                    jnp.asarray(bound.reshape(-1)))


def suits(head: weights.Leaf) -> bool:
  """Whether a model's head can have a greedy head: float32 kernel panels.

  Args:
    head: the head's weight leaf (the token table when tied).

  Returns:
    True for a float32 `weights.Panels` head.
  """
  return isinstance(head, weights.Panels) and head.p.dtype == jnp.float32


def applies(rows: int, head: weights.Leaf, kernels: bool) -> bool:
  """Whether `logits` takes the int8 pass for `rows` rows over this head.

  Only with jspec's float32 kernel on CPU: the candidates' logits equal
  the full head's bit for bit only because the kernel sums each column
  the same way whatever else it computes.

  Args:
    rows: batch x positions of the call (static).
    head: the head's weight leaf.
    kernels: the model's backend runs jspec's CPU kernels.

  Returns:
    True when the call should go through `logits`.
  """
  return (rows <= MAX_ROWS and kernels and suits(head) and cpu_kernels.available()
          and jax.default_backend() == "cpu")


def candidates(x: jax.Array, head: GreedyHead,
               vocab_limit: int | None = None) -> jax.Array:
  """Which tokens could be each row's argmax, from the int8 pass and the bounds.

  Args:
    x: [N, D] float32 normed hidden states.
    head: `make` of the float32 head.
    vocab_limit: ids at or past it are never chosen.

  Returns:
    [N, V] bool: True where the token's upper bound reaches the row's best
    lower bound (among ids below vocab_limit); every token whose float32
    logit equals the row's maximum is among them.
  """
  v = head.scale.shape[0]
  estimate = cpu_kernels.matmul_f32s8(x, head.qpanels) * head.scale  # [N, V]
  # ||x|| in float32 is within (D + 2) u of the real norm: 1e-3 covers it.
  # The second term keeps the bound through a + e and a - e rounding in float32.
  norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True)) * (1 + 1e-3)  # [N, 1]
  err = norm * head.bound * (1 + 2.0**-10) + 2.0**-20 * jnp.abs(estimate)  # [N, V]
  valid = jnp.arange(v) < (v if vocab_limit is None else vocab_limit)  # [V]
  best = jnp.max(jnp.where(valid, estimate - err, -jnp.inf), axis=-1, keepdims=True)  # [N, 1]
  return valid & (estimate + err >= best)


def logits(x: jax.Array, panels: jax.Array, head: GreedyHead,
           vocab_limit: int | None = None, capacity: int = CAPACITY) -> jax.Array:
  """Logits that give every row the float32 head's argmax: exact where it could be, -inf elsewhere.

  Args:
    x: [N, D] float32 normed hidden states.
    panels: [V/32, D, 32] float32 head panels.
    head: `make(panels)`.
    vocab_limit: ids at or past it are never chosen (`sampling.Sampling`).
    capacity: how many candidate tokens (over all rows) are computed
      exactly; more fall back to the full head. A multiple of 32.

  Returns:
    [N, V] float32: the full head's logit for every token that could be a
    row's argmax, and -inf for every other (each strictly below its row's
    maximum), so the argmax of each row is the full head's.
  """
  n, d = x.shape
  p, _, width = panels.shape
  v = p * width
  candidate = jnp.any(candidates(x, head, vocab_limit), axis=0)  # [V], over all rows
  ids = jnp.nonzero(candidate, size=capacity, fill_value=0)[0]  # [C]; id 0 pads (exact too)
  rows = panels[ids // width, :, ids % width]  # [C, D] float32
  own = rows.reshape(capacity // width, width, d).transpose(0, 2, 1)  # [C/32, D, 32]
  exact = cpu_kernels.matmul(x, own)  # [N, C]: the full head's bits at those ids

  def some():
    return jnp.full((n, v), -jnp.inf, jnp.float32).at[:, ids].set(exact)

  def full():
    return cpu_kernels.matmul(x, panels)

  return jax.lax.cond(jnp.sum(candidate) <= capacity, some, full)
