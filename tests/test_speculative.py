"""speculative.accept_greedy is `accept` in the greedy limit, from tokens instead of distributions."""

from __future__ import annotations

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from jspec import sampling
from jspec import speculative

V = 7  # few ids, so drafts often equal the target's token


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), g=st.integers(0, 6))
def test_greedy_acceptance_from_tokens_equals_acceptance_from_point_masses(seed, b, g):
  rng = np.random.RandomState(seed)
  target = rng.randint(0, V, size=(b, g + 1)).astype(np.int32)  # [B, G+1] argmax tokens
  # Drafts copy the target's token with probability 0.7, so runs of accepts happen.
  drafts = np.where(rng.rand(b, g) < 0.7, target[:, :g], rng.randint(0, V, size=(b, g)))
  gamma = rng.randint(0, g + 1, size=b).astype(np.int32)
  greedy = sampling.Sampling()
  p = jax.nn.one_hot(target, V)  # what `sampling.probs` gives when greedy
  q = jax.nn.one_hot(drafts, V)
  n, token = speculative.accept(jax.random.key(seed), jnp.asarray(drafts, jnp.int32), q, p,
                                jnp.asarray(gamma), greedy)
  n2, token2 = speculative.accept_greedy(jnp.asarray(drafts, jnp.int32), jnp.asarray(target),
                                         jnp.asarray(gamma))
  assert n2.tolist() == n.tolist() and token2.tolist() == token.tolist()
  for row in range(b):  # and both are the definition: leading matches, then the target's token
    k = 0
    while k < gamma[row] and drafts[row, k] == target[row, k]:
      k += 1
    assert int(n2[row]) == k and int(token2[row]) == target[row, k]


def test_argmax_never_picks_an_id_past_the_vocab_limit():
  logits = jnp.asarray([[0.0, 1.0, 5.0], [3.0, 1.0, 2.0]])
  limited = sampling.Sampling(vocab_limit=2)
  assert sampling.argmax(logits, limited).tolist() == [1, 0]
  assert sampling.argmax(logits, sampling.Sampling()).tolist() == [2, 0]
  probs = sampling.probs(logits, limited)
  assert probs.tolist() == jax.nn.one_hot(jnp.asarray([1, 0]), 3).tolist()
