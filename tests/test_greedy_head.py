"""jspec.greedy_head: the int8 pass plus exact candidates give the float32 head's argmax, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import tiny
from jspec import programs
from jspec import cpu_kernels
from jspec import greedy_head

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"no CPU kernel here: {cpu_kernels.unavailable_reason()}")

V, D = 2048, 96


def _table(seed: int = 0) -> jax.Array:
  """A random [V, D] head with planted near-ties around row 5: rows 700 (equal) and 9 (one ulp off)."""
  table = jax.random.normal(jax.random.key(seed), (V, D)) * 0.05
  row = table[5]
  return (table.at[700].set(row)
          .at[9].set(jnp.nextafter(row, jnp.float32(1))))  # the same row, one ulp up per weight


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6])
def test_the_kernel_multiplies_float_rows_by_int8_panels(m):
  x = jax.random.normal(jax.random.key(m), (m, D))
  q = jax.random.randint(jax.random.key(2), (5, D, 32), -127, 128).astype(jnp.int8)
  want = jnp.einsum("mk,pkw->mpw", x, q.astype(jnp.float32)).reshape(m, 160)
  np.testing.assert_allclose(cpu_kernels.matmul_f32s8(x, q), want, rtol=1e-5, atol=1e-3)


def test_each_estimate_is_within_its_bound_of_the_float32_logit():
  panels = cpu_kernels.pack_table(_table())
  head = greedy_head.make(panels)
  x = jax.random.normal(jax.random.key(3), (4, D)) * 5
  full = cpu_kernels.matmul(x, panels)
  estimate = cpu_kernels.matmul_f32s8(x, head.qpanels) * head.scale
  slack = jnp.linalg.norm(x, axis=-1, keepdims=True) * head.bound
  assert bool(jnp.all(jnp.abs(estimate - full) <= slack))
  assert float(jnp.max(jnp.abs(estimate - full) / slack)) > 0.05  # the bound is not vacuous


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_argmax_and_the_candidates_logits_are_the_full_heads(seed):
  table = _table(seed)
  panels = cpu_kernels.pack_table(table)
  head = greedy_head.make(panels)
  x = jax.random.normal(jax.random.key(10 + seed), (3, D)) * 3
  # Row 0 points at the planted rows: 5, 9 and 700 come within an ulp or so of each other.
  x = x.at[0].set(table[5] * 40)
  full = cpu_kernels.matmul(x, panels)
  got = jax.jit(lambda x: greedy_head.logits(x, panels, head))(x)
  np.testing.assert_array_equal(jnp.argmax(got, -1), jnp.argmax(full, -1))
  finite = jnp.isfinite(got)
  assert int(finite.sum()) < 3 * 64  # a few candidates, not the vocabulary
  np.testing.assert_array_equal(jnp.where(finite, got, 0), jnp.where(finite, full, 0))
  for r in range(3):  # every token as large as the row's maximum is a candidate
    assert bool(jnp.all(finite[r][full[r] == jnp.max(full[r])]))


@pytest.mark.slow
def test_close_rows_whose_estimates_misorder_still_give_the_exact_argmax():
  # Rows a little apart around one direction: the int8 estimates of the top
  # few are closer than their rounding, so the estimate's own argmax is
  # often another token (checked below), and only the bound saves it.
  base = jax.random.normal(jax.random.key(5), (1, D)) * 0.05
  table = base + 0.0005 * jax.random.normal(jax.random.key(6), (V, D))
  panels = cpu_kernels.pack_table(table)
  head = greedy_head.make(panels)
  x = base * 40 + jax.random.normal(jax.random.key(7), (64, D))
  full = cpu_kernels.matmul(x, panels)
  estimate = cpu_kernels.matmul_f32s8(x, head.qpanels) * head.scale
  assert int(jnp.sum(jnp.argmax(estimate, -1) != jnp.argmax(full, -1))) > 5
  got = greedy_head.logits(x, panels, head, capacity=V)
  np.testing.assert_array_equal(jnp.argmax(got, -1), jnp.argmax(full, -1))


@pytest.mark.slow
def test_ids_past_the_vocab_limit_are_never_the_argmax():
  table = _table().at[V - 1].set(_table()[5] * 2)  # a padding row that would win
  panels = cpu_kernels.pack_table(table)
  x = (table[5] * 40)[None]
  got = greedy_head.logits(x, panels, greedy_head.make(panels), vocab_limit=V - 32)
  full = cpu_kernels.matmul(x, panels)
  assert int(jnp.argmax(full[0])) == V - 1
  assert int(jnp.argmax(got[0])) == int(jnp.argmax(full[0, :V - 32]))


@pytest.mark.slow
def test_more_candidates_than_capacity_take_the_full_head():
  table = jnp.tile(_table()[:1], (V, 1))  # every row the same: every token a candidate
  panels = cpu_kernels.pack_table(table)
  x = jax.random.normal(jax.random.key(4), (2, D))
  got = greedy_head.logits(x, panels, greedy_head.make(panels), capacity=32)
  np.testing.assert_array_equal(got, cpu_kernels.matmul(x, panels))


def test_an_all_zero_row_is_estimated_exactly():
  panels = cpu_kernels.pack_table(_table().at[3].set(0.0))
  head = greedy_head.make(panels)
  assert float(head.bound[3]) == 0.0 and float(head.scale[3]) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["target", "model", "prompt_lookup"])
def test_a_target_with_the_int8_head_gives_the_tokens_of_one_without(method):
  if not cpu_kernels.available():
    pytest.skip("no CPU kernels")
  with_head = tiny.packable_pair(6)
  without = tiny.packable_pair(6, greedy_head=False)
  assert isinstance(with_head.target.params["greedy_head"], greedy_head.GreedyHead)
  assert without.target.params["greedy_head"] is None
  prompt = np.random.RandomState(6).randint(0, tiny.PACKABLE_VOCAB, size=9).tolist()
  got = jspec.generate(with_head, prompt, max_new_tokens=24, method=method)
  assert got.token_ids == jspec.generate(without, prompt, max_new_tokens=24,
                                         method=method).token_ids


def test_only_a_float32_kernel_target_gets_the_int8_head():
  assert tiny.packable_pair(7, kernels=False).target.params["greedy_head"] is None
  assert tiny.packable_pair(7).draft.params["greedy_head"] is None  # a draft never does


@pytest.mark.slow
def test_sampling_reads_the_whole_head(monkeypatch):
  calls = []
  monkeypatch.setattr(greedy_head, "logits", lambda *a, **k: calls.append(1))
  bundle = tiny.packable_pair(8)
  programs.release()
  jspec.generate(bundle, [1, 2, 3], max_new_tokens=4, method="target", temperature=0.8, seed=1)
  assert not calls
