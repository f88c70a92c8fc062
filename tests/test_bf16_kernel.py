"""jspec.cpu_kernels' bfloat16 kernel (`matmul_bf16`): x @ W for bfloat16 panels widened exactly.

Tolerance against float64: (K + 2) * 2**-24 * sum_k |x_k w_k|, the float32
rounding bound of summing K products in any order. Where the kernel runs,
it must also equal `matmul` (jspec_gemm_f32) over the widened panels bit for
bit: each output is one FMA chain over k in order in both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import cpu_kernels

U = 2.0 ** -24


def _weights(k, n, seed):
  """bfloat16 [K, N] (as a jax array) and the same values as float64."""
  w = jnp.asarray(np.random.default_rng(seed).standard_normal((k, n)), jnp.bfloat16)
  return w, np.asarray(w.astype(jnp.float32)).astype(np.float64)


def _need_kernel():
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 17, 20, 320])
@pytest.mark.parametrize("k,n", [(37, 32), (80, 224)])  # K odd, not a multiple of 64; 1 and 7 panels
def test_matmul_bf16_matches_float64_and_the_fp32_kernel(m, k, n):
  w, w64 = _weights(k, n, seed=k + n)
  x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
  panels = cpu_kernels.pack(w)
  y = np.asarray(jax.jit(cpu_kernels.matmul_bf16)(jnp.asarray(x), panels))
  ref = x.astype(np.float64) @ w64
  tol = (k + 2) * U * (np.abs(x).astype(np.float64) @ np.abs(w64))
  assert y.shape == (m, n) and y.dtype == np.float32
  assert np.all(np.abs(y - ref) <= tol), np.max(np.abs(y - ref) / tol)
  if cpu_kernels.available():
    f32 = jax.jit(cpu_kernels.matmul)(jnp.asarray(x), panels.astype(jnp.float32))
    np.testing.assert_array_equal(y, np.asarray(f32))


def test_every_normal_bf16_value_widens_exactly():
  # One-hot rows of x pick single weights out: y[i] = w[k_i, :] exactly, for
  # random bit patterns of every sign and normal exponent, and zeros.
  _need_kernel()
  rng = np.random.default_rng(1)
  bits = rng.integers(0, 1 << 16, (64, 96), dtype=np.uint32)
  exponent = rng.integers(1, 255, bits.shape, dtype=np.uint32)  # not 0 (subnormal) or 255 (inf/NaN)
  bits = (bits & ~np.uint32(0x7F80)) | (exponent << 7)
  bits[5, :7] = 0x8000  # -0.0
  bits[6, :7] = 0
  w = jax.lax.bitcast_convert_type(jnp.asarray(bits.astype(np.uint16)), jnp.bfloat16)  # [K, N]
  x = np.eye(64, dtype=np.float32)[[0, 5, 6, 17, 63]]  # [5, K]
  y = np.asarray(jax.jit(cpu_kernels.matmul_bf16)(jnp.asarray(x), cpu_kernels.pack(w)))
  expected = (bits[[0, 5, 6, 17, 63]] << 16).view(np.float32)
  np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("m", [2, 3, 13, 40])
def test_a_row_comes_out_bit_for_bit_the_same_whatever_rows_share_the_call(m):
  _need_kernel()
  w, _ = _weights(96, 224, seed=2)
  panels = cpu_kernels.pack(w)
  x = np.random.default_rng(m).standard_normal((m, 96)).astype(np.float32)
  mm = jax.jit(cpu_kernels.matmul_bf16)
  many = np.asarray(mm(jnp.asarray(x), panels))
  for row in sorted({0, m // 2, m - 1}):
    np.testing.assert_array_equal(many[row], np.asarray(mm(jnp.asarray(x[row:row + 1]), panels))[0])


def test_leading_axes_and_the_einsum_fallback(monkeypatch):
  w, w64 = _weights(64, 96, seed=3)
  x = np.random.default_rng(4).standard_normal((2, 3, 64)).astype(np.float32)
  panels = cpu_kernels.pack(w)
  y = np.asarray(cpu_kernels.matmul_bf16(jnp.asarray(x), panels))
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  fallback = np.asarray(cpu_kernels.matmul_bf16(jnp.asarray(x), panels))
  ref = x.astype(np.float64) @ w64
  tol = 66 * U * (np.abs(x).astype(np.float64) @ np.abs(w64))
  assert y.shape == fallback.shape == (2, 3, 96)
  assert np.all(np.abs(y - ref) <= tol) and np.all(np.abs(fallback - ref) <= tol)


def test_layer_variant_picks_the_indexed_layer_inside_a_scan():
  layers = [_weights(48, 64, seed=10 + i) for i in range(3)]
  panels = tuple(cpu_kernels.pack(w) for w, _ in layers)
  x = np.random.default_rng(5).standard_normal((2, 48)).astype(np.float32)

  @jax.jit
  def scan(x):
    def body(carry, index):
      return carry, cpu_kernels.matmul_bf16(carry, cpu_kernels.LayerPick(panels, index))
    return jax.lax.scan(body, x, jnp.arange(3, dtype=jnp.int32))[1]  # [3, 2, 64]

  ys = np.asarray(scan(jnp.asarray(x)))
  mm = jax.jit(cpu_kernels.matmul_bf16)
  for i, p in enumerate(panels):
    np.testing.assert_array_equal(ys[i], np.asarray(mm(jnp.asarray(x), p)))
  assert not np.array_equal(ys[0], ys[1])
