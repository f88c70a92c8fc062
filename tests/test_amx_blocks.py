"""The block kernel's AMX path (`cpu_kernels.any_order`): a prefill chunk's products with tiles.

Under `any_order`, from 16 rows on (a prefill chunk's), a host with
AMX-BF16 multiplies block matrices with `tdpbf16ps`: each x split into
three bfloat16 pieces whose sum is x exactly, each q widened to a bfloat16
exactly. The checks:

- against float64 within the float32 rounding bound of its sums: per block
  3B products summed in float32, then the block terms added over K/B
  blocks (`_tolerance`);
- exact where no sum rounds, with x chosen so that every x needs all three
  pieces: a piece left out, a nibble read from the wrong half or a pair of
  k swapped changes the result;
- a row's output does not depend on the other rows in the call (a
  batch's prefill and a row's own prefill agree bit for bit);
- factored and float scales give the same bits, as in the FMA path;
- outside `any_order`, and under it below 16 rows, the ordinary kernel's
  bits, so verify rows still equal the one-row step's;
- bfloat16 panels (`jspec_gemm_bf16`) take tiles alike, over all of K;
- `decode.encode` traces its forwards under `any_order`, and a step does
  not; a tiny block target's prefill on tiles gives its logits within
  float32 rounding and the same argmax.

Skipped where the tiles do not run (`cpu_kernels.amx_available()`): there
`any_order` changes nothing, which the last test checks everywhere.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_compact
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import decode
from jspec import model
from jspec import weights

U = 2.0 ** -24


def _need_amx():
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  if not cpu_kernels.amx_available():
    pytest.skip("no AMX tiles here (AMX-BF16, or the system's permission)")


def _blocks(n, k, b, nibbles, offsets, seed):
  rng = np.random.default_rng(seed)
  q = rng.integers(0, 16, (n, k)) if nibbles else rng.integers(-128, 128, (n, k))
  s = (rng.uniform(0.5, 2.0, (n, k // b)) * 1e-2).astype(np.float32)
  o = (rng.standard_normal((n, k // b)) * 1e-2).astype(np.float32) if offsets else None
  return q.astype(np.int8), s, o


def _pack(q, s, o, nibbles, factored=False):
  return cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s),
                                 None if o is None else jnp.asarray(o), nibbles, factored)


def _run(x, packed, any_order):
  def f(x):
    if any_order:
      with cpu_kernels.any_order():
        return cpu_kernels.matmul_blocks(x, *packed)
    return cpu_kernels.matmul_blocks(x, *packed)
  return np.asarray(jax.jit(f)(jnp.asarray(x)))


def _widened(q, s, o, b):  # [N, K] float64, exactly the stored model
  w = np.repeat(s, b, axis=1).astype(np.float64) * q
  return w + (np.repeat(o, b, axis=1) if o is not None else 0.0)


def _tolerance(x, q, s, o, b):
  """Per output: (3B + K/B + 4) U sum_k |x_k| (|s q_k| + |o|), the bound of the tiles' sums."""
  k = q.shape[1]
  mag = np.abs(np.repeat(s, b, axis=1).astype(np.float64) * q)
  if o is not None:
    mag = mag + np.abs(np.repeat(o, b, axis=1))
  return (3 * b + k // b + 4) * U * (np.abs(x).astype(np.float64) @ mag.T)


def _same_bits(a, b) -> bool:
  return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("m", [16, 17, 40])
@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("nibbles", [False, True])
@pytest.mark.parametrize("offsets", [False, True])
def test_tiles_match_float64(m, b, nibbles, offsets):
  # N = 224: seven panels, so the sets of two leave one alone.
  _need_amx()
  q, s, o = _blocks(224, 256, b, nibbles, offsets, seed=m + b)
  x = np.random.default_rng(m).standard_normal((m, 256)).astype(np.float32)
  got = _run(x, _pack(q, s, o, nibbles), any_order=True)
  want = x.astype(np.float64) @ _widened(q, s, o, b).T
  assert np.all(np.abs(got - want) <= _tolerance(x, q, s, o, b)), np.max(np.abs(got - want))


@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("nibbles", [False, True])
def test_three_pieces_exactly(b, nibbles):
  # x = a + c 2^-9 + e 2^-18 (|a| <= 1) needs all three bfloat16 pieces
  # (its bits span 19 places), and with q in {-1, 0, 1} (nibbles {0, 1}),
  # scales 1 and one block per output every sum stays under 2^6 in steps of
  # 2^-18, so none rounds: the tiles must give the float64 product.
  _need_amx()
  rng = np.random.default_rng(b + nibbles)
  n, m = 64, 16
  q = rng.integers(0 if nibbles else -1, 2, (n, b)).astype(np.int8)
  s = np.ones((n, 1), np.float32)
  x = (rng.integers(-1, 2, (m, b)) + rng.choice([-1, 1], (m, b)) * 2.0 ** -9
       + rng.choice([-1, 1], (m, b)) * 2.0 ** -18).astype(np.float32)
  got = _run(x, _pack(q, s, None, nibbles), any_order=True)
  np.testing.assert_array_equal(got, x.astype(np.float64) @ q.T.astype(np.float64))


@pytest.mark.parametrize("nibbles", [False, True])
def test_a_row_is_the_same_whichever_rows_share_the_call(nibbles):
  _need_amx()
  q, s, o = _blocks(96, 512, 32, nibbles, True, seed=3)
  packed = _pack(q, s, o, nibbles)
  x = np.random.default_rng(4).standard_normal((40, 512)).astype(np.float32)
  whole = _run(x, packed, any_order=True)
  assert _same_bits(_run(x[:16], packed, any_order=True), whole[:16])
  assert _same_bits(_run(x[16:32], packed, any_order=True), whole[16:32])
  assert _same_bits(_run(x[5:37], packed, any_order=True), whole[5:37])


@pytest.mark.parametrize("b", [16, 32])
def test_factored_scales_give_the_float_scales_bits(b):
  # Scales d * sc with a float16-like d per 256 and small integer sc (a
  # k-quant's), offsets alike: factored, the tiles read the same floats.
  _need_amx()
  rng = np.random.default_rng(b)
  n, k = 64, 512
  d = rng.uniform(1e-3, 1e-2, (n, k // 256, 1)).astype(np.float16).astype(np.float32)
  sc = rng.integers(1, 64, (n, k // 256, 256 // b)).astype(np.float32)
  s = (d * sc).reshape(n, k // b)
  o = -(d * rng.integers(0, 64, sc.shape).astype(np.float32)).reshape(n, k // b)
  q = rng.integers(0, 16, (n, k)).astype(np.int8)
  x = rng.standard_normal((16, k)).astype(np.float32)
  factored = _pack(q, s, o, True, factored=True)
  assert cpu_kernels.is_factored(factored[1])
  assert _same_bits(_run(x, factored, any_order=True), _run(x, _pack(q, s, o, True), True))


def test_layer_loop_and_shared_calls_take_the_tiles():
  # matmul_blocks on LayerPicks, matmul_blocks_forms (layers of two forms)
  # and matmul_blocks_many under any_order: each output within the bound.
  _need_amx()
  forms = [_blocks(96, 512, 32, True, True, seed=20), _blocks(96, 512, 16, False, False, seed=21),
           _blocks(96, 512, 32, True, True, seed=22)]
  leaves = [weights.blocks(q, s, o) for q, s, o in forms]
  assert isinstance(weights.pick(leaves, jnp.int32(0)), weights.LayerForms)
  x = np.random.default_rng(5).standard_normal((16, 512)).astype(np.float32)

  @jax.jit
  def loop(x):
    with cpu_kernels.any_order():
      def body(carry, index):
        return carry, weights.dot(x, weights.pick(leaves, index))
      return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

  @jax.jit
  def shared(x):
    with cpu_kernels.any_order():
      return weights.dot_many(x, [leaves[0], leaves[2]])

  got = np.asarray(loop(jnp.asarray(x)))
  gate, up = (np.asarray(y) for y in shared(jnp.asarray(x)))
  b_of = [32, 16, 32]
  for i, (q, s, o) in enumerate(forms):
    want = x.astype(np.float64) @ _widened(q, s, o, b_of[i]).T
    tol = _tolerance(x, q, s, o, b_of[i])
    assert np.all(np.abs(got[i] - want) <= tol), i
  for y, i in ((gate, 0), (up, 2)):
    q, s, o = forms[i]
    assert _same_bits(y, got[i]), i  # the same rows and panels: the same tiles


def _bf16_leaf(k, n, seed):
  w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
  leaf = weights.to_bf16_panels(weights.Dense(jnp.asarray(w).astype(jnp.bfloat16)))
  assert isinstance(leaf, weights.BF16Panels)
  return leaf, np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def _dot(x, leaf, any_order):
  def f(x):
    if any_order:
      with cpu_kernels.any_order():
        return weights.dot(x, leaf)
    return weights.dot(x, leaf)
  return np.asarray(jax.jit(f)(jnp.asarray(x)))


@pytest.mark.parametrize("m", [16, 17, 40])
def test_bf16_panels_on_tiles_match_float64(m):
  # A bfloat16 checkpoint's panels (`jspec_gemm_bf16`): the tiles sum each
  # output's 3K exact products in float32, within (3K + 2) U sum |x w|.
  _need_amx()
  leaf, w = _bf16_leaf(256, 224, seed=m)
  x = np.random.default_rng(m).standard_normal((m, 256)).astype(np.float32)
  got = _dot(x, leaf, any_order=True)
  want = x.astype(np.float64) @ w
  tol = (3 * 256 + 2) * U * (np.abs(x).astype(np.float64) @ np.abs(w))
  assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want))
  assert not _same_bits(got, _dot(x, leaf, any_order=False))  # the tiles ran
  assert _same_bits(_dot(x[:16], leaf, any_order=True), got[:16])  # rows alone


def test_bf16_panels_three_pieces_exactly():
  # x needing all three pieces, bfloat16 weights in {-1, 0, 1}, K = 32: no
  # sum rounds. *Planted*: the k pair's two rows swapped in the B tile fails.
  _need_amx()
  rng = np.random.default_rng(9)
  w = rng.integers(-1, 2, (32, 64)).astype(np.float32)
  leaf = weights.to_bf16_panels(weights.Dense(jnp.asarray(w).astype(jnp.bfloat16)))
  x = (rng.integers(-1, 2, (16, 32)) + rng.choice([-1, 1], (16, 32)) * 2.0 ** -9
       + rng.choice([-1, 1], (16, 32)) * 2.0 ** -18).astype(np.float32)
  np.testing.assert_array_equal(_dot(x, leaf, any_order=True),
                                x.astype(np.float64) @ w.astype(np.float64))


@pytest.mark.parametrize("m", [1, 5, 9, 15, 16])
def test_outside_any_order_or_below_16_rows_the_ordinary_kernel(m):
  # The step and the verify stay on the FMA tiles: a verify row equals the
  # one-row step's bit for bit only there. On hosts without AMX, any_order
  # changes nothing at any row count.
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  q, s, o = _blocks(96, 256, 32, True, True, seed=m)
  packed = _pack(q, s, o, True)
  x = np.random.default_rng(m).standard_normal((m, 256)).astype(np.float32)
  plain = _run(x, packed, any_order=False)
  rows = np.concatenate([_run(x[i:i + 1], packed, any_order=False) for i in range(m)])
  assert _same_bits(plain, rows)
  if m < 16 or not cpu_kernels.amx_available():
    assert _same_bits(_run(x, packed, any_order=True), plain)


def _encode_program(target, prompt, prompt_len):
  cfg = target.cfg

  def run(params, prompt, prompt_len):
    forward = lambda *a, **k: model.forward(target.arch, params, *a, **k)
    head = lambda x: model.logits(target.arch, params, x)
    return decode.encode(forward, cache_lib.init(cfg, prompt.shape[0], 64), prompt, prompt_len,
                         head=head)[0]

  return jax.jit(run), (target.params, prompt, prompt_len)


def test_the_prefill_carries_any_order_and_the_step_does_not():
  # decode.encode traces the model under any_order; a forward outside it
  # (a step, a verify) does not. *Planted*: encode without it fails here.
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  target = test_compact._compact_pair(5).target
  run, args = _encode_program(target, jnp.zeros((1, 32), jnp.int32), jnp.array([20], jnp.int32))
  text = run.lower(*args).as_text()
  assert "any_order = true" in text and "any_order = false" not in text
  step = jax.jit(lambda params, tokens: model.forward(
      target.arch, params, tokens, cache_lib.init(target.cfg, 1, 64))[0])
  text = step.lower(target.params, jnp.zeros((1, 5), jnp.int32)).as_text()
  assert "any_order = false" in text and "any_order = true" not in text


def test_a_block_targets_prefill_on_tiles_is_the_same_model(monkeypatch):
  # The tiny block target's prefill logits with the tiles and without
  # (any_order made a no-op): float32 rounding apart, the same argmax.
  _need_amx()
  target = test_compact._compact_pair(7).target
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, target.cfg.vocab_size, (2, 48)),
                       jnp.int32)
  prompt_len = jnp.array([48, 23], jnp.int32)
  run, args = _encode_program(target, prompt, prompt_len)
  tiles = np.asarray(run(*args))
  monkeypatch.setattr(cpu_kernels, "any_order", contextlib.nullcontext)
  run, args = _encode_program(target, prompt, prompt_len)
  plain = np.asarray(run(*args))
  np.testing.assert_allclose(tiles, plain, rtol=1e-4, atol=1e-4)
  assert not np.array_equal(tiles, plain)  # the tiles did run
  assert np.array_equal(tiles.argmax(-1), plain.argmax(-1))
