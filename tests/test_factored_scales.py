"""Factored block scales (`cpu_kernels.factor_scales`, `pack_factored`): a k-quant's d * sc, stored so.

A K-quant's block scale is the float32 product of a float16 d per 256
inputs and a small integer per block. Stored as those two, the scales take
a quarter of their float32 bytes; the kernel multiplies them back, exactly,
so every output must be the float32-scale kernel's bit for bit, and the
stored matrix must widen to gguf-py's values bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert import gguf_blocks
from jspec import cpu_kernels
from jspec import weights

gguf = pytest.importorskip("gguf")
from gguf import quants  # pylint: disable=wrong-import-position

T = gguf.GGMLQuantizationType
# fp16 fields (d, dmin) of each K-quant block, made finite in random bytes.
F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _kquant(name: str, rows: int, k: int, seed: int) -> tuple[np.ndarray, gguf_blocks.Blocks]:
  """Random K-quant bytes [rows, k] (finite d) and their int8 blocks."""
  _, ts = gguf.GGML_QUANT_SIZES[T[name]]
  rng = np.random.default_rng(seed)
  raw = rng.integers(0, 256, (rows * k // 256, ts), dtype=np.uint8)
  for at in F16_FIELDS[name]:
    bits = rng.integers(0, 1 << 16, raw.shape[0], dtype=np.uint32)
    exponent = rng.integers(1, 20, raw.shape[0], dtype=np.uint32)  # finite, products far from overflow
    bits = (bits & ~np.uint32(0x7C00)) | (exponent << 10)
    raw[:, at:at + 2] = bits.astype(np.uint16).view(np.uint8).reshape(-1, 2)
  raw = raw.reshape(rows, -1)
  return raw, gguf_blocks.split(raw, T[name])


def _same_bits(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _pack(blocks: gguf_blocks.Blocks, factored: bool):
  return cpu_kernels.pack_blocks(jnp.asarray(blocks.q), jnp.asarray(blocks.scale),
                                 None if blocks.offset is None else jnp.asarray(blocks.offset),
                                 factored=factored)


def _need_kernel():
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("name", sorted(F16_FIELDS))
def test_kquant_scales_factor_exactly(name):
  _, blocks = _kquant(name, 64, 1024, seed=1)
  for scale in (blocks.scale, blocks.offset):
    if scale is None:
      continue
    factors = cpu_kernels.factor_scales(scale, blocks.block)
    assert factors is not None
    sc, d = factors
    r = 256 // blocks.block
    assert sc.dtype == np.int8 and sc.shape == scale.shape
    assert d.dtype == np.float32 and d.shape == (64, 1024 // 256)
    assert _same_bits(np.repeat(d, r, axis=1) * sc.astype(np.float32), scale)


def test_scales_without_a_shared_d_do_not_factor():
  rng = np.random.default_rng(2)
  scale = rng.uniform(0.5, 2.0, (32, 16)).astype(np.float32)  # independent floats
  assert cpu_kernels.factor_scales(scale, 32) is None
  assert cpu_kernels.factor_scales(scale[:, :6], 32) is None  # 192 inputs: no whole super-block
  # All-zero groups of either sign, and a group of signed zeros, factor.
  zeros = np.zeros((32, 8), np.float32)
  zeros[3, 2] = -0.0
  zeros[5] = -0.0
  sc, d = cpu_kernels.factor_scales(zeros, 32)
  assert _same_bits(np.repeat(d, 8, axis=1) * sc.astype(np.float32), zeros)
  with pytest.raises(ValueError, match="cannot factor"):
    cpu_kernels.pack_blocks(jnp.zeros((32, 512), jnp.int8), jnp.asarray(scale), factored=True)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_factored_panels_widen_to_gguf_values(name):
  raw, blocks = _kquant(name, 96, 512, seed=3)
  qp, sp, op = _pack(blocks, factored=True)
  r = 256 // blocks.block
  assert sp.dtype == jnp.int8 and sp.shape == (3, 2 * (4 + r), 32)
  assert cpu_kernels.is_factored(sp) and (op is None or op.shape == sp.shape)
  assert cpu_kernels.block_size(512, sp) == blocks.block
  gguf_values = quants.dequantize(raw, T[name])  # [96, 512]
  widened = np.asarray(cpu_kernels.unpack(cpu_kernels.widen_blocks(qp, sp, op)))  # [K, N]
  assert _same_bits(widened, gguf_values.T)
  back = cpu_kernels.unpack_blocks(qp, sp, op)
  assert _same_bits(back[1], blocks.scale)
  assert back[2] is None if blocks.offset is None else _same_bits(back[2], blocks.offset)
  # factored scales take a quarter of the float32 ones' bytes, and d's share
  _, fsp, _ = _pack(blocks, factored=False)
  assert sp.nbytes == fsp.nbytes // 4 + 2 * 128 * 3


@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 13, 17])
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q3_K"])
def test_factored_kernel_equals_the_float_scale_kernel_bit_for_bit(m, name):
  # N = 224: seven panels, so four (and two) in step leave some over.
  _need_kernel()
  _, blocks = _kquant(name, 224, 512, seed=m)
  x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 512)).astype(np.float32))
  run = jax.jit(cpu_kernels.matmul_blocks)
  want = np.asarray(run(x, *_pack(blocks, factored=False)))
  got = np.asarray(run(x, *_pack(blocks, factored=True)))
  assert np.isfinite(want).all() and _same_bits(got, want)


def test_factored_fallback_equals_the_float_scale_fallback(monkeypatch):
  _, blocks = _kquant("Q4_K", 64, 512, seed=5)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32))
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  want = np.asarray(cpu_kernels.matmul_blocks(x, *_pack(blocks, factored=False)))
  assert _same_bits(cpu_kernels.matmul_blocks(x, *_pack(blocks, factored=True)), want)


def test_layer_loop_forms_and_shared_calls_read_factored_scales():
  # Two layers in Q4_K and one in Q6_K (a Q4_K_M file's ffn_down), factored,
  # beside a layer loop over float-scale panels: each call gives each
  # layer's own product, and gate and up in one call give each its own.
  _need_kernel()
  layers = [_kquant(name, 96, 512, seed=10 + i)[1]
            for i, name in enumerate(["Q4_K", "Q6_K", "Q4_K"])]
  x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 512)).astype(np.float32))
  leaves = [weights.blocks(b.q, b.scale, b.offset) for b in layers]
  assert all(cpu_kernels.is_factored(w.scale) for w in leaves)
  floats = [weights.blocks(b.q, b.scale, b.offset, factored=False) for b in layers]
  want = [np.asarray(weights.dot(x, w)) for w in floats]

  @jax.jit
  def loop(x):
    def body(carry, index):
      return carry, weights.dot(x, weights.pick(leaves, index))
    return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

  got = np.asarray(loop(x))
  for i in range(3):
    assert _same_bits(got[i], want[i])
  gate, up = weights.dot_many(x, [leaves[0], leaves[2]])
  assert _same_bits(gate, want[0]) and _same_bits(up, want[2])


def test_lookup_reads_factored_rows():
  _, blocks = _kquant("Q6_K", 64, 512, seed=7)
  factored = weights.blocks(blocks.q, blocks.scale, blocks.offset)
  plain = weights.blocks(blocks.q, blocks.scale, blocks.offset, factored=False)
  assert cpu_kernels.is_factored(factored.scale) and not cpu_kernels.is_factored(plain.scale)
  ids = jnp.asarray([[0, 63, 33], [31, 32, 1]], jnp.int32)
  want = np.asarray(weights.lookup(plain, ids))
  assert _same_bits(weights.lookup(factored, ids), want)
  assert _same_bits(want, np.asarray(weights.matrix(plain)).T[np.asarray(ids)])


def test_kernel_refuses_scales_and_offsets_of_different_forms():
  _need_kernel()
  _, blocks = _kquant("Q4_K", 32, 512, seed=8)
  qp, sp, op = _pack(blocks, factored=True)
  _, fsp, fop = _pack(blocks, factored=False)
  with pytest.raises(ValueError, match="one form"):
    cpu_kernels.matmul_blocks(jnp.ones((1, 512)), qp, sp, fop)
  with pytest.raises(Exception, match="alike"):
    jax.ffi.ffi_call(cpu_kernels.TARGET_BLK4, jax.ShapeDtypeStruct((1, 32), jnp.float32))(
        jnp.ones((1, 512)), qp, fsp, op).block_until_ready()
