"""One speculative round's acceptance step: rejection sampling over drafts.

Notation of Leviathan et al. 2023 ("Fast Inference from Transformers via
Speculative Decoding") and Chen et al. 2023: q is the draft's distribution, p
the target's. Given drafts d_1..d_gamma ~ q and the target's p at each of the
gamma + 1 positions (one verify forward):

  accept d_i while u_i < p(d_i) / q(d_i), u_i ~ U[0, 1);
  at the first rejection i, emit a token from norm(max(0, p_i - q_i));
  if all gamma are accepted, emit a bonus token from p_{gamma+1}.

Every emitted token is then distributed exactly as the target's (filtered)
distribution. Greedy decoding is the one-hot limit (see `jspec.sampling`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jspec import sampling


def accept(key: jax.Array, drafts: jax.Array, q: jax.Array, p: jax.Array,
           gamma: jax.Array, s: sampling.Sampling | sampling.Traced):
  """Decides how many drafts each row keeps and the token that follows them.

  Args:
    key: PRNG key for this round's acceptance.
    drafts: [B, G] int32 drafted tokens d_1..d_G (G = gamma_max).
    q: [B, G, V] draft distribution each d_i was sampled from.
    p: [B, G+1, V] target distribution at each verify position: p[:, i] is the
      target's distribution for the token after the prefix and d_1..d_i.
    gamma: [B] int32 drafts that count in each row (0..G); drafts past it are
      ignored, and a row with gamma 0 simply samples one token from p[:, 0].
    s: sampling settings (greedy uses no randomness).

  Returns:
    (n [B] int32 drafts accepted, next_token [B] int32 the token emitted after
    them: a correction from the residual, or the bonus token when n == gamma).
  """
  b, g, v = q.shape
  chex.assert_shape(drafts, (b, g))
  chex.assert_shape(p, (b, g + 1, v))
  chex.assert_shape(gamma, (b,))
  u_key, r_key = jax.random.split(key)
  u = jax.random.uniform(u_key, (b, g))  # [B, G] in [0, 1)
  p_d = jnp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]  # [B, G]
  q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [B, G]
  # u < p/q written without the division; P(u < a) = a exactly for u in [0, 1).
  ok = (u * q_d < p_d) & (jnp.arange(g)[None, :] < gamma[:, None])  # [B, G]
  n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)  # [B] leading accepts

  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
  q_pad = jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1)  # [B, G+1, V]
  q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]  # [B, V]
  # After a rejection (n < gamma) sample the residual; after full acceptance
  # (n == gamma) q at the bonus position counts as 0, so this is p itself.
  q_n = jnp.where((n < gamma)[:, None], q_n, 0.0)
  residual = jnp.maximum(p_n - q_n, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  # mass == 0 only when p == q, where a rejection has probability 0; fall
  # back to p so that rounding can never produce 0/0.
  residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
  next_token = sampling.sample(r_key, residual, s)
  return n.astype(jnp.int32), next_token


def accept_greedy(drafts: jax.Array, target: jax.Array, gamma: jax.Array):
  """`accept` in the greedy limit, from the target's argmax tokens alone.

  With p and q point masses (`jspec.sampling`), d_i is accepted iff it is
  the target's argmax at its position, and the residual after a rejection,
  like p after full acceptance, is the point mass at the target's argmax.
  So the [B, G+1, V] distributions are never needed: a greedy verify hands
  over [B, G+1] tokens, not logits.

  Args:
    drafts: [B, G] int32 drafted tokens.
    target: [B, G+1] int32 the target's argmax at each verify position.
    gamma: [B] int32 drafts that count per row (0..G).

  Returns:
    (n [B] int32 drafts accepted, next_token [B] int32 the target's token after them).
  """
  b, g = drafts.shape
  chex.assert_shape(target, (b, g + 1))
  chex.assert_shape(gamma, (b,))
  ok = (drafts == target[:, :g]) & (jnp.arange(g)[None, :] < gamma[:, None])  # [B, G]
  n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)  # [B]
  return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]
