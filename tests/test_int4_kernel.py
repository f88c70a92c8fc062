"""The int4 kernel (`jspec/cpu_int4.cc`) and its panels: the 4-bit draft's products on int8 activations.

`cpu_kernels.pack_int4` lays q, float16 scales and offsets out as the
kernel reads them; `matmul_int4` must equal sum_j s (q . xq) + o sum(xq)
per block up to float32 rounding, in every variant (one matrix, several in
one call, a layer picked in the loop), and each row of a several-row call
must equal its one-row call bit for bit. Planted by hand, each failing
here: the high nibble multiplied by the low nibble's activations, the
offset term dropped, the block sums of xq taken one block off (in
`cpu_int4.cc`), and the scales read as the offsets (in `unpack_int4`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import cpu_kernels
from jspec import weights

needs_int4 = pytest.mark.skipif(not cpu_kernels.int4_available(),
                                reason="the int4 kernel needs AVX-512 VNNI")


def _matrix(n: int, k: int, seed: int = 0):
  """Random q [N, K] in [0, 15], scales and offsets [N, K/32] exact in float16, and xq [9, K]."""
  rng = np.random.default_rng(seed)
  q = rng.integers(0, 16, (n, k)).astype(np.uint8)
  scale = (rng.integers(1, 64, (n, k // 32)) * 2.0 ** -10).astype(np.float32)
  offset = (rng.integers(-512, 512, (n, k // 32)) * 2.0 ** -9).astype(np.float32)
  xq = rng.integers(-127, 128, (9, k)).astype(np.int8)
  return q, scale, offset, xq


def _reference(q, scale, offset, xq) -> np.ndarray:
  """xq @ W.T in float64, W = scale * q + offset per block of 32."""
  w = q.astype(np.float64) * np.repeat(scale, 32, 1) + np.repeat(offset, 32, 1)  # [N, K]
  return xq.astype(np.float64) @ w.T


def test_panels_hold_each_q_where_the_kernel_reads_it():
  q, scale, offset, _ = _matrix(64, 96)
  panels = np.asarray(cpu_kernels.pack_int4(q, scale, offset))
  assert panels.shape == (2, 3, 640) and panels.dtype == np.uint8
  for n, k in [(0, 0), (5, 3), (17, 4), (31, 7), (40, 45), (63, 95)]:
    p, c, j = n // 32, (k % 32) // 8, k // 32
    h, lane, b, high = (n % 32) // 16, n % 16, k % 4, (k % 8) // 4
    byte = panels[p, j, c * 128 + h * 64 + 4 * lane + b]
    assert (byte >> 4 if high else byte & 15) == q[n, k], (n, k)
  scales = panels[1, 2, 512:576].view(np.float16)  # outputs 32..63, block 2
  offsets = panels[1, 2, 576:640].view(np.float16)
  np.testing.assert_array_equal(scales.astype(np.float32), scale[32:, 2])
  np.testing.assert_array_equal(offsets.astype(np.float32), offset[32:, 2])
  back = cpu_kernels.unpack_int4(panels)
  for got, want in zip(back, (q, scale, offset)):
    np.testing.assert_array_equal(np.asarray(got), want)


def test_packing_refuses_shapes_the_kernel_cannot_take():
  for shape in [(48, 64), (64, 40)]:
    with pytest.raises(ValueError) as err:
      cpu_kernels.pack_int4(np.zeros(shape, np.uint8), np.zeros((shape[0], 1), np.float32),
                            np.zeros((shape[0], 1), np.float32))
    assert "\n" not in str(err.value) and "multiples of 32" in str(err.value)


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_int4), False],
                         ids=["kernel", "xla"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_the_product_is_the_blocks_sums(monkeypatch, kernel, m):
  if not kernel:
    monkeypatch.setattr(cpu_kernels, "int4_available", lambda: False)
  q, scale, offset, xq = _matrix(96, 160, seed=m)
  panels = cpu_kernels.pack_int4(q, scale, offset)
  got = np.asarray(jax.jit(cpu_kernels.matmul_int4)(jnp.asarray(xq[:m]), panels))
  want = _reference(q, scale, offset, xq[:m])
  bound = 1e-6 * (np.abs(xq[:m]).astype(np.float64) @ np.abs(
      q * np.repeat(scale, 32, 1) + np.repeat(offset, 32, 1)).T)  # float32 sums' rounding
  assert np.all(np.abs(got - want) <= bound + 1e-6), np.abs(got - want).max()


@needs_int4
def test_rows_parts_and_layers_give_the_one_row_calls_bits():
  q, scale, offset, xq = _matrix(64, 128, seed=3)
  a = cpu_kernels.pack_int4(q, scale, offset)
  b = cpu_kernels.pack_int4(q[::-1].copy(), offset + 1, scale)
  x = jnp.asarray(xq)
  whole = np.asarray(jax.jit(cpu_kernels.matmul_int4)(x, a))
  for r in range(9):  # each row of the 9-row call (tiles of 4, 4 and 1) as its own call
    np.testing.assert_array_equal(whole[r], np.asarray(cpu_kernels.matmul_int4(x[r:r + 1], a))[0])
  ya, yb = jax.jit(lambda x: cpu_kernels.matmul_int4_many(x, [a, b]))(x)
  np.testing.assert_array_equal(np.asarray(ya), whole)
  np.testing.assert_array_equal(np.asarray(yb), np.asarray(cpu_kernels.matmul_int4(x, b)))

  def in_loop(x, index):
    pick = lambda *ws: cpu_kernels.LayerPick(ws, index)
    one = cpu_kernels.matmul_int4(x, pick(b, a))
    many = cpu_kernels.matmul_int4_many(x, [pick(a, b), pick(b, a)])
    return one, many

  one, (m0, m1) = jax.jit(in_loop)(x, jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(one), whole)
  np.testing.assert_array_equal(np.asarray(m0), np.asarray(yb))
  np.testing.assert_array_equal(np.asarray(m1), whole)


def test_the_leaf_holds_4_bit_blocks_with_float16_scales():
  w = np.array(jax.random.normal(jax.random.key(0), (96, 64)), np.float32)  # [I, O]
  w[:, 3] = 0.25  # an output whose every input is equal: kept exactly
  leaf = weights.to_int4_panels(weights.Dense(jnp.asarray(w)))
  assert isinstance(leaf, weights.Int4Panels) and leaf.shape == (96, 64)
  widened = np.asarray(weights.matrix(leaf)).T  # [O, I]
  rows = w.T
  blocked = rows.reshape(64, 3, 32).astype(np.float64)
  step = (blocked.max(2) - blocked.min(2)) / 15  # [O, 3]
  err = np.abs(widened - rows).reshape(64, 3, 32)
  # Half a step, plus the float16 offset's and scale's rounding (2^-11 relative, 15 steps).
  slack = 2.0 ** -11 * (np.abs(blocked.min(2)) + 15 * step) + 1e-6
  assert np.all(err <= (step / 2 + slack)[..., None]), err.max()
  np.testing.assert_array_equal(widened[3], rows[3])
  assert err.max() > 0  # random weights are not 4-bit
  table = weights.to_int4_panels(weights.Table(jnp.asarray(w.T)))  # [O rows, I]
  ids = jnp.asarray([[0, 5], [63, 32]])
  np.testing.assert_array_equal(np.asarray(weights.lookup(table, ids)), widened[np.asarray(ids)])


def test_a_matrix_the_panels_cannot_hold_keeps_the_float_block_form():
  w = jnp.asarray(np.ones((40, 64), np.float32))  # inputs not a multiple of 32
  assert isinstance(weights.to_int4_panels(weights.Dense(w)), weights.Blocks)
  assert isinstance(weights.to_int4_panels(weights.Dense(w[:32, :48])), weights.Dense)


@pytest.mark.parametrize("many", [False, True])
def test_dot_is_close_to_the_float_product(many):
  """Activations in int8 per row: x @ W within their rounding (half a step of each row's scale)."""
  w = np.array(jax.random.normal(jax.random.key(1), (128, 64)), np.float32)
  leaf = weights.to_int4_panels(weights.Dense(jnp.asarray(w)))
  x = np.array(jax.random.normal(jax.random.key(2), (2, 3, 128)), np.float32)
  wq = np.asarray(weights.matrix(leaf), np.float64)  # [I, O]
  got = (weights.dot_many(jnp.asarray(x), [leaf, leaf])[1] if many
         else weights.dot(jnp.asarray(x), leaf))
  assert got.shape == (2, 3, 64)
  want = x.astype(np.float64) @ wq
  half_step = np.abs(x).max(-1, keepdims=True) / 127 / 2  # [2, 3, 1]
  bound = half_step * np.abs(wq).sum(0) + 1e-4
  assert np.all(np.abs(np.asarray(got) - want) <= bound)
  assert np.abs(np.asarray(got) - want).max() > 0  # quantized: not the float product itself
