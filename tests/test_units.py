"""Unit checks of the cache, acceptance and prompt lookup, each with and without jit (chex.variants)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

import tiny
from jspec import cache as cache_lib
from jspec import drafters
from jspec import sampling
from jspec import speculative


class CacheTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_each_row_writes_at_its_own_offset_and_rollback_is_a_length(self):
    cache = cache_lib.init(tiny.DRAFT, 2, 8)  # [L=1, B=2, S=8, K=1, H=8]
    new = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(1, 2, 3, 1, 8) + 1  # [L, B, T, K, H]
    starts = jnp.asarray([0, 4])
    k = self.variant(cache_lib.write_chunks)(cache.k, new, starts)
    chex.assert_shape(k, cache.k.shape)
    for row, start in enumerate([0, 4]):
      np.testing.assert_array_equal(k[0, row, start:start + 3], new[0, row])
      others = np.delete(np.arange(8), np.arange(start, start + 3))
      assert not np.any(np.asarray(k[0, row, others]))  # nothing else was written
    rolled = self.variant(cache_lib.with_lengths)(cache.replace(k=k), jnp.asarray([2, 5]))
    np.testing.assert_array_equal(rolled.lengths, [2, 5])
    chex.assert_trees_all_equal(rolled.k, k)  # rollback keeps the buffers: only lengths move


  def test_the_one_scatter_writes_what_the_per_row_updates_write(self):
    # One device writes with one scatter, a mesh row by row
    # (`write_chunks(sharded=True)`): the same slots, layers and clamping at
    # the buffer's end.
    rng = np.random.default_rng(0)
    for layers, rows, slots, t, first, chunk_layers in [(4, 3, 16, 2, 0, 4), (4, 5, 16, 3, 2, 1),
                                                         (2, 1, 8, 8, 0, 2), (3, 4, 10, 4, 1, 2)]:
      buf = jnp.asarray(rng.standard_normal((layers, rows, slots, 2, 4)), jnp.float32)
      new = jnp.asarray(rng.standard_normal((chunk_layers, rows, t, 2, 4)), jnp.float32)
      starts = jnp.asarray(rng.integers(0, slots + 3, rows), jnp.int32)  # some past the end
      one = jax.jit(cache_lib.write_chunks, static_argnums=(3, 4))(buf, new, starts, first, False)
      per_row = jax.jit(cache_lib.write_chunks, static_argnums=(3, 4))(buf, new, starts, first, True)
      np.testing.assert_array_equal(np.asarray(one), np.asarray(per_row))


class AcceptTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_rejection_emits_from_the_residual(self):
    # q puts all its mass on token 0, p half of it: the draft is accepted
    # half the time, and after a rejection the token comes from
    # norm(max(0, p - q)) = [0, 0.5, 0.5]: never token 0 again.
    p = jnp.asarray([[[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]])  # [B=1, G+1=2, V=3]
    q = jnp.asarray([[[1.0, 0.0, 0.0]]])  # [B, G=1, V]
    drafts = jnp.asarray([[0]])
    accept = self.variant(jax.vmap(lambda key: speculative.accept(
        key, drafts, q, p, jnp.asarray([1]), sampling.Sampling(1.0))))
    n, token = accept(jax.random.split(jax.random.key(0), 200))
    chex.assert_shape([n, token], (200, 1))
    n, token = np.asarray(n[:, 0]), np.asarray(token[:, 0])
    assert 60 < np.sum(n == 1) < 140  # p(0) / q(0) = 0.5
    assert set(token[n == 1].tolist()) == {0}  # the bonus token, from p at the next position
    assert set(token[n == 0].tolist()) == {1, 2}  # never 0 again after a rejection

  @chex.variants(with_jit=True, without_jit=True)
  def test_drafts_the_target_agrees_with_are_all_accepted_then_the_bonus(self):
    p = jax.nn.one_hot(jnp.asarray([[2, 1, 0]]), 3)  # [1, 3, 3] point masses
    drafts = jnp.asarray([[2, 1]])
    q = jax.nn.one_hot(drafts, 3)
    n, token = self.variant(lambda key: speculative.accept(
        key, drafts, q, p, jnp.asarray([2]), sampling.Sampling(1.0)))(jax.random.key(0))
    assert int(n[0]) == 2 and int(token[0]) == 0  # both accepted, then p's bonus token


class LookupTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_copies_what_followed_the_latest_longest_match(self):
    # Row 0 ends in "5 6": "5 6" occurred at 1-2 and 5-6, followed by 9 9 at the
    # latest. Row 1 ends in 4, which never occurred before: nothing to copy.
    tokens = jnp.asarray([[1, 5, 6, 7, 8, 5, 6, 9, 9, 5, 6, 0],
                          [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0]])
    seq_len = jnp.asarray([11, 4])
    lookup = self.variant(lambda t, n: drafters.prompt_lookup(t, n, jnp.asarray([3, 3]), 3, 2, 11))
    drafts, q, gamma = lookup(tokens, seq_len)
    chex.assert_shape(drafts, (2, 3))
    chex.assert_shape(q, (2, 3, 11))
    assert drafts[0].tolist() == [9, 9, 5] and int(gamma[0]) == 3
    assert int(gamma[1]) == 0
    np.testing.assert_array_equal(q[0], jax.nn.one_hot(drafts[0], 11))  # q is a point mass


def test_only_the_power_of_two_buffer_width_depends_on_the_prompt_length():
  from jspec import api  # pylint: disable=import-outside-toplevel
  seen = {}
  for p in range(1, 300):
    p_width, width = api.widths(p, 128, 8)
    assert p_width == width and width & (width - 1) == 0  # the prompt is padded to W
    assert p + 128 + 8 + 2 <= width < 2 * (p + 128 + 8 + 2)  # room for a full verify at the end
    seen.setdefault(width, []).append(p)
  # Every prompt of up to 118 tokens shares one width (and so its programs).
  assert seen[256] == list(range(1, 119)) and sorted(seen) == [256, 512]
