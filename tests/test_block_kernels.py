"""jspec.cpu_kernels' int8 block kernel (`matmul_blocks`): x @ W for W = scale * q + offset per block.

Tolerance: each result is compared with a float64 product over the widened
weights, within (K + 4) * 2**-24 * sum_k |x_k| (|s q_k| + |o|): the float32
rounding bound of summing K products in any order, plus the roundings of
the scale and offset terms. Where every value is a small integer times a
power of two, no operation rounds, and the kernel must equal the float64
product exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert import gguf_blocks
from jspec import cpu_kernels

U = 2.0 ** -24


def _blocks(n, k, b, offsets, seed):
  """Random int8 blocks of an [n, k] matrix: q, scale [n, k/b], offset or None."""
  rng = np.random.default_rng(seed)
  q = rng.integers(-128, 128, (n, k), dtype=np.int8)
  s = (rng.uniform(0.5, 2.0, (n, k // b)) * 1e-2).astype(np.float32)
  o = (rng.standard_normal((n, k // b)) * 1e-2).astype(np.float32) if offsets else None
  return q, s, o


def _reference(x, q, s, o, b):
  """(float64 x @ W.T for the widened W, the tolerance per output)."""
  w = gguf_blocks.widen(q, s, o, b).astype(np.float64)  # [N, K], exactly the stored model
  s_q = np.abs(np.repeat(s, b, axis=1).astype(np.float64) * q)
  mag = s_q + (np.abs(np.repeat(o, b, axis=1)) if o is not None else 0.0)
  k = q.shape[1]
  return x.astype(np.float64) @ w.T, (k + 4) * U * (np.abs(x).astype(np.float64) @ mag.T)


def _run(x, q, s, o):
  qp, sp, op = cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s),
                                       None if o is None else jnp.asarray(o))
  return np.asarray(jax.jit(cpu_kernels.matmul_blocks)(jnp.asarray(x), qp, sp, op))


def _need_kernel():
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("m", [*range(1, 21), 320])
@pytest.mark.parametrize("b,k", [(16, 80), (32, 96)])  # K not a multiple of 64
@pytest.mark.parametrize("offsets", [False, True])
def test_matmul_blocks_matches_float64(m, b, k, offsets):
  # N = 224: seven panels, so four (and two) in step leave some over; every
  # row count on both sides of the register tiles (3, 6, 12 rows).
  q, s, o = _blocks(224, k, b, offsets, seed=m)
  x = np.random.default_rng(100 + m).standard_normal((m, k)).astype(np.float32)
  y = _run(x, q, s, o)
  ref, tol = _reference(x, q, s, o, b)
  assert y.shape == (m, 224) and y.dtype == np.float32
  assert np.all(np.abs(y - ref) <= tol), np.max(np.abs(y - ref) / tol)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 9, 17])
@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("n", [32, 160])
def test_exact_values_give_the_exact_product(m, b, n):
  # Integers times powers of two, sums under 2**24: no operation rounds.
  _need_kernel()
  rng = np.random.default_rng(m * n + b)
  k = 7 * b
  q = rng.integers(-128, 128, (n, k), dtype=np.int8)
  s = (2.0 ** rng.integers(-3, 3, (n, k // b))).astype(np.float32)
  o = rng.integers(-64, 64, (n, k // b)).astype(np.float32)
  x = rng.integers(-4, 5, (m, k)).astype(np.float32)
  ref, _ = _reference(x, q, s, o, b)
  np.testing.assert_array_equal(_run(x, q, s, o), ref)
  ref_sym, _ = _reference(x, q, s, None, b)
  np.testing.assert_array_equal(_run(x, q, s, None), ref_sym)


@pytest.mark.parametrize("offsets", [False, True])
def test_real_shape_blocks(offsets):
  # The 1.5B's o projection: K = 1536, 48 panels; a decode step and a verify.
  _need_kernel()
  b = 32 if offsets else 16
  q, s, o = _blocks(1536, 1536, b, offsets, seed=3)
  x = np.random.default_rng(4).standard_normal((9, 1536)).astype(np.float32)
  ref, tol = _reference(x, q, s, o, b)
  for rows in (x[:1], x):
    y = _run(rows, q, s, o)
    assert np.all(np.abs(y - ref[:len(rows)]) <= tol[:len(rows)])


@pytest.mark.parametrize("m", [2, 3, 9, 17, 320])
@pytest.mark.parametrize("offsets", [False, True])
def test_a_row_comes_out_bit_for_bit_the_same_whatever_rows_share_the_call(m, offsets):
  # One row reads four panels in step (one on an AMD AVX-512 host), two or
  # three rows two, more rows one at a time in tiles of up to 12 rows; the
  # sums are the same, in the same order, so a verify row equals the
  # target-only step's bit for bit.
  _need_kernel()
  q, s, o = _blocks(224, 96, 32, offsets, seed=m)
  x = np.random.default_rng(m).standard_normal((m, 96)).astype(np.float32)
  many = _run(x, q, s, o)
  for row in sorted({0, m // 2, m - 1}):
    np.testing.assert_array_equal(many[row], _run(x[row:row + 1], q, s, o)[0])


def test_leading_axes_and_the_einsum_fallback(monkeypatch):
  q, s, o = _blocks(64, 96, 32, True, seed=5)
  x = np.random.default_rng(6).standard_normal((2, 3, 96)).astype(np.float32)
  qp, sp, op = cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s), jnp.asarray(o))
  y = np.asarray(cpu_kernels.matmul_blocks(jnp.asarray(x), qp, sp, op))
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  fallback = np.asarray(cpu_kernels.matmul_blocks(jnp.asarray(x), qp, sp, op))
  ref, tol = _reference(x.reshape(6, 96), q, s, o, 32)
  assert y.shape == fallback.shape == (2, 3, 64)
  assert np.all(np.abs(y.reshape(6, 64) - ref) <= tol)
  assert np.all(np.abs(fallback.reshape(6, 64) - ref) <= tol)


def test_other_block_sizes_take_the_einsum():
  # B = 8 is not the kernel's: the einsum over the widened weights runs instead.
  q, s, o = _blocks(32, 48, 8, True, seed=7)
  x = np.random.default_rng(8).standard_normal((3, 48)).astype(np.float32)
  ref, tol = _reference(x, q, s, o, 8)
  assert np.all(np.abs(_run(x, q, s, o) - ref) <= tol)


def test_pack_blocks_lays_out_panels_and_round_trips():
  q, s, o = _blocks(96, 64, 16, True, seed=9)
  qp, sp, op = cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s), jnp.asarray(o))
  assert qp.shape == (3, 64, 32) and qp.dtype == jnp.int8
  assert sp.shape == op.shape == (3, 4, 32) and sp.dtype == jnp.float32
  # column c of panel p is output 32p + c, with its K contiguous down the panel
  assert qp[2, 17, 5] == q[69, 17] and sp[1, 3, 30] == s[62, 3] and op[0, 2, 1] == o[1, 2]
  back = cpu_kernels.unpack_blocks(qp, sp, op)
  for a, b in zip(back, (q, s, o)):
    np.testing.assert_array_equal(np.asarray(a), b)
  # the widened panels are `pack` of the widened [K, N] matrix, bit for bit
  w = gguf_blocks.widen(q, s, o, 16)  # [N, K]
  np.testing.assert_array_equal(np.asarray(cpu_kernels.widen_blocks(qp, sp, op)).view(np.uint32),
                                np.asarray(cpu_kernels.pack(jnp.asarray(w.T))).view(np.uint32))
  assert cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s))[2] is None


def test_pack_blocks_refuses_what_it_cannot_hold():
  q, s, o = _blocks(64, 64, 32, True, seed=10)
  with pytest.raises(ValueError, match="multiple of 32"):
    cpu_kernels.pack_blocks(jnp.asarray(q[:48]), jnp.asarray(s[:48]))
  with pytest.raises(ValueError, match="int8"):
    cpu_kernels.pack_blocks(jnp.asarray(q.astype(np.int16)), jnp.asarray(s))
  with pytest.raises(ValueError, match="scales"):
    cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s[:, :1].repeat(3, axis=1)))
  with pytest.raises(ValueError, match="offsets"):
    cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s), jnp.asarray(o[:, :1]))


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("b", [16, 32])
def test_layer_variant_picks_the_indexed_layers_blocks(offsets, b):
  layers = [_blocks(96, 4 * b, b, offsets, seed=20 + i) for i in range(3)]
  packed = [cpu_kernels.pack_blocks(jnp.asarray(q), jnp.asarray(s),
                                    None if o is None else jnp.asarray(o)) for q, s, o in layers]
  x = np.random.default_rng(11).standard_normal((5, 4 * b)).astype(np.float32)

  def run(index, x):
    picks = [cpu_kernels.LayerPick(tuple(p[part] for p in packed), index) for part in range(2)]
    opick = cpu_kernels.LayerPick(tuple(p[2] for p in packed), index) if offsets else None
    return cpu_kernels.matmul_blocks(x, *picks, opick)

  run = jax.jit(run)
  for i, (q, s, o) in enumerate(layers):
    for rows in (x[:1], x):
      y = np.asarray(run(jnp.int32(i), jnp.asarray(rows)))
      np.testing.assert_array_equal(y, _run(rows, q, s, o))  # the same kernel on that layer
      ref, tol = _reference(rows, q, s, o, b)
      assert np.all(np.abs(y - ref) <= tol)


def test_layer_variant_inside_a_scan_over_layers():
  layers = [_blocks(64, 96, 32, True, seed=30 + i) for i in range(4)]
  packed = [cpu_kernels.pack_blocks(*(None if a is None else jnp.asarray(a) for a in blk))
            for blk in layers]
  x = np.random.default_rng(12).standard_normal((1, 96)).astype(np.float32)

  @jax.jit
  def scan(x):
    def body(carry, index):
      picks = [cpu_kernels.LayerPick(tuple(p[part] for p in packed), index) for part in range(3)]
      return carry, cpu_kernels.matmul_blocks(carry, *picks)
    return jax.lax.scan(body, x, jnp.arange(4, dtype=jnp.int32))[1]  # [4, 1, 64]

  ys = np.asarray(scan(jnp.asarray(x)))
  for i, (q, s, o) in enumerate(layers):
    np.testing.assert_array_equal(ys[i], _run(x, q, s, o))


def test_mixed_layer_picks_and_arrays_are_refused():
  q, s, o = (jnp.asarray(a) for a in _blocks(32, 64, 32, True, seed=13))
  qp, sp, op = cpu_kernels.pack_blocks(q, s, o)
  pick = cpu_kernels.LayerPick((qp,), jnp.int32(0))
  with pytest.raises(ValueError, match="LayerPick"):
    cpu_kernels.matmul_blocks(jnp.ones((1, 64)), pick, sp, op)


def test_kernels_name_a_bad_layer_or_buffer_count():
  # What the Python side should never send is still checked in the C++ and
  # named with what was expected, not read past the end of the buffer list.
  _need_kernel()
  q, s, o = (jnp.asarray(a) for a in _blocks(32, 64, 32, True, seed=14))
  qp, sp, op = cpu_kernels.pack_blocks(q, s, o)
  x = jnp.ones((1, 64), jnp.float32)
  layer = jax.ffi.ffi_call(cpu_kernels.LAYER_TARGETS[cpu_kernels.TARGET_BLK],
                           jax.ShapeDtypeStruct((1, 32), jnp.float32))
  for index in (1, -1):
    with pytest.raises(Exception, match=rf"layer {index} outside \[0, 1\) or 3 buffers"):
      layer(x, jnp.int32(index), qp, sp, op).block_until_ready()
  np.testing.assert_array_equal(np.asarray(layer(x, jnp.int32(0), qp, sp, op)),
                                np.asarray(cpu_kernels.matmul_blocks(x, qp, sp, op)))
  many = jax.ffi.ffi_call(cpu_kernels.TARGET_BLK_MANY, jax.ShapeDtypeStruct((1, 64), jnp.float32))
  attrs = dict(parts=2, layers=1, nibbles=False, offsets=True, any_order=False)
  with pytest.raises(Exception, match="3 buffers for 2 parts of 1 layers"):
    many(x, jnp.int32(0), qp, sp, op, **attrs).block_until_ready()
  with pytest.raises(Exception, match=r"a layer in \[0, 1\), got 6 buffers and layer 1"):
    many(x, jnp.int32(1), qp, sp, op, qp, sp, op, **attrs).block_until_ready()
