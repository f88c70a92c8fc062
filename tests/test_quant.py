"""jspec.quant: the int8 draft computes what the float one does, closely, and generate uses it on CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import tiny
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import layout
from jspec import model
from jspec import quant


def test_quantize_rows_is_within_half_a_step():
  m = np.random.RandomState(0).randn(7, 13).astype(np.float32) * np.arange(1, 8)[:, None]
  m[3] = 0.0  # an all-zero row must not divide by zero
  table = quant.quantize_rows(m)
  assert table.q.dtype == jnp.int8 and table.q.shape == (7, 13) and table.scale.shape == (7,)
  back = np.asarray(table.q, np.float32) * np.asarray(table.scale)[:, None]
  assert np.all(np.abs(back - m) <= np.asarray(table.scale)[:, None] / 2 + 1e-7)
  assert np.all(np.asarray(table.q)[3] == 0)
  # Each row's largest magnitude maps to +-127: the whole int8 range is used.
  assert np.all(np.abs(np.asarray(table.q)).max(axis=1)[np.arange(7) != 3] == 127)


@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
def test_matmul_matches_the_float_product(lead):
  # (1,) is one row, which `matmul` pads to two for XLA CPU's fast int8 dot.
  rng = np.random.RandomState(len(lead))
  w = rng.randn(29, 40).astype(np.float32)  # [out, in]
  x = rng.randn(*lead, 40).astype(np.float32) * 3
  got = np.asarray(quant.matmul(jnp.asarray(x), quant.quantize_rows(w)))
  want = x @ w.T
  assert got.shape == lead + (29,)
  # Two int8 roundings: errors of about 1% of the output's spread.
  assert np.max(np.abs(got - want)) < 0.03 * np.max(np.abs(want))
  assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999


def _forward(params, cfg, tokens):
  cache = cache_lib.init(cfg, tokens.shape[0], 32)
  return model.forward(params, cfg, jnp.asarray(tokens), cache)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", ["cols", "rows"])
def test_int8_forward_is_close_to_float(tied, kind):
  cfg = dataclasses.replace(tiny.TARGET, tie_word_embeddings=tied)
  params = model.init_params(cfg, jax.random.key(0), scale=0.3)
  layout.convert(params, kind)  # quantize reads either layout
  q = quant.quantize(params)
  assert quant.is_quantized(q) and not quant.is_quantized(params)
  assert ("qlm_head" in q) == (not tied)
  tokens = np.random.RandomState(1).randint(0, tiny.VOCAB, size=(2, 6)).astype(np.int32)
  want, want_cache = _forward(params, cfg, tokens)
  got, got_cache = _forward(q, cfg, tokens)
  assert got.dtype == jnp.float32 and got_cache.k.dtype == jnp.float32
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  # Two layers of int8 roundings: 3.5-4.2% here; a wrong transpose or scale is ~100%.
  assert rel(got, want) < 0.08
  assert rel(got_cache.k, want_cache.k) < 0.04 and rel(got_cache.v, want_cache.v) < 0.04
  assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) >= 0.9


def test_quantize_leaves_the_float_params_alone():
  params = model.init_params(tiny.DRAFT, jax.random.key(2))
  before = jax.tree.map(np.array, params)
  quant.quantize(params)
  assert jax.tree.structure(params) == jax.tree.structure(before)
  jax.tree.map(np.testing.assert_array_equal, params, before)


def test_generate_drafts_in_int8_on_cpu_and_stays_exact():
  bundle = tiny.pair(seed=4)
  prompt = tiny.prompt(4, 9)
  base = jspec.generate(bundle, prompt, max_new_tokens=24, method="target")
  default = jspec.generate(bundle, prompt, max_new_tokens=24, gamma=3, policy="fixed")
  floats = jspec.generate(bundle, prompt, max_new_tokens=24, gamma=3, policy="fixed",
                          draft_int8=False)
  assert default.token_ids == floats.token_ids == base.token_ids
  assert default.stats["draft_int8"] is True and floats.stats["draft_int8"] is False
  assert base.stats["draft_int8"] is None  # no draft ran
  # The int8 copy is made once per bundle: the first call paid for it.
  assert default.stats["quantize_s"] > 0 and floats.stats["quantize_s"] == 0
  again = jspec.generate(bundle, prompt, max_new_tokens=24, gamma=3, policy="fixed")
  assert again.stats["quantize_s"] == 0
  weights = bundle.draft_weights(None, True)
  assert quant.is_quantized(weights.params)
  assert not quant.is_quantized(bundle.draft.params)


def test_a_reloadable_float_draft_is_freed_for_int8_and_read_back_on_request():
  pair = tiny.pair(seed=6)
  stored = pair.draft.params
  reads = []

  def reload():  # what `jspec.load` passes: a fresh read of the draft's file
    reads.append(1)
    return jax.tree.map(jnp.copy, stored)

  bundle = jspec.Bundle(pair.target, jspec.Model(pair.draft.cfg, stored), reload_draft=reload)
  prompt = tiny.prompt(6, 8)
  base = jspec.generate(bundle, prompt, max_new_tokens=16, method="target")
  bundle.draft_weights(6, False)  # a cached float view of the draft (a cut head)
  default = jspec.generate(bundle, prompt, max_new_tokens=16, gamma=2, policy="fixed")
  assert base.token_ids == default.token_ids
  assert bundle.draft.params is None and not reads
  # Nothing may keep the float draft alive: its cut head went with it.
  assert all(int8 for _, int8 in bundle._draft_weights)
  floats = jspec.generate(bundle, prompt, max_new_tokens=16, gamma=2, policy="fixed",
                          draft_int8=False)
  assert floats.token_ids == base.token_ids and reads == [1]
  assert floats.stats["quantize_s"] > 0  # the read-back is preparation, not decode time
  # Read back once, then kept: int8 and float calls no longer trade places.
  jspec.generate(bundle, prompt, max_new_tokens=16, gamma=2, policy="fixed")
  jspec.generate(bundle, prompt, max_new_tokens=16, gamma=2, policy="fixed", draft_int8=False)
  assert reads == [1] and bundle.draft.params is not None


def test_a_draft_that_is_the_target_is_never_freed():
  pair = tiny.pair(seed=7)
  bundle = jspec.Bundle(pair.target, pair.target, reload_draft=lambda: pytest.fail("reloaded"))
  jspec.generate(bundle, tiny.prompt(7, 5), max_new_tokens=8, gamma=2, policy="fixed")
  assert bundle.target.params is not None and bundle.draft.params is bundle.target.params


def test_int8_draft_with_a_cut_head():
  bundle = tiny.pair(seed=5)
  cut = bundle.draft_weights(6, True).head
  assert isinstance(cut, quant.Table) and cut.q.shape == (6, tiny.DRAFT.hidden_size)
  full = quant.quantize(bundle.draft.params)
  np.testing.assert_array_equal(cut.q, full["qlm_head"][:6])
  prompt = tiny.prompt(5, 7)
  base = jspec.generate(bundle, prompt, max_new_tokens=16, method="target")
  out = jspec.generate(bundle, prompt, max_new_tokens=16, gamma=2, policy="fixed", draft_vocab=6)
  assert out.token_ids == base.token_ids


@pytest.mark.parametrize("bad", ["int8", 1, 0.5])
def test_draft_int8_must_be_a_bool_or_none(bad):
  with pytest.raises(ValueError, match="draft_int8"):
    jspec.generate(tiny.pair(), [1, 2], max_new_tokens=2, draft_int8=bad)


def test_int8_is_the_default_on_cpu_only():
  assert jspec.api.draft_int8_default("cpu") is True
  assert jspec.api.draft_int8_default("gpu") is False
  assert jspec.api.draft_int8_default("tpu") is False


@pytest.mark.parametrize("tied", [False, True])
def test_packed_int8_params_compute_exactly_what_plain_int8_ones_do(tied, monkeypatch):
  # Both unrolled: this checks the kernel against XLA's int8 dot. Packed
  # layers otherwise run as one loop, whose elementwise work XLA compiles
  # differently (test_layout's loop test: equal to rounding).
  monkeypatch.setattr(model, "SCAN_LAYERS", False)
  cfg = dataclasses.replace(tiny.PACKABLE_TARGET, tie_word_embeddings=tied)
  params = model.init_params(cfg, jax.random.key(3), scale=0.3)
  plain = quant.quantize(params)
  packed = quant.pack(quant.quantize(params))
  assert quant.is_packed(packed) and not quant.is_packed(plain)
  assert set(packed["layers_0"]["mlp"]["down_proj"]) == {"qpanels", "sums", "scale"}
  # Tied, the table is the head and is packed; untied, the head is packed
  # apart and the embedding, only looked up, stays as it is.
  assert ("qpanels" in packed["embed_tokens"]) == tied and "qlm_head" not in packed
  head_keys = {k for k in packed if "lm_head" in k}
  assert head_keys == (set() if tied else {"qlm_head_panels", "qlm_head_sums", "qlm_head_scale"})
  # A cut head reads the packed table's rows, untied as tied.
  table = quant.output_table(plain, tied)
  cut = jspec.api._head_rows(packed, cfg, 40)
  np.testing.assert_array_equal(np.asarray(cut.q), np.asarray(table.q[:40]))
  np.testing.assert_array_equal(np.asarray(cut.scale), np.asarray(table.scale[:40]))
  for t in (1, 5):
    tokens = np.random.RandomState(t).randint(0, cfg.vocab_size, size=(2, t)).astype(np.int32)
    want, want_cache = _forward(plain, cfg, tokens)
    got, got_cache = _forward(packed, cfg, tokens)
    # The same int32 products, rescaled the same way: equal, not just close.
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(want_cache.k))


def test_generate_packs_the_int8_draft_where_the_kernel_runs_and_stays_exact(monkeypatch):
  if not cpu_kernels.int8_available():
    pytest.skip(f"no int8 CPU kernel here: {cpu_kernels.unavailable_reason() or 'no AVX2'}")
  bundle = tiny.packable_pair(8)
  prompt = np.random.RandomState(8).randint(0, tiny.PACKABLE_VOCAB, size=9).tolist()
  base = jspec.generate(bundle, prompt, max_new_tokens=20, method="target")
  spec = jspec.generate(bundle, prompt, max_new_tokens=20, gamma=3, policy="fixed")
  assert quant.is_packed(bundle.draft_weights(None, True).params)
  assert spec.token_ids == base.token_ids and spec.stats["draft_int8"] is True
  cut = bundle.draft_weights(40, True).head  # a cut head reads the packed table's rows
  full = quant.quantize(bundle.draft.params)["embed_tokens"]["qembedding"]
  np.testing.assert_array_equal(np.asarray(cut.q), np.asarray(full[:40]))
  monkeypatch.setattr(cpu_kernels, "int8_kind", lambda: None)
  plain = jspec.Bundle(bundle.target, bundle.draft)
  again = jspec.generate(plain, prompt, max_new_tokens=20, gamma=3, policy="fixed")
  assert not quant.is_packed(plain.draft_weights(None, True).params)
  # Exact int32 products either way, so the same drafts and the same rounds.
  assert again.token_ids == spec.token_ids and again.stats["rounds"] == spec.stats["rounds"]
