"""Block q in [0, 15] stored two to a byte (`cpu_kernels.pack_nibbles`): the same model in fewer bytes.

A 4-bit k-quant (Q4_K) holds q in [0, 15]; stored one to an int8 byte it
reads 1.25 bytes a weight with its float32 scale and offset, as nibbles
0.75. The nibble kernel (`jspec_gemm_blk4`) must compute exactly what the
int8 one (`jspec_gemm_blk`) computes on the unpacked q: the same floats,
summed in the same order, so every output here is compared bit for bit
with it, not within a tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import tiny
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import model
from jspec import prepared
from jspec import weights

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}")


def _blocks(n, k, b, offsets, seed):
  """Q4_K-like blocks of an [n, k] matrix: q in [0, 15] int8, scale [n, k/b], offset or None."""
  rng = np.random.default_rng(seed)
  q = rng.integers(0, 16, (n, k), dtype=np.int8)
  s = (rng.uniform(0.5, 2.0, (n, k // b)) * 1e-2).astype(np.float32)
  o = (rng.standard_normal((n, k // b)) * 1e-2).astype(np.float32) if offsets else None
  return q, s, o


def _pack(q, s, o, nibbles):
  return cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s),
                                 None if o is None else jnp.asarray(o), nibbles=nibbles)


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def test_pack_nibbles_lays_out_two_k_rows_a_byte_and_round_trips():
  q, s, o = _blocks(96, 64, 16, True, seed=1)
  qp, sp, op = cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s), jnp.asarray(o))
  assert qp.shape == (3, 32, 32) and qp.dtype == jnp.uint8  # every q in [0, 15]: nibbles
  assert cpu_kernels.is_nibbles(qp) and cpu_kernels.block_inputs(qp) == 64
  # byte [p, i, c]: q[32p + c, 2i] low, q[32p + c, 2i + 1] high
  got = np.asarray(qp)
  for p, i, c in [(0, 0, 0), (2, 17, 5), (1, 31, 31), (0, 8, 30)]:
    assert int(got[p, i, c]) == int(q[32 * p + c, 2 * i]) + 16 * int(q[32 * p + c, 2 * i + 1])
  back = cpu_kernels.unpack_blocks(qp, sp, op)
  assert back[0].dtype == jnp.int8
  for a, b in zip(back, (q, s, o)):
    np.testing.assert_array_equal(np.asarray(a), b)
  wide = _pack(q, s, o, nibbles=False)
  assert wide[0].dtype == jnp.int8 and wide[0].shape == (3, 64, 32)
  np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_nibbles(qp)), np.asarray(wide[0]))
  np.testing.assert_array_equal(np.asarray(cpu_kernels.pack_nibbles(wide[0])), got)
  np.testing.assert_array_equal(_bits(cpu_kernels.widen_blocks(qp, sp, op)),
                                _bits(cpu_kernels.widen_blocks(*wide)))


def test_q_outside_nibbles_stays_int8_and_nibbles_are_refused_for_it():
  q, s, o = _blocks(32, 64, 32, True, seed=2)
  for bad in (16, -1):
    q2 = q.copy()
    q2[5, 7] = bad
    assert _pack(q2, s, o, None)[0].dtype == jnp.int8
    with pytest.raises(ValueError, match="nibbles"):
      _pack(q2, s, o, True)
  assert _pack(q, s, o, None)[0].dtype == jnp.uint8
  assert _pack(q, s, o, False)[0].dtype == jnp.int8


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9, 13, 17, 64])
@pytest.mark.parametrize("b,k", [(16, 80), (32, 96), (32, 1536)])  # K not a multiple of 64; a real K
@pytest.mark.parametrize("offsets", [False, True])
def test_nibble_kernel_is_the_int8_kernel_bit_for_bit(m, b, k, offsets):
  # N = 224: seven panels, so four (and two) in step leave some over.
  q, s, o = _blocks(224, k, b, offsets, seed=m + k)
  x = np.random.default_rng(100 + m).standard_normal((m, k)).astype(np.float32)
  run = jax.jit(cpu_kernels.matmul_blocks)
  nib, wide = _pack(q, s, o, True), _pack(q, s, o, False)
  y = run(jnp.asarray(x), *nib)
  assert y.shape == (m, 224)
  np.testing.assert_array_equal(_bits(y), _bits(run(jnp.asarray(x), *wide)))


@needs_kernels
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("b", [16, 32])
def test_layer_variant_is_the_int8_layer_variant_bit_for_bit(offsets, b):
  layers = [_blocks(96, 4 * b, b, offsets, seed=20 + i) for i in range(3)]
  x = np.random.default_rng(11).standard_normal((5, 4 * b)).astype(np.float32)

  def picked(nibbles):
    packed = [_pack(*blk, nibbles) for blk in layers]
    parts = 3 if offsets else 2

    @jax.jit
    def run(index, x):
      picks = [cpu_kernels.LayerPick(tuple(p[part] for p in packed), index) for part in range(parts)]
      return cpu_kernels.matmul_blocks(x, *picks)

    return run

  nib, wide = picked(True), picked(False)
  for i, blk in enumerate(layers):
    for rows in (x[:1], x[:3], x):
      y = nib(jnp.int32(i), jnp.asarray(rows))
      np.testing.assert_array_equal(_bits(y), _bits(wide(jnp.int32(i), jnp.asarray(rows))))
      np.testing.assert_array_equal(_bits(y), _bits(cpu_kernels.matmul_blocks(
          jnp.asarray(rows), *_pack(*blk, True))))  # that layer's own


def test_the_einsum_fallback_reads_nibbles(monkeypatch):
  q, s, o = _blocks(64, 96, 32, True, seed=5)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 3, 96)), jnp.float32)
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  y = cpu_kernels.matmul_blocks(x, *_pack(q, s, o, True))
  assert y.shape == (2, 3, 64)
  np.testing.assert_array_equal(_bits(y), _bits(cpu_kernels.matmul_blocks(x, *_pack(q, s, o, False))))
  with pytest.raises(ValueError, match="inputs"):  # a K that the nibbles do not hold
    cpu_kernels.matmul_blocks(x[..., :48], *_pack(q, s, o, True))


def test_a_blocks_leaf_of_nibbles_reads_as_its_int8_twin():
  q, s, o = _blocks(64, 96, 32, True, seed=7)
  nib, wide = weights.blocks(q, s, o), weights.blocks(q, s, o, nibbles=False)
  assert nib.q.dtype == jnp.uint8 and wide.q.dtype == jnp.int8
  assert nib.shape == wide.shape == (96, 64) and nib.block == wide.block == 32
  np.testing.assert_array_equal(_bits(weights.matrix(nib)), _bits(weights.matrix(wide)))
  ids = jnp.asarray([[0, 5, 63], [31, 32, 40]])
  np.testing.assert_array_equal(_bits(weights.lookup(nib, ids)), _bits(weights.lookup(wide, ids)))
  # 96 x 64 q: half a byte each instead of one; the scales and offsets alike
  assert weights.nbytes(wide) - weights.nbytes(nib) == 96 * 64 // 2
  lossy = weights.to_int8_blocks(weights.Dense(jnp.zeros((96, 64), jnp.float32)))
  assert lossy.q.dtype == jnp.int8  # the lossy target's q is signed: kept a byte each


def _mixed_layers():
  """One matrix in three layers: Q4_K (nibbles, affine, B 32) in 0 and 2, Q6_K (int8, B 16) in 1."""
  rng = np.random.default_rng(8)
  q6 = rng.integers(-32, 32, (64, 128), dtype=np.int8)
  return [weights.blocks(*_blocks(64, 128, 32, True, 0)),
          weights.blocks(q6, rng.uniform(0.01, 0.02, (64, 8)).astype(np.float32)),
          weights.blocks(*_blocks(64, 128, 32, True, 2))]


def test_uniform_keeps_each_layers_block_form():
  mixed = _mixed_layers()
  assert [w.q.dtype for w in mixed] == [jnp.uint8, jnp.int8, jnp.uint8]
  assert weights.uniform(mixed) == mixed  # the file's own bytes, nothing unpacked or split
  nibbles = [mixed[0], mixed[2]]
  assert weights.uniform(nibbles) == nibbles


@pytest.mark.parametrize("kernels", [True, False])
def test_the_layer_loop_reads_each_layer_in_its_own_form(kernels, monkeypatch):
  # `pick` over layers of two forms groups them; each index must give that
  # layer's own product bit for bit, through jspec_gemm_blk_forms where the
  # kernel runs, else a switch over the groups.
  if kernels and not cpu_kernels.available():
    pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
  if not kernels:
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  mixed = _mixed_layers()
  x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 128)), jnp.float32)
  picked = lambda x, i: weights.dot(x, weights.pick([{"w": w} for w in mixed], i)["w"])
  text = jax.jit(picked).lower(x, jnp.int32(0)).as_text()
  assert (f"@{cpu_kernels.TARGET_BLK_FORMS}(" in text) == kernels
  for i, own in enumerate(mixed):
    got, want = jax.jit(picked)(x, jnp.int32(i)), jax.jit(weights.dot)(x, own)
    if kernels:
      np.testing.assert_array_equal(_bits(got), _bits(want))
    else:  # XLA's einsum rounds alike only within float32 inside and outside a switch
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  if kernels:
    with pytest.raises(Exception, match="and layer 2"):  # a local index past its group is refused
      form = weights.pick([{"w": w} for w in mixed], jnp.int32(0))["w"]
      jax.block_until_ready(cpu_kernels.matmul_blocks_forms(
          x, [(g.q, g.scale, g.offset) for g in form.groups], jnp.int32(1), jnp.int32(2)))


def _q4_pair(seed: int, nibbles, q6_down_layer=None) -> jspec.Bundle:
  """The packable tiny pair with its target's matrices as Q4_K-like blocks (q in [0, 15], B = 32).

  Args:
    seed: weights' seed.
    nibbles: `weights.blocks`' nibbles (None: where q fits, True, False).
    q6_down_layer: this layer's down projection Q6_K-like instead (int8 q
      in [-32, 31], B = 16, no offsets), as Q4_K_M mixes them in one role.
  """
  bundle = tiny.packable_pair(seed, draft_int8=False)

  def to_blocks(path, w):
    if not weights.is_leaf(w):
      return w  # norm scales, biases
    m = np.asarray(weights.matrix(w)).T  # [out, in]
    if m.shape[0] % 32:
      return w
    if q6_down_layer is not None and model.path_name(path) == f"layers/{q6_down_layer}/mlp/down/w":
      scale = (np.abs(m).reshape(m.shape[0], -1, 16).max(-1) / 31).astype(np.float32)
      q = np.clip(np.round(m.reshape(m.shape[0], -1, 16) / scale[..., None]), -32, 31)
      return weights.blocks(q.astype(np.int8).reshape(m.shape), scale)
    lo = m.reshape(m.shape[0], -1, 32).min(-1)
    hi = m.reshape(m.shape[0], -1, 32).max(-1)
    scale = ((hi - lo) / 15).astype(np.float32)
    q = np.clip(np.round((m.reshape(m.shape[0], -1, 32) - lo[..., None]) / scale[..., None]),
                0, 15).astype(np.int8).reshape(m.shape)
    return weights.blocks(q, scale, lo.astype(np.float32), nibbles=nibbles)

  params = jax.tree_util.tree_map_with_path(
      to_blocks, model.init_params(tiny.PACKABLE_TARGET, jax.random.key(seed), scale=0.3),
      is_leaf=weights.is_leaf)
  target = bundle_lib.prepare(tiny.PACKABLE_TARGET, params)
  return jspec.Bundle(target, bundle.draft)


def _block_leaves(params):
  return [w for w in jax.tree.leaves(params, is_leaf=weights.is_leaf) if isinstance(w, weights.Blocks)]


@needs_kernels
@pytest.mark.parametrize("q6_down_layer", [None, 1])
def test_a_nibble_target_is_the_int8_target_bit_for_bit(q6_down_layer, tmp_path):
  nib, wide = (_q4_pair(4, n, q6_down_layer) for n in (None, False))
  dtypes = [w.q.dtype for w in _block_leaves(nib.target.params)]
  assert jnp.uint8 in dtypes and all(w.q.dtype == jnp.int8 for w in _block_leaves(wide.target.params))
  if q6_down_layer is not None:  # each layer keeps its own form: int8 Q6_K there, nibbles elsewhere
    downs = [layer["mlp"]["down"]["w"] for layer in nib.target.params["layers"].values()]
    assert [w.q.dtype == jnp.int8 for w in downs] == [i == q6_down_layer
                                                       for i in range(len(downs))]
    assert [w.offset is None for w in downs] == [i == q6_down_layer for i in range(len(downs))]
  assert weights.nbytes(nib.target.params) < weights.nbytes(wide.target.params)
  cfg = tiny.PACKABLE_TARGET
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 23)), jnp.int32)
  run = lambda m: model.forward(m.arch, m.params, tokens, cache_lib.init(cfg, 2, 32))[0]
  np.testing.assert_array_equal(_bits(run(nib.target)), _bits(run(wide.target)))
  prompt = [2, 7, 1, 8, 2, 8, 1, 8]
  want = jspec.generate(wide, prompt, max_new_tokens=20, method="target").token_ids
  assert jspec.generate(nib, prompt, max_new_tokens=20, method="target").token_ids == want
  assert jspec.generate(nib, prompt, max_new_tokens=20, gamma=4, policy="fixed").token_ids == want
  # the prepared store keeps the uint8 leaves as they are
  path = prepared.save(tmp_path / "t.safetensors", nib.target, "k" * 64)
  back = prepared.load(path, "k" * 64)
  for a, b in zip(_block_leaves(nib.target.params), _block_leaves(back.params)):
    assert a.q.dtype == b.q.dtype and a.q.shape == b.q.shape
    np.testing.assert_array_equal(np.asarray(a.q), np.asarray(b.q))
  np.testing.assert_array_equal(_bits(run(back)), _bits(run(nib.target)))


def _many_calls(fn, *args) -> dict:
  """How many calls of each block-kernel target the compiled program holds."""
  text = jax.jit(fn).lower(*args).as_text()
  return {t: text.count(f"@{t}(") for t in (cpu_kernels.TARGET_BLK_MANY, cpu_kernels.TARGET_BLK4,
                                           cpu_kernels.TARGET_BLK, cpu_kernels.TARGET_BLK_SYM,
                                           cpu_kernels.TARGET_BLK4_SYM)}


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 9, 17])
@pytest.mark.parametrize("nibbles,offsets,b", [(True, True, 32), (False, False, 16),
                                                (False, True, 32), (True, False, 16)])
def test_many_matrices_in_one_call_are_each_ones_own_bit_for_bit(m, nibbles, offsets, b):
  # Three matrices of 7, 3 and 1 panels (four, two in step leave some over),
  # three layers each with their own numbers: every output must be that
  # layer's own matrix's call, in its own columns.
  k, widths = 4 * b, (224, 96, 32)
  layers = [[_pack(*_blocks(n, k, b, offsets, seed=100 * i + n), nibbles) for n in widths]
            for i in range(3)]
  x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)).astype(np.float32))
  parts = 3 if offsets else 2

  def run(index, x):
    picks = [tuple(cpu_kernels.LayerPick(tuple(layer[j][part] for layer in layers), index)
                   for part in range(parts)) for j in range(len(widths))]
    return cpu_kernels.matmul_blocks_many(x, picks)

  calls = _many_calls(run, jnp.int32(0), x)
  assert calls[cpu_kernels.TARGET_BLK_MANY] == 1 and sum(calls.values()) == 1
  for i, layer in enumerate(layers):
    ys = jax.jit(run)(jnp.int32(i), x)
    assert [y.shape for y in ys] == [(m, n) for n in widths]
    for y, own in zip(ys, layer):
      np.testing.assert_array_equal(_bits(y), _bits(cpu_kernels.matmul_blocks(x, *own)))
  # the same outside the layer loop: arrays, not picks
  ys = cpu_kernels.matmul_blocks_many(x[None], layers[1])  # [1, M, K]: leading axes kept
  for y, own in zip(ys, layers[1]):
    np.testing.assert_array_equal(_bits(y[0]), _bits(cpu_kernels.matmul_blocks(x, *own)))


@needs_kernels
def test_dot_many_groups_leaves_by_form_and_keeps_their_order():
  k = 96
  four = lambda seed: weights.Blocks(*_pack(*_blocks(64, k, 32, True, seed), True))
  eight = lambda seed: weights.Blocks(*_pack(*_blocks(32, k, 16, False, seed), False))
  dense = weights.Dense(jnp.asarray(np.random.default_rng(3).standard_normal((k, 40)),
                                    jnp.float32))
  ws = [four(1), eight(2), dense, four(3), eight(4), four(5)]
  x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 5, k)), jnp.float32)
  ys = weights.dot_many(x, ws)
  for y, w in zip(ys, ws):
    np.testing.assert_array_equal(_bits(y), _bits(weights.dot(x, w)))
  calls = _many_calls(lambda x: weights.dot_many(x, ws), x)
  assert calls[cpu_kernels.TARGET_BLK_MANY] == 2  # the three 4-bit ones, the two int8 ones
  assert sum(calls.values()) == 2
  pair = [ws[0], ws[1]]
  lone = _many_calls(lambda x: weights.dot_many(x, pair), x)  # forms differ
  assert lone[cpu_kernels.TARGET_BLK_MANY] == 0 and sum(lone.values()) == 2


@needs_kernels
def test_a_block_target_multiplies_q_k_and_gate_up_in_one_call_each():
  # The tiny Q4_K-like target: q, k, v share a form, as do gate and up, so a
  # layer is one call for q, k and v, one for gate and up, o and down alone.
  target = _q4_pair(4, None).target
  cfg = tiny.PACKABLE_TARGET
  tokens = jnp.zeros((1, 3), jnp.int32)
  forward = lambda params, tokens: model.forward(target.arch, params, tokens,
                                                 cache_lib.init(cfg, 1, 16))[0]
  calls = _many_calls(forward, target.params, tokens)
  assert calls[cpu_kernels.TARGET_BLK_MANY] >= 2
  text = jax.jit(forward).lower(target.params, tokens).as_text()
  assert "parts = 3 : i64" in text and "parts = 2 : i64" in text
