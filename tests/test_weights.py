"""jspec.weights and jspec.bundle: every stored form computes what the plain one does, decided once."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import tiny
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import greedy_head
from jspec import model
from jspec import weights

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
needs_int8 = pytest.mark.skipif(not cpu_kernels.int8_available(), reason="no int8 CPU kernel")


def _leaves(params):
  return [w for w in jax.tree.leaves(params, is_leaf=weights.is_leaf) if weights.is_leaf(w)]


def _forward(m: jspec.Model, tokens, slots=32, **kwargs):
  cache = cache_lib.init(m.cfg, tokens.shape[0], slots, m.backend.dtype)
  return model.forward(m.arch, m.params, jnp.asarray(tokens), cache, **kwargs)


def _tokens(seed, shape, vocab):
  return np.random.RandomState(seed).randint(0, vocab, size=shape).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("make", [weights.dense, weights.table])
def test_every_form_multiplies_and_looks_up_like_the_plain_matrix(make):
  rng = np.random.RandomState(0)
  w = rng.randn(40, 64).astype(np.float32)  # [I, O] with O a multiple of 32
  leaf = make(w if make is weights.dense else w.T)
  assert leaf.shape == (40, 64)
  x = jnp.asarray(rng.randn(3, 5, 40).astype(np.float32))
  ids = jnp.asarray([[0, 63, 31], [32, 1, 5]])
  forms = [leaf, weights.to_int8(leaf), weights.to_int8(leaf, panels=True)]
  if cpu_kernels.available():
    forms.append(weights.to_panels(leaf))
  for form in forms:
    assert form.shape == (40, 64), type(form).__name__
    exact = isinstance(form, (weights.Dense, weights.Table, weights.Panels))
    # Two int8 roundings (weights and activations): about 1% of the spread.
    tol = 1e-5 if exact else 0.03 * np.abs(x @ w).max()
    np.testing.assert_allclose(weights.dot(x, form), x @ w, atol=tol, rtol=1e-5 if exact else 0)
    np.testing.assert_allclose(weights.matrix(form), w, atol=0 if exact else 0.01 * np.abs(w).max())
    if not isinstance(form, weights.Dense):
      np.testing.assert_allclose(weights.lookup(form, ids), w.T[np.asarray(ids)],
                                 atol=0 if exact else 0.01 * np.abs(w).max())
  with pytest.raises(TypeError, match="cannot be read by rows"):
    weights.lookup(weights.dense(w), ids)
  with pytest.raises(TypeError, match="not a weight leaf"):
    weights.dot(x, w)


def test_int8_quantizes_each_output_within_half_a_step():
  m = np.random.RandomState(0).randn(13, 7).astype(np.float32) * np.arange(1, 8)  # [I, O]
  m[:, 3] = 0.0  # an all-zero output must not divide by zero
  q = weights.to_int8(weights.dense(m))
  assert q.q.dtype == jnp.int8 and q.q.shape == (7, 13) and q.scale.shape == (7,)
  back = np.asarray(weights.matrix(q))
  assert np.all(np.abs(back - m) <= np.asarray(q.scale)[None, :] / 2 + 1e-7)
  assert np.all(np.asarray(q.q)[3] == 0)
  # Each output's largest magnitude maps to +-127: the whole int8 range is used.
  assert np.all(np.abs(np.asarray(q.q)).max(axis=1)[np.arange(7) != 3] == 127)


def test_panels_round_trip_exactly_and_odd_outputs_stay_dense():
  w = np.random.RandomState(1).randn(24, 96).astype(np.float32)
  if cpu_kernels.available():
    packed = weights.to_panels(weights.dense(w))
    assert isinstance(packed, weights.Panels) and packed.p.shape == (3, 24, 32)
    np.testing.assert_array_equal(weights.to_float(packed).w, w)
  odd = weights.dense(w[:, :37])  # 37 outputs: no panels
  assert weights.to_panels(odd) is odd


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("t", [1, 9])
def test_a_kernel_target_gives_the_plain_logits_and_cache(tied, t):
  cfg = dataclasses.replace(tiny.PACKABLE_TARGET, tie_word_embeddings=tied)
  params = model.init_params(cfg, jax.random.key(t), scale=0.3)
  plain = bundle_lib.prepare(cfg, params, settings=jspec.Settings(kernels=False))
  packed = bundle_lib.prepare(cfg, params, settings=jspec.Settings(kernels=True))
  assert {type(w) for w in _leaves(plain.params)} == {weights.Dense, weights.Table}
  assert {type(w) for w in _leaves(packed.params)} == {weights.Panels}
  assert isinstance(packed.params["greedy_head"], greedy_head.GreedyHead)
  assert plain.params["greedy_head"] is None
  tokens = _tokens(t, (2, t), cfg.vocab_size)
  chex.assert_trees_all_close(_forward(packed, tokens), _forward(plain, tokens), rtol=1e-5,
                              atol=1e-5)


@pytest.mark.parametrize("kernels", [False, True])
def test_prepare_leaves_its_input_alone_unless_told_to_consume_it(kernels):
  if kernels and not cpu_kernels.available():
    pytest.skip("no CPU kernels")
  params = model.init_params(tiny.PACKABLE_TARGET, jax.random.key(2))
  before = jax.tree.map(np.array, params, is_leaf=lambda x: isinstance(x, jax.Array))
  settings = jspec.Settings(kernels=kernels)
  bundle_lib.prepare(tiny.PACKABLE_TARGET, params, settings=settings)
  chex.assert_trees_all_equal(params, before)
  bundle_lib.prepare(tiny.PACKABLE_TARGET, params, settings=settings, consume=True)
  assert params == {}  # every source leaf left as its replacement was made


@pytest.mark.slow
def test_the_draft_is_4bit_where_the_int4_kernel_runs_else_int8_and_the_target_never_is():
  INT8 = (weights.Int8, weights.Int8Panels)
  default = tiny.packable_pair(3)
  kinds = {type(w) for w in _leaves(default.draft.params)}  # k, v have 16 outputs: never panels
  if cpu_kernels.int4_available():  # 16-output k, v: their 4-bit values widened (`to_int4_blocks`)
    assert weights.Int4Panels in kinds and kinds <= {weights.Int4Panels, weights.Dense}, kinds
  else:
    assert kinds & set(INT8) and kinds <= set(INT8), kinds
  assert default.draft.backend.dtype == "float32"
  int8 = tiny.packable_pair(3, draft_int4=False)
  named = tiny.packable_pair(3, draft_int8=True)  # the int8 draft asked for by name
  kind = weights.Int8Panels if cpu_kernels.int8_available() else weights.Int8
  for bundle in (int8, named):
    kinds = {type(w) for w in _leaves(bundle.draft.params)}
    assert kind in kinds and kinds <= set(INT8), kinds
  for bundle in (default, int8):
    assert not any(isinstance(w, INT8 + (weights.Int4Panels,)) for w in _leaves(bundle.target.params))
  floats = tiny.packable_pair(3, draft_int8=False)
  assert not any(isinstance(w, INT8 + (weights.Int4Panels,)) for w in _leaves(floats.draft.params))
  prompt = _tokens(3, (9,), tiny.PACKABLE_VOCAB).tolist()
  base = jspec.generate(int8, prompt, max_new_tokens=20, method="target")
  for bundle in (default, int8, floats):  # q is the draft's own distribution: exact either way
    out = jspec.generate(bundle, prompt, max_new_tokens=20, gamma=3, policy="fixed")
    assert out.token_ids == base.token_ids


@pytest.mark.slow
def test_generate_reads_a_bundle_and_never_changes_it():
  bundle = tiny.packable_pair(5)
  before = jax.tree.map(np.array, (bundle.target.params, bundle.draft.params))
  prompt = _tokens(5, (7,), tiny.PACKABLE_VOCAB).tolist()
  for method in ("target", "model", "prompt_lookup", "lookup_model"):
    jspec.generate(bundle, prompt, max_new_tokens=12, method=method)
  chex.assert_trees_all_equal((bundle.target.params, bundle.draft.params), before)
  with pytest.raises(dataclasses.FrozenInstanceError):
    bundle.target = bundle.draft


def test_kernels_asked_for_where_they_cannot_run_is_refused(monkeypatch):
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no compiler (test)")
  with pytest.raises(ValueError, match="kernels=True.*no compiler"):
    tiny.pair(0, kernels=True)
  with pytest.raises(ValueError, match="role='verifier'"):
    bundle_lib.prepare(tiny.TARGET, model.init_params(tiny.TARGET, jax.random.key(0)),
                       role="verifier")
  with pytest.raises(ValueError, match="draft_int8='yes'"):
    jspec.Settings(draft_int8="yes")


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_int8_forward_is_close_to_float(tied):
  cfg = dataclasses.replace(tiny.TARGET, tie_word_embeddings=tied)
  params = model.init_params(cfg, jax.random.key(0), scale=0.3)
  plain = bundle_lib.prepare(cfg, params, "draft", jspec.Settings(kernels=False, draft_int8=False))
  q = bundle_lib.prepare(cfg, params, "draft", jspec.Settings(kernels=False, draft_int8=True))
  tokens = _tokens(1, (2, 6), tiny.VOCAB)
  want, want_cache = _forward(plain, tokens)
  got, got_cache = _forward(q, tokens)
  assert got.dtype == jnp.float32 and got_cache.k.dtype == jnp.float32
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  # Two layers of int8 roundings: 3.5-4.2% here; a wrong transpose or scale is ~100%.
  assert rel(got, want) < 0.08
  assert rel(got_cache.k, want_cache.k) < 0.04 and rel(got_cache.v, want_cache.v) < 0.04
  assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) >= 0.9


@pytest.mark.slow
@needs_int8
@pytest.mark.parametrize("tied", [False, True])
def test_int8_panels_compute_exactly_what_plain_int8_does(tied):
  # Both unrolled: the kernel against XLA's int8 dot. (In the layer loop XLA
  # compiles the elementwise work around it differently: equal to rounding.)
  cfg = dataclasses.replace(tiny.PACKABLE_TARGET, tie_word_embeddings=tied)
  params = model.init_params(cfg, jax.random.key(3), scale=0.3)
  plain = bundle_lib.prepare(cfg, params, "draft", jspec.Settings(kernels=False, draft_int8=True))
  packed = bundle_lib.prepare(cfg, params, "draft",
                              jspec.Settings(kernels=True, draft_int8=True, scan_layers=False))
  assert {type(w) for w in _leaves(packed.params)} == {weights.Int8Panels}
  for t in (1, 5):
    tokens = _tokens(t, (2, t), cfg.vocab_size)
    # The same int32 products, rescaled the same way: equal, not just close.
    chex.assert_trees_all_equal(_forward(packed, tokens), _forward(plain, tokens))


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("int8", [False, True])
def test_kernel_layers_run_as_one_loop_with_the_unrolled_results(int8):
  # Kernel-stored layers compile one layer per forward (the kernels picking
  # each layer's weights by index): the logits and cache must be the
  # unrolled layers' (fp32: bit for bit), after a chunk and after a second
  # one that reads the first from the cache.
  if int8 and not cpu_kernels.int8_available():
    pytest.skip("no int8 CPU kernel")
  cfg = dataclasses.replace(tiny.PACKABLE_TARGET, num_layers=3)
  params = model.init_params(cfg, jax.random.key(3), scale=0.3)
  tokens = jnp.asarray(_tokens(3, (2, 6), cfg.vocab_size))
  results = {}
  for scan in (False, True):
    # XLA's attention in both, so fp32 can be compared bit for bit: the
    # loop's own attention kernel is checked against it in test_cpu_attention.
    settings = jspec.Settings(kernels=True, draft_int8=int8, scan_layers=scan,
                              fused_attention=False)
    m = bundle_lib.prepare(cfg, params, "draft", settings)

    def run(p, first, second, cache, arch=m.arch):
      logits, cache = model.forward(arch, p, first, cache)
      more, cache = model.forward(arch, p, second, cache)
      return logits, more, cache

    args = (m.params, tokens[:, :4], tokens[:, 4:], cache_lib.init(cfg, 2, 16))
    text = jax.jit(run).lower(*args).as_text()
    kernel = ({"avx2": cpu_kernels.TARGET_S8, "vnni": cpu_kernels.TARGET_INT8}[
        cpu_kernels.int8_kind()] if int8 else cpu_kernels.TARGET)
    assert (cpu_kernels.LAYER_TARGETS[kernel] in text) == scan
    results[scan] = jax.jit(run)(*args)
  if int8:  # XLA compiles the elementwise work around the int8 kernel differently in the loop
    chex.assert_trees_all_close(results[False], results[True], rtol=1e-5, atol=1e-5)
  else:
    chex.assert_trees_all_equal(results[False], results[True])


@pytest.mark.slow
@pytest.mark.parametrize("form", ["dense", "panels", "int8"])
def test_a_fresh_prefill_attends_to_its_chunk_with_the_same_results(form):
  # `fresh` (prefill: every cache empty) attends over the chunk alone, not
  # every slot: the logits and cache must be the plain forward's (to float
  # rounding: XLA sums the softmax over fewer slots), whether the layers are
  # unrolled (dense) or one loop (panels, int8). 60 tokens: past
  # FUSED_MAX_T, where the loop attends with XLA, not the kernel.
  if form != "dense" and not cpu_kernels.available():
    pytest.skip("no CPU kernels")
  cfg = dataclasses.replace(tiny.PACKABLE_TARGET, num_layers=3)
  params = model.init_params(cfg, jax.random.key(5), scale=0.3)
  m = bundle_lib.prepare(cfg, params, "draft", jspec.Settings(kernels=form != "dense",
                                                              draft_int8=form == "int8"))
  tokens = jnp.asarray(_tokens(5, (2, 60), cfg.vocab_size))
  results = {}
  for fresh in (False, True):
    fn = jax.jit(lambda p, x, c, fresh=fresh: model.forward(m.arch, p, x, c, fresh=fresh))
    results[fresh] = fn(m.params, tokens, cache_lib.init(cfg, 2, 96))
  # int8: that rounding can move an activation across an int8 step, which
  # moves a position's logits by a few hundredths (0.04 seen).
  atol = 0.1 if form == "int8" else 1e-4
  chex.assert_trees_all_close(results[False], results[True], rtol=1e-5, atol=atol)
