"""convert.gguf_blocks: every exact type's int8 blocks widen to gguf-py's dequantized values bit for bit."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # pylint: disable=wrong-import-position

from convert import gguf_blocks  # pylint: disable=wrong-import-position
from convert import keys  # pylint: disable=wrong-import-position

T = gguf.GGMLQuantizationType
# The types gguf-py (0.19) can quantize whose values are int8 blocks.
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "MXFP4")
# Byte offsets of each type's fp16 fields (d, dmin, m) in a block: random
# bytes there are made finite (any sign, subnormals included); all other
# bytes (quants, packed scales, MXFP4's exponent) stay random.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "TQ1_0": (52,), "TQ2_0": (64,), "MXFP4": (), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
  return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _random_blocks(name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
  """uint8 [rows, blocks_per_row * type_size]: random block bytes with finite fp16 fields."""
  _, ts = gguf.GGML_QUANT_SIZES[T[name]]
  rng = np.random.default_rng(seed)
  raw = rng.integers(0, 256, (rows * blocks_per_row, ts), dtype=np.uint8)
  for at in F16_FIELDS[name]:
    bits = rng.integers(0, 1 << 16, raw.shape[0], dtype=np.uint32)
    exponent = rng.integers(0, 31, raw.shape[0], dtype=np.uint32)  # 31 is inf / NaN
    bits = (bits & ~np.uint32(0x7C00)) | (exponent << 10)
    raw[:, at:at + 2] = bits.astype(np.uint16).view(np.uint8).reshape(-1, 2)
  return raw.reshape(rows, blocks_per_row * ts)


def test_every_type_has_its_fp16_fields_listed():
  assert set(F16_FIELDS) == set(gguf_blocks.EXACT_TYPES)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantized_tensors_widen_bit_for_bit(name):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((7, 512)).astype(np.float32) * np.logspace(-4, 2, 7, dtype=np.float32)[:, None]
  x[3, 32:64] = 0.0  # an all-zero block
  x[4, :200] += 3.0  # a block far from zero (the offset types' min)
  data = quants.quantize(x, T[name])
  blocks = gguf_blocks.split(data, T[name])
  b = gguf_blocks.block_size(T[name])
  assert blocks.block == b and blocks.q.dtype == np.int8 and blocks.q.shape == (7, 512)
  assert blocks.scale.dtype == np.float32 and blocks.scale.shape == (7, 512 // b)
  assert (blocks.offset is None) == (name not in ("Q4_1", "Q5_1"))
  ours = gguf_blocks.widen(blocks.q, blocks.scale, blocks.offset, blocks.block)
  assert _same_bits(ours, quants.dequantize(data, T[name]))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # MXFP4's largest exponents: inf
@pytest.mark.parametrize("name", gguf_blocks.EXACT_TYPES)
def test_random_blocks_widen_bit_for_bit(name):
  bs, _ = gguf.GGML_QUANT_SIZES[T[name]]
  data = _random_blocks(name, rows=5, blocks_per_row=3 if bs == 256 else 9, seed=2)
  blocks = gguf_blocks.split(data, T[name])
  theirs = quants.dequantize(data, T[name])
  assert blocks.q.shape == theirs.shape
  ours = gguf_blocks.widen(blocks.q, blocks.scale, blocks.offset, blocks.block)
  assert _same_bits(ours, theirs)
  # the random bytes reach the whole range of each type's values
  assert len(np.unique(blocks.q)) > 2


def test_k_quant_offsets_are_negated_mins():
  # Q4_K: w = (d*sc) * q - (dmin*m); the block form keeps -(dmin*m), one float32 product
  data = _random_blocks("Q4_K", rows=2, blocks_per_row=2, seed=3)
  blocks = gguf_blocks.split(data, T.Q4_K)
  assert blocks.block == 32 and blocks.scale.shape == (2, 16) and blocks.offset.shape == (2, 16)
  dmin = data[0, 2:4].copy().view(np.float16).astype(np.float32)[0]
  m0 = data[0, 8] & 0x3F  # the first sub-block's min: the low 6 bits of scales byte 4
  assert blocks.offset[0, 0] == -(dmin * np.float32(m0))


def test_q6_k_blocks_of_sixteen():
  data = _random_blocks("Q6_K", rows=3, blocks_per_row=2, seed=4)
  blocks = gguf_blocks.split(data, T.Q6_K)
  assert blocks.block == 16 and blocks.scale.shape == (3, 32) and blocks.offset is None
  assert blocks.q.min() >= -32 and blocks.q.max() <= 31


@pytest.mark.parametrize("name", ["F16", "BF16", "F32", "IQ2_XXS", "NVFP4"])
def test_inexact_types_raise(name):
  with pytest.raises(gguf_blocks.InexactError, match=name):
    gguf_blocks.split(np.zeros((2, 64), np.uint8), T[name])
  assert issubclass(gguf_blocks.InexactError, keys.ConvertError)


def test_partial_block_row_raises():
  with pytest.raises(keys.ConvertError, match="whole number"):
    gguf_blocks.split(np.zeros((2, 33), np.uint8), T.Q8_0)


def test_widen_rejects_mismatched_scales():
  with pytest.raises(ValueError, match="block"):
    gguf_blocks.widen(np.zeros((2, 64), np.int8), np.ones((2, 3), np.float32), None, 32)


def test_check_a_file(tmp_path, capsys):
  """`--check` reads a real GGUF file: quantized tensors checked, float ones kept."""
  writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen2")
  rng = np.random.default_rng(5)
  writer.add_tensor("a.weight", quants.quantize(rng.standard_normal((64, 96)).astype(np.float32),
                                                T.Q8_0), raw_dtype=T.Q8_0)
  writer.add_tensor("b.weight", _random_blocks("Q4_K", 32, 1, 6), raw_dtype=T.Q4_K)
  writer.add_tensor("c.weight", _random_blocks("Q6_K", 32, 2, 7), raw_dtype=T.Q6_K)
  writer.add_tensor("norm.weight", np.ones(96, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  assert gguf_blocks.main(["--check", str(tmp_path / "m.gguf")]) == 0
  out = capsys.readouterr().out
  assert "bit for bit: every quantized tensor" in out and "F32 x1" in out
  reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
  result = gguf_blocks.check(tmp_path / "m.gguf")
  assert result["types"]["Q6_K"] == {"tensors": 1, "weights": 32 * 512, "exact": 1,
                                     "gguf_bytes": 32 * 2 * 210,
                                     "compact_bytes": 32 * 512 + 4 * 32 * 512 // 16}
  tensor = {t.name: t for t in reader.tensors}["b.weight"]
  blocks = gguf_blocks.from_tensor(tensor)
  assert blocks.q.shape == (32, 256) and blocks.offset.shape == (32, 8)
