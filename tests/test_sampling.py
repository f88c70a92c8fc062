"""jspec.sampling: temperature, top-k and top-p against a numpy reference, with and without jit."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from jspec import sampling

LOGITS = np.array([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0],
                   [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]], np.float32)  # [B, V]


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """temperature -> top-k -> top-p in float64, as HF's warpers apply them."""
  z = np.asarray(logits, np.float64) / temperature
  if top_k:
    kth = np.sort(z, axis=-1)[..., -top_k][..., None]
    z = np.where(z < kth, -np.inf, z)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  if top_p < 1:
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = (np.cumsum(sorted_p, -1) - sorted_p) < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    p = np.where(keep, p, 0.0)
    p /= p.sum(-1, keepdims=True)
  return p


class SamplingTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.5, 4, 0.6))
  def test_probs_match_the_reference(self, temperature, top_k, top_p):
    s = sampling.Sampling(temperature, top_k, top_p)
    probs = self.variant(lambda logits: sampling.probs(logits, s))(jnp.asarray(LOGITS))
    chex.assert_shape(probs, LOGITS.shape)
    np.testing.assert_allclose(probs, reference(LOGITS, temperature, top_k, top_p), atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_traced_temperature_and_top_p_give_the_static_result(self):
    s = sampling.Sampling(0.9, 0, 0.7)
    traced = self.variant(lambda logits, t, p: sampling.probs(
        logits, s.program().traced(t, p)))(jnp.asarray(LOGITS), jnp.float32(0.9), jnp.float32(0.7))
    np.testing.assert_allclose(traced, sampling.probs(jnp.asarray(LOGITS), s), atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_greedy_is_the_one_hot_argmax_below_the_vocab_limit(self):
    limited = sampling.Sampling(vocab_limit=4)  # ids 4 and 5 are padding
    probs = self.variant(lambda logits: sampling.probs(logits, limited))(jnp.asarray(LOGITS))
    np.testing.assert_array_equal(probs, jax.nn.one_hot(jnp.asarray([0, 3]), 6))
    argmax = self.variant(lambda logits: sampling.argmax(logits, sampling.Sampling()))
    np.testing.assert_array_equal(argmax(jnp.asarray(LOGITS)), [4, 5])

  @chex.variants(with_jit=True, without_jit=True)
  def test_sample_never_draws_a_zero_probability_token(self):
    p = jnp.asarray([[0.0, 0.5, 0.0, 0.5]] * 512)
    s = sampling.Sampling(1.0)
    draws = self.variant(lambda key, p: sampling.sample(key, p, s))(jax.random.key(0), p)
    chex.assert_shape(draws, (512,))
    assert set(np.asarray(draws).tolist()) == {1, 3}
