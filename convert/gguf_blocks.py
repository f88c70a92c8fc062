"""GGUF quantized tensors as int8 blocks with float32 scales: the exact compact form.

    blocks = gguf_blocks.from_tensor(reader_tensor)   # q, scale, offset, block
    w = gguf_blocks.widen(blocks.q, blocks.scale, blocks.offset, blocks.block)
    # w equals gguf.quants.dequantize(reader_tensor.data, type), bit for bit

    python -m convert.gguf_blocks --check FILE.gguf

Why: jspec holds the target as float32, 3-5x the bytes that define it, and a
decode step is bound by the bytes it reads. Every GGUF type below defines
each weight as one or two float32 operations on a small integer:

  Q8_0   d * q               q in [-128, 127], d per 32
  Q4_0   d * (q - 8)         Q5_0  d * (q - 16)        IQ4_NL  d * table[q]
  Q4_1   d * q + m           Q5_1  d * q + m           per 32
  Q2_K   (d*sc) * q - (dmin*m)   per 16;  Q3_K (d*sc) * q, per 16
  Q4_K   (d*sc) * q - (dmin*m)   Q5_K the same, per 32
  Q6_K   (d*sc) * q, q in [-32, 31], per 16
  IQ4_XS (d*ls) * table[q], per 32;  TQ1_0, TQ2_0 d * q (q in -1..1)
  MXFP4  e8m0(e) * table[q], per 32

so an int8 q with a float32 scale (the float32 product gguf-py computes,
e.g. d*sc) and, for the asymmetric types, a float32 offset (-(dmin*m), or
m) per block of B = 16 or 32 weights holds the tensor exactly: `widen`
computes scale * q + offset in float32, which is the float32 operation
gguf-py's dequantizer performs, in the same order (a - b and a + (-b) round
alike in IEEE arithmetic), so it gives the same bits. Types whose values
are not such a product (F16, BF16, the IQ grid types, NVFP4) raise
`InexactError`: the caller keeps those as float.

The bit unpacking here is written from the block layouts (gguf-py's
quants.py and ggml's block structs), not borrowed from gguf-py, so the test
against `gguf.quants.dequantize` checks both.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from typing import Callable, Optional

import numpy as np

from convert import keys

QK_K = 256  # weights per K-quant super-block
# Rows converted at once in `from_tensor` and `check`: bounds the temporaries.
_ROWS_PER_CHUNK = 4096


class InexactError(keys.ConvertError):
  """A tensor type has no exact int8-block form (or no decoder here): keep it as float."""


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A matrix as int8 values with one float32 scale (and offset) per block of a row.

  w[r, c] = scale[r, c // block] * q[r, c] + offset[r, c // block] (no
  offset term when offset is None), in float32.

  Attributes:
    q: [out, in] int8.
    scale: [out, in / block] float32.
    offset: [out, in / block] float32, or None for symmetric types.
    block: weights per scale along a row: 16 or 32.
  """

  q: np.ndarray
  scale: np.ndarray
  offset: Optional[np.ndarray]
  block: int

  @property
  def nbytes(self) -> int:
    """Bytes of the compact form: q, scales and offsets."""
    return self.q.nbytes + self.scale.nbytes + (0 if self.offset is None else self.offset.nbytes)

  @property
  def shape(self) -> tuple[int, ...]:
    """The matrix's shape, [out, in]."""
    return tuple(self.q.shape)

  def widen(self) -> np.ndarray:
    """The float32 matrix these blocks define (`widen`)."""
    return widen(self.q, self.scale, self.offset, self.block)


def widen(q: np.ndarray, scale: np.ndarray, offset: Optional[np.ndarray], block: int) -> np.ndarray:
  """The float32 weights that int8 blocks define, as gguf-py's dequantizer computes them.

  Args:
    q: [..., K] int8.
    scale: [..., K / block] float32.
    offset: [..., K / block] float32, or None.
    block: weights per scale.

  Returns:
    [..., K] float32: scale * q (+ offset), each one float32 operation.
  """
  *lead, k = q.shape
  if k % block or scale.shape != (*lead, k // block):
    raise ValueError(f"widen: q {q.shape} and scale {scale.shape} do not match block {block}")
  qb = q.reshape(*lead, k // block, block).astype(np.float32)  # [..., K/B, B], exact
  with np.errstate(over="ignore"):  # a huge scale overflows to inf, as in gguf-py
    w = scale.astype(np.float32, copy=False)[..., None] * qb
    if offset is not None:
      w = w + offset.astype(np.float32, copy=False)[..., None]
  return w.reshape(*lead, k)


# --- per-type decoders: blocks [n, type_size] uint8 -> (q [n, bs] int8,
# scale [n, bs / B] float32, offset [n, bs / B] float32 or None), bs the
# type's weights per block.


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:  # [n, 1] float32
  return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
  """[n, 16] bytes -> [n, 32]: the low nibbles are weights 0..15, the high 16..31."""
  return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
  """[n, 4] bytes of a little-endian uint32 -> [n, 32] bits, weight i is bit i."""
  bits = qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)
  return (bits & 1).astype(np.uint8)


def _q8_0(b):
  return b[:, 2:34].copy().view(np.int8), _f16(b, 0), None


def _q4_0(b):
  return (_nibbles(b[:, 2:18]).astype(np.int8) - 8), _f16(b, 0), None


def _q4_1(b):
  return _nibbles(b[:, 4:20]).astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
  q = _nibbles(b[:, 6:22]) | (_high_bits32(b[:, 2:6]) << 4)
  return q.astype(np.int8) - 16, _f16(b, 0), None


def _q5_1(b):
  q = _nibbles(b[:, 8:24]) | (_high_bits32(b[:, 4:8]) << 4)
  return q.astype(np.int8), _f16(b, 0), _f16(b, 2)


def _crumbs(qs: np.ndarray) -> np.ndarray:
  """[n, 64] bytes -> [n, 256] 2-bit values: weight 128h + 32s + i is bits 2s of byte 32h + i."""
  n = qs.shape[0]
  parts = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
  return (parts & 3).reshape(n, QK_K)


def _q2_k(b):
  # scales [16] (low nibble scale, high nibble min), qs [64], d, dmin
  n = b.shape[0]
  sc, qs = b[:, 0:16], b[:, 16:80]
  d, dmin = _f16(b, 80), _f16(b, 82)
  scale = d * (sc & 0x0F).astype(np.float32)  # [n, 16]
  offset = -(dmin * (sc >> 4).astype(np.float32))
  return _crumbs(qs).astype(np.int8).reshape(n, QK_K), scale, offset


def _q3_k(b):
  # hmask [32], qs [64], scales [12] (6-bit, packed), d
  n = b.shape[0]
  hmask, qs, packed = b[:, 0:32], b[:, 32:96], b[:, 96:108]
  d = _f16(b, 108)
  low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=-1)  # [n, 16]
  high = (packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1))
  high = (high & 3).reshape(n, 16)  # scale j takes bits 2(j // 4) of byte 8 + j % 4
  sc = (low | (high << 4)).astype(np.int8) - 32
  scale = d * sc.astype(np.float32)  # [n, 16]
  # the high bit of weight 32s + i (s in 0..7) is bit s of hmask[i]; set means no -4
  hbit = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
  q = _crumbs(qs).astype(np.int8) - ((hbit.reshape(n, QK_K) ^ 1) << 2).astype(np.int8)
  return q, scale, None


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The 12 packed bytes of Q4_K / Q5_K -> (scale [n, 8], min [n, 8]) 6-bit integers."""
  a, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
  sc = np.concatenate([a & 0x3F, (md & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
  mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
  """[n, 128] bytes -> [n, 256]: sub-block 2c + h (32 weights) is nibble h of bytes 32c .. 32c + 31."""
  n = qs.shape[0]
  return np.stack([qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4], axis=2).reshape(n, QK_K)


def _q4_k(b):
  # d, dmin, scales [12], qs [128]
  d, dmin = _f16(b, 0), _f16(b, 2)
  sc, mn = _k_scales(b[:, 4:16])
  scale = d * sc.astype(np.float32)  # [n, 8]
  offset = -(dmin * mn.astype(np.float32))
  return _k_nibbles(b[:, 16:144]).astype(np.int8), scale, offset


def _q5_k(b):
  # d, dmin, scales [12], qh [32], qs [128]
  n = b.shape[0]
  d, dmin = _f16(b, 0), _f16(b, 2)
  sc, mn = _k_scales(b[:, 4:16])
  # the fifth bit of weight 32j + i is bit j of qh[i]
  hbit = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
  q = _k_nibbles(b[:, 48:176]) | (hbit.reshape(n, QK_K) << 4)
  return q.astype(np.int8), d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(b):
  # ql [128], qh [64], scales [16] int8, d
  n = b.shape[0]
  ql, qh = b[:, 0:128], b[:, 128:192]
  d = _f16(b, 208)
  scale = d * b[:, 192:208].copy().view(np.int8).astype(np.float32)  # [n, 16]
  # weight 128h + 64t + i (i < 64): nibble t of ql[64h + i]
  low = np.stack([ql.reshape(n, 2, 64) & 0x0F, ql.reshape(n, 2, 64) >> 4], axis=2).reshape(n, QK_K)
  q = (low | (_crumbs(qh) << 4)).astype(np.int8) - 32
  return q, scale, None


def _tq1_0(b):
  # qs [48] (five ternary digits per byte, as a fraction of 243), qh [4], d
  n = b.shape[0]
  powers = np.array([1, 3, 9, 27, 81], np.uint8)
  first = (b[:, 0:32].reshape(n, 1, 32) * powers.reshape(1, 5, 1)).reshape(n, 160)
  second = (b[:, 32:48].reshape(n, 1, 16) * powers.reshape(1, 5, 1)).reshape(n, 80)
  last = (b[:, 48:52].reshape(n, 1, 4) * powers[:4].reshape(1, 4, 1)).reshape(n, 16)
  digits = np.concatenate([first, second, last], axis=-1)  # uint8 products wrap, as in ggml
  q = ((digits.astype(np.uint16) * 3) >> 8).astype(np.int8) - 1
  return q, np.repeat(_f16(b, 52), QK_K // 32, axis=-1), None


def _tq2_0(b):
  # qs [64] (2-bit, value - 1), d
  q = _crumbs(b[:, 0:64]).astype(np.int8) - 1
  return q, np.repeat(_f16(b, 64), QK_K // 32, axis=-1), None


_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       np.int8)


def _mxfp4(b):
  # e (an e8m0 exponent, halved), qs [16]
  e = b[:, 0:1].astype(np.uint32)
  bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
  return _MXFP4_VALUES[_nibbles(b[:, 1:17])], bits.view(np.float32), None


def _iq4_nl(b):
  return _IQ4_VALUES[_nibbles(b[:, 2:18])], _f16(b, 0), None


def _iq4_xs(b):
  # d, scales_h (uint16: 2 bits per sub-block), scales_l [4] (a nibble each), qs [128]
  n = b.shape[0]
  d = _f16(b, 0)
  high = (b[:, 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, 8]
  low = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=-1).reshape(n, 8)
  ls = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32
  # sub-block j (32 weights): low nibbles of bytes 16j .. 16j + 15, then their high nibbles
  qs = b[:, 8:136].reshape(n, 8, 16)
  idx = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, QK_K)
  return _IQ4_VALUES[idx], d * ls.astype(np.float32), None


# type name -> (decoder, B: weights per scale in the compact form)
_DECODERS: dict[str, tuple[Callable, int]] = {
    "Q8_0": (_q8_0, 32), "Q4_0": (_q4_0, 32), "Q4_1": (_q4_1, 32), "Q5_0": (_q5_0, 32),
    "Q5_1": (_q5_1, 32), "Q2_K": (_q2_k, 16), "Q3_K": (_q3_k, 16), "Q4_K": (_q4_k, 32),
    "Q5_K": (_q5_k, 32), "Q6_K": (_q6_k, 16), "TQ1_0": (_tq1_0, 32), "TQ2_0": (_tq2_0, 32),
    "MXFP4": (_mxfp4, 32), "IQ4_NL": (_iq4_nl, 32), "IQ4_XS": (_iq4_xs, 32),
}
EXACT_TYPES = tuple(_DECODERS)  # type names `split` holds exactly


def block_size(tensor_type) -> int:
  """Weights per scale of a type's compact form.

  Args:
    tensor_type: a `gguf.GGMLQuantizationType` (or its name).

  Returns:
    16 or 32.

  Raises:
    InexactError: the type has no exact int8-block form here.
  """
  return _decoder(tensor_type)[1]


def _decoder(tensor_type) -> tuple[Callable, int]:
  name = getattr(tensor_type, "name", tensor_type)
  if name not in _DECODERS:
    raise InexactError(f"GGUF type {name} has no exact int8-block form (exact: "
                       f"{', '.join(EXACT_TYPES)}); keep it as float")
  return _DECODERS[name]


def _gguf():
  """The gguf package, imported on first use, so that `import jspec` never pays for it."""
  try:
    import gguf  # pylint: disable=import-outside-toplevel
    import gguf.quants  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise keys.ConvertError("reading GGUF blocks needs the gguf package (pip install gguf)") \
        from None
  return gguf


def _sizes(name: str) -> tuple[int, int]:
  """(weights, bytes) per block of a GGUF type."""
  gguf = _gguf()
  return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


@dataclasses.dataclass(frozen=True)
class Form:
  """What `split` makes of a type, known before any tensor of it is read.

  Attributes:
    block: weights per scale (`Blocks.block`).
    offset: whether its blocks have an offset term (`Blocks.offset` is not None).
  """

  block: int
  offset: bool


def form(tensor_type) -> Form:
  """The int8-block form of a type, from decoding one block of zeros with its own decoder.

  Args:
    tensor_type: a `gguf.GGMLQuantizationType` (or its name).

  Returns:
    Its block size and whether it has offsets.

  Raises:
    InexactError: the type has no exact int8-block form here.
  """
  _decoder(tensor_type)  # InexactError before anything else
  blocks = split(np.zeros((1, _sizes(getattr(tensor_type, "name", tensor_type))[1]), np.uint8),
                 tensor_type)
  return Form(block=blocks.block, offset=blocks.offset is not None)


def split(data: np.ndarray, tensor_type) -> Blocks:
  """A tensor's raw GGUF block bytes as int8 blocks that widen to exactly its values.

  Args:
    data: uint8 [rows, bytes per row] (a ReaderTensor's `.data`; 1-D is one row).
    tensor_type: its `gguf.GGMLQuantizationType`.

  Returns:
    Blocks with q [rows, in], scale and offset [rows, in / B].

  Raises:
    InexactError: the type cannot be held exactly.
    keys.ConvertError: the bytes are not whole blocks of the type.
  """
  decode, b = _decoder(tensor_type)
  name = getattr(tensor_type, "name", tensor_type)
  bs, ts = _sizes(name)
  raw = np.ascontiguousarray(data).view(np.uint8)
  raw = raw.reshape(1, -1) if raw.ndim == 1 else raw.reshape(-1, raw.shape[-1])
  rows, width = raw.shape
  if width % ts:
    raise keys.ConvertError(f"{name}: {width} bytes per row is not a whole number of "
                            f"{ts}-byte blocks")
  k = width // ts * bs
  q, scale, offset = decode(raw.reshape(-1, ts))  # [rows * blocks, bs], [.., bs / B]
  return Blocks(q=np.ascontiguousarray(q.reshape(rows, k), dtype=np.int8),
                scale=scale.reshape(rows, k // b).astype(np.float32, copy=False),
                offset=None if offset is None else offset.reshape(rows, k // b).astype(np.float32,
                                                                                       copy=False),
                block=b)


def from_tensor(tensor) -> Blocks:
  """A GGUF reader tensor as exact int8 blocks, converted a chunk of rows at a time.

  Args:
    tensor: a `gguf.ReaderTensor` ([out, in] weight: `.data` [out, in bytes]).

  Returns:
    Blocks with q [out, in].

  Raises:
    InexactError: its type cannot be held exactly.
  """
  data = tensor.data
  if data.ndim < 2:
    return split(data, tensor.tensor_type)
  parts = [split(data[r:r + _ROWS_PER_CHUNK], tensor.tensor_type)
           for r in range(0, data.shape[0], _ROWS_PER_CHUNK)]
  offsets = None if parts[0].offset is None else np.concatenate([p.offset for p in parts])
  return Blocks(q=np.concatenate([p.q for p in parts]),
                scale=np.concatenate([p.scale for p in parts]), offset=offsets,
                block=parts[0].block)


def check(path) -> dict:
  """Checks every quantized tensor of a GGUF file: its int8 blocks widen to gguf-py's values.

  Args:
    path: a .gguf file.

  Returns:
    {"types": {type name: {"tensors", "weights", "gguf_bytes", "compact_bytes",
    "exact"}}, "mismatches": [tensor names whose widened values differ],
    "kept": {type name: tensor count} for types held as they are (float or
    without an exact form)}.
  """
  from convert import gguf_file  # pylint: disable=import-outside-toplevel
  reader = gguf_file.open_reader(path)
  types = collections.defaultdict(lambda: collections.Counter(tensors=0))
  kept, mismatches = collections.Counter(), []
  for t in reader.tensors:
    name = t.tensor_type.name
    if name not in _DECODERS:
      kept[name] += 1
      continue
    data = t.data
    data2 = data.reshape(1, -1) if data.ndim < 2 else data
    same = True
    compact = 0
    for r in range(0, data2.shape[0], _ROWS_PER_CHUNK):
      chunk = data2[r:r + _ROWS_PER_CHUNK]
      blocks = split(chunk, t.tensor_type)
      compact += blocks.nbytes
      ours = widen(blocks.q, blocks.scale, blocks.offset, blocks.block)
      theirs = _gguf().quants.dequantize(chunk, t.tensor_type).reshape(ours.shape)
      same &= bool(np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)))
    if not same:
      mismatches.append(t.name)
    entry = types[name]
    entry["tensors"] += 1
    entry["weights"] += int(np.prod([int(d) for d in t.shape]))
    entry["gguf_bytes"] += int(t.n_bytes)
    entry["compact_bytes"] += compact
    entry["exact"] += int(same)
  return {"types": {k: dict(v) for k, v in types.items()}, "mismatches": mismatches,
          "kept": dict(kept)}


def _print_check(path, result: dict) -> None:
  print(f"{path}")
  print(f"{'type':8s} {'tensors':>7s} {'exact':>6s} {'weights':>13s} {'GGUF B/w':>9s} "
        f"{'compact B/w':>11s} {'compact MB':>10s}")
  total = collections.Counter()
  for name, e in sorted(result["types"].items()):
    print(f"{name:8s} {e['tensors']:7d} {e['exact']:6d} {e['weights']:13d} "
          f"{e['gguf_bytes'] / e['weights']:9.4f} {e['compact_bytes'] / e['weights']:11.4f} "
          f"{e['compact_bytes'] / 1e6:10.1f}")
    total.update(e)
  if total["weights"]:
    print(f"{'all':8s} {total['tensors']:7d} {total['exact']:6d} {total['weights']:13d} "
          f"{total['gguf_bytes'] / total['weights']:9.4f} "
          f"{total['compact_bytes'] / total['weights']:11.4f} {total['compact_bytes'] / 1e6:10.1f}"
          f"  (float32: {4 * total['weights'] / 1e6:.1f} MB)")
  if result["kept"]:
    print("kept as they are: " + ", ".join(f"{k} x{v}" for k, v in sorted(result["kept"].items())))
  print("bit for bit: " + ("every quantized tensor" if not result["mismatches"]
                           else "MISMATCH in " + ", ".join(result["mismatches"])))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m convert.gguf_blocks",
                               description="Checks a GGUF file's int8-block form bit for bit.")
  ap.add_argument("--check", required=True, metavar="FILE.gguf",
                  help="widen every quantized tensor and compare with gguf.quants.dequantize")
  args = ap.parse_args(argv)
  try:
    result = check(args.check)
  except keys.ConvertError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  _print_check(args.check, result)
  return 1 if result["mismatches"] else 0


if __name__ == "__main__":
  sys.exit(main())
