"""Typed weight leaves: how each matrix is stored, and the one multiply that dispatches on it.

A model's params are a pytree whose matrices are these leaves (norm scales
and biases stay plain arrays). Which leaf a matrix becomes is decided once,
when a model is prepared (`jspec.bundle.prepare`), from the checkpoint and
the backend; model code calls `dot` and `lookup` and never looks at names.
Adding a storage format means adding one leaf type here and its branch in
`dot` (and `lookup` if it can hold a token table).

Every leaf is a matrix W of logical shape [I, O] (inputs, outputs):
`dot(x, w)` is x @ W, and `lookup(w, ids)` is rows of W.T, which is how a
token table [V, D] (the embedding, and the head that is its transpose)
is read. Stored forms:

  Dense       [I, O] float: XLA's dot (GPUs, and CPUs without jspec's kernels)
  Table       [O, I] float: a token table read by rows (embedding, head)
  Panels      [O/32, I, 32] float: jspec's CPU kernel (`jspec.cpu_kernels`)
  Int8        [O, I] int8 and a scale per output: the int8 draft, XLA's dot
  Int8Panels  the same as the int8 kernel's panels, with row sums
  Blocks      a checkpoint's own int8 blocks (GGUF k-quants, exactly) as panels,
              with a float32 scale (and offset) per block of inputs, q in
              [0, 15] two to a byte; also the lossy int8 target's rows
              (`to_int8_blocks`) and the 4-bit draft's (`to_int4_blocks`)
  BF16Panels  bfloat16 kernel panels (a bfloat16 checkpoint, exactly)
  Int4Panels  the 4-bit draft for the int4 kernel: per output and block of 32
              inputs a float16 scale and offset and q in [0, 15], multiplied
              on int8 activations (`cpu_kernels.pack_int4`)

Axis letters in shape comments: I inputs, O outputs, V vocabulary, D width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jspec import cpu_kernels

PANEL = cpu_kernels.PANEL


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dense:
  """A float matrix stored [I, O], multiplied by XLA's dot."""

  w: jax.Array  # [I, O]

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.w.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Table:
  """A float matrix stored [O, I]: a token table (embedding or head), read by rows."""

  t: jax.Array  # [O, I]

  @property
  def shape(self) -> tuple[int, int]:
    return (self.t.shape[1], self.t.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Panels:
  """A float matrix stored as jspec's kernel panels: [O/32, I, 32], each panel contiguous."""

  p: Any  # [O/32, I, 32], or a `cpu_kernels.LayerPick` of such inside the layer loop

  @property
  def shape(self) -> tuple[int, int]:
    n, i, width = self.p.shape
    return (i, n * width)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8:
  """An int8 matrix stored [O, I] with one float32 scale per output (the int8 draft)."""

  q: jax.Array  # [O, I] int8
  scale: jax.Array  # [O] float32

  @property
  def shape(self) -> tuple[int, int]:
    return (self.q.shape[1], self.q.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Panels:
  """`Int8` stored for jspec's int8 kernel (`cpu_kernels.pack_int8`)."""

  panels: Any  # [O/32, ceil(I/4), 32, 4] int8 (or a `cpu_kernels.LayerPick`)
  sums: jax.Array  # [O] int32, each output's sum of q
  scale: jax.Array  # [O] float32
  inputs: int = dataclasses.field(default=0, metadata=dict(static=True))  # I (panels pad it to 4)

  @property
  def shape(self) -> tuple[int, int]:
    return (self.inputs, self.sums.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
  """A matrix as the checkpoint stores it: int8 values, a scale (and offset) per block.

  W[k, n] = scale[n, k // B] * q[n, k] + offset[n, k // B], each product and
  sum rounded in float32 as the checkpoint's own dequantizer does, so it
  holds a GGUF k-quant's numbers exactly (`convert.gguf_blocks`), in about
  a quarter of float32's bytes; laid out as the block kernel's panels.
  Where every q is in [0, 15] (4-bit k-quants) q is uint8 with two q to a
  byte (`cpu_kernels.pack_nibbles`): q's dtype says which. Where the scales
  are a k-quant's d * sc, they are stored so (`cpu_kernels.pack_factored`):
  the scale's dtype says which.
  """

  q: Any  # [O/32, I, 32] int8 or [O/32, I/2, 32] uint8 nibbles (or a `cpu_kernels.LayerPick`)
  scale: Any  # [O/32, I/B, 32] float32, or factored [O/32, (I/256)(4 + 256/B), 32] int8
  offset: Any = None  # as scale, of the same form, or None for symmetric types

  @property
  def shape(self) -> tuple[int, int]:
    n, _, width = self.q.shape
    return (cpu_kernels.block_inputs(self.q), n * width)

  @property
  def block(self) -> int:
    """B: inputs per scale."""
    return cpu_kernels.block_size(self.shape[0], self.scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BF16Panels:
  """A bfloat16 matrix as kernel panels, widened to float32 exactly when multiplied."""

  p: Any  # [O/32, I, 32] bfloat16 (or a `cpu_kernels.LayerPick`)

  @property
  def shape(self) -> tuple[int, int]:
    n, i, width = self.p.shape
    return (i, n * width)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Panels:
  """The 4-bit draft's matrix as the int4 kernel's panels (`cpu_kernels.pack_int4`).

  W[k, n] = scale[n, k // 32] * q[n, k] + offset[n, k // 32], scale and
  offset float16 and q in [0, 15]; multiplied, like `Int8Panels`, on
  activations quantized to int8 per row.
  """

  panels: Any  # [O/32, I/32, 640] uint8 (or a `cpu_kernels.LayerPick`)

  @property
  def shape(self) -> tuple[int, int]:
    p, j, _ = self.panels.shape
    return (j * cpu_kernels.INT4_BLOCK, p * PANEL)


@dataclasses.dataclass(frozen=True)
class LayerForms:
  """Inside the layer loop, one matrix whose layers are `Blocks` of different forms (`pick`).

  Each form's layers are a group; the loop's layer is group `form`'s
  `local`-th. Made only while tracing the loop, never stored.
  """

  groups: tuple  # per form: `Blocks` whose arrays are `cpu_kernels.LayerPick`s (index: local)
  form: jax.Array  # [] int32
  local: jax.Array  # [] int32

  @property
  def shape(self) -> tuple[int, int]:
    return self.groups[0].shape


Leaf = Union[Dense, Table, Panels, Int8, Int8Panels, Blocks, BF16Panels, Int4Panels]
LEAVES = (Dense, Table, Panels, Int8, Int8Panels, Blocks, BF16Panels, Int4Panels)
# Leaves the kernels read in place inside the layer loop.
KERNEL_LEAVES = (Panels, Int8Panels, Blocks, BF16Panels, Int4Panels)


def is_leaf(x: Any) -> bool:
  """Whether `x` is a weight leaf (for `jax.tree.map(..., is_leaf=is_leaf)`)."""
  return isinstance(x, LEAVES)


def dot(x: jax.Array, w: Leaf, out_dtype=None) -> jax.Array:
  """x @ W for any stored form of W.

  Args:
    x: [..., I] activations.
    w: a weight leaf of logical shape [I, O].
    out_dtype: accumulate and return in this dtype (the head's float32
      logits of a bfloat16 model); None: x's dtype.

  Returns:
    [..., O]: float32 for the int8 forms (whose activations are
    quantized per row, W8A8) and the float32 kernel, else `out_dtype` or x's dtype.
  """
  if isinstance(w, Dense):
    return jnp.einsum("...i,io->...o", x, w.w, preferred_element_type=out_dtype)
  if isinstance(w, Table):
    return jnp.einsum("...i,oi->...o", x, w.t, preferred_element_type=out_dtype)
  if isinstance(w, Panels):
    return cpu_kernels.matmul(x, w.p)
  if isinstance(w, (Int8, Int8Panels)):
    return _dot_int8(x, w)
  if isinstance(w, Int4Panels):
    return _dot_int4(x, w)
  if isinstance(w, Blocks):
    return cpu_kernels.matmul_blocks(x.astype(jnp.float32), w.q, w.scale, w.offset)
  if isinstance(w, BF16Panels):
    return cpu_kernels.matmul_bf16(x.astype(jnp.float32), w.p)
  if isinstance(w, LayerForms):
    return cpu_kernels.matmul_blocks_forms(x.astype(jnp.float32),
                                           [(g.q, g.scale, g.offset) for g in w.groups],
                                           w.form, w.local)
  raise TypeError(f"not a weight leaf: {type(w).__name__}")


def dot_many(x: jax.Array, ws: Sequence[Leaf]) -> list[jax.Array]:
  """x @ W for several matrices over the same x: `dot` of each, kernel leaves of one form in one call.

  Projections that read the same activations (attention's q, k and v, the
  MLP's gate and up) pay one kernel call's start and uneven finish between
  them instead of one each (`cpu_kernels.matmul_blocks_many`, `Blocks` of
  one `blocks_form`; `cpu_kernels.matmul_int8_many`, `Int8Panels` of one
  width, with x quantized once); each output is `dot`'s bit for bit.

  Args:
    x: [..., I] activations.
    ws: weight leaves of logical shape [I, O_j].

  Returns:
    [..., O_j] per leaf, in order, as `dot` returns it.
  """
  out: list = [None] * len(ws)
  groups: dict = {}
  for j, w in enumerate(ws):
    if isinstance(w, Blocks):
      groups.setdefault(("blocks",) + cpu_kernels.blocks_form(w.q, w.scale, w.offset), []).append(j)
    elif isinstance(w, Int8Panels):
      groups.setdefault(("int8", w.inputs), []).append(j)
    elif isinstance(w, Int4Panels):
      groups.setdefault(("int4",), []).append(j)
    else:
      out[j] = dot(x, w)
  for (kind, *_), members in groups.items():
    if kind == "blocks":
      ys = cpu_kernels.matmul_blocks_many(
          x.astype(jnp.float32), [(ws[j].q, ws[j].scale, ws[j].offset) for j in members])
    elif kind == "int4":  # x quantized once for all of them, as `_dot_int4` does for each
      lead = x.shape[:-1]
      xq, x_scale = _quantize_rows_of(x.reshape(-1, x.shape[-1]).astype(jnp.float32))
      accs = cpu_kernels.matmul_int4_many(xq, [ws[j].panels for j in members])
      ys = [(acc * x_scale).reshape(*lead, -1) for acc in accs]
    else:  # x quantized once for all of them, as `_dot_int8` quantizes it for each
      lead = x.shape[:-1]
      xq, x_scale = _quantize_rows_of(x.reshape(-1, x.shape[-1]).astype(jnp.float32))
      accs = cpu_kernels.matmul_int8_many(xq, [(ws[j].panels, ws[j].sums) for j in members])
      ys = [(acc.astype(jnp.float32) * x_scale * ws[j].scale[None, :]).reshape(*lead, -1)
            for j, acc in zip(members, accs)]
    for j, y in zip(members, ys):
      out[j] = y
  return out


def lookup(w: Leaf, ids: jax.Array) -> jax.Array:
  """Rows of W.T: the token embedding of `ids` when W is a token table's head.

  Args:
    w: a weight leaf of logical shape [D, V] (`Table`, `Panels`, `Int8`, `Int8Panels`).
    ids: [...] int32 token ids.

  Returns:
    [..., D]: in W's dtype, float32 for the int8 forms.
  """
  if isinstance(w, Table):
    return w.t[ids]
  if isinstance(w, Panels):
    return w.p[ids // PANEL, :, ids % PANEL]
  if isinstance(w, Int8):
    return w.q[ids].astype(jnp.float32) * w.scale[ids][..., None]
  if isinstance(w, Int8Panels):
    picked = w.panels[ids // PANEL, :, ids % PANEL, :]  # [..., I/4, 4]
    q = picked.reshape(*ids.shape, -1)[..., :w.inputs]
    return q.astype(jnp.float32) * w.scale[ids][..., None]
  if isinstance(w, Blocks):
    p, c = ids // PANEL, ids % PANEL
    q = w.q[p, :, c]  # [..., I] int8, or [..., I/2] nibbles
    if cpu_kernels.is_nibbles(w.q):
      q = jnp.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)  # [..., I]
    q = q.astype(jnp.float32)
    scale = cpu_kernels.scale_columns(w.scale, w.shape[0], p, c)  # [..., I/B]
    blocked = q.reshape(*q.shape[:-1], scale.shape[-1], -1) * scale[..., None]  # [..., I/B, B]
    if w.offset is not None:  # rounded after the product, as the checkpoint's dequantizer
      blocked = blocked + cpu_kernels.scale_columns(w.offset, w.shape[0], p, c)[..., None]
    return blocked.reshape(q.shape)
  if isinstance(w, BF16Panels):
    return w.p[ids // PANEL, :, ids % PANEL].astype(jnp.float32)
  if isinstance(w, Int4Panels):
    picked = w.panels[(ids // PANEL).reshape(-1)]  # [R, I/32, 640]: each id's whole panel
    q, scale, offset = cpu_kernels.unpack_int4(picked)  # [R * 32, I], [R * 32, I/32] x 2
    rows = jnp.arange(picked.shape[0]) * PANEL + (ids % PANEL).reshape(-1)  # [R]
    q, scale, offset = q[rows].astype(jnp.float32), scale[rows], offset[rows]
    size = cpu_kernels.INT4_BLOCK
    blocked = q.reshape(q.shape[0], -1, size) * scale[..., None] + offset[..., None]
    return blocked.reshape(*ids.shape, -1)
  raise TypeError(f"a {type(w).__name__} weight cannot be read by rows")


def _quantize_rows_of(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[M, I] float32 -> (xq [M, I] int8, x_scale [M, 1]): symmetric, per row."""
  amax = jnp.max(jnp.abs(rows), axis=1, keepdims=True)  # [M, 1]
  x_scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  return jnp.clip(jnp.round(rows / x_scale), -127, 127).astype(jnp.int8), x_scale


def _dot_int4(x: jax.Array, w: Int4Panels) -> jax.Array:
  """x @ W for the 4-bit draft's W with x quantized per row (symmetric): [..., I] -> [..., O] float32."""
  lead, i = x.shape[:-1], x.shape[-1]
  xq, x_scale = _quantize_rows_of(x.reshape(-1, i).astype(jnp.float32))  # [M, I], [M, 1]
  y = cpu_kernels.matmul_int4(xq, w.panels) * x_scale
  return y.reshape(*lead, y.shape[-1])


def _dot_int8(x: jax.Array, w: Union[Int8, Int8Panels]) -> jax.Array:
  """x @ W for int8 W with x quantized per row (symmetric): [..., I] -> [..., O] float32."""
  lead, i = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, i).astype(jnp.float32)  # [M, I]
  m = rows.shape[0]
  packed = isinstance(w, Int8Panels)
  if m == 1 and not packed:  # XLA CPU's int8 dot runs 10-20x slower for one row than for two
    rows = jnp.concatenate([rows, rows], axis=0)
  xq, x_scale = _quantize_rows_of(rows)
  if packed:
    acc = cpu_kernels.matmul_int8(xq, w.panels, w.sums)  # [M, O] int32
  else:
    acc = jax.lax.dot_general(xq, w.q, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32)  # [M, O]
  y = acc.astype(jnp.float32) * x_scale * w.scale[None, :]
  return y[:m].reshape(*lead, y.shape[-1])


# Conversions between stored forms. Each is one jitted copy, so converting a
# model needs room for one more matrix, not for a chain of temporaries.


def dense(matrix) -> Dense:
  """A float [I, O] matrix as a `Dense` leaf on the default device."""
  return Dense(jnp.asarray(matrix))


def table(matrix) -> Table:
  """A float [V, D] token table as a `Table` leaf on the default device."""
  return Table(jnp.asarray(matrix))


def packable(w: Leaf) -> bool:
  """Whether the kernels can store W in panels: its outputs are a multiple of 32."""
  return w.shape[1] % PANEL == 0


def to_panels(w: Leaf) -> Leaf:
  """W stored for jspec's float kernel (`Panels`), or unchanged when it cannot be.

  Args:
    w: a float `Dense`, `Table` or `Panels` leaf.

  Returns:
    A `Panels` leaf when W's outputs are a multiple of 32, else `w`.
  """
  if isinstance(w, Panels) or not packable(w):
    return w
  if isinstance(w, Dense):
    return Panels(jax.block_until_ready(cpu_kernels.pack(w.w)))
  if isinstance(w, Table):
    return Panels(jax.block_until_ready(cpu_kernels.pack_table(w.t)))
  raise TypeError(f"cannot store a {type(w).__name__} weight in float panels")


def blocks(q, scale, offset=None, nibbles: Optional[bool] = None,
           factored: Optional[bool] = None) -> Leaf:
  """A checkpoint's int8 blocks ([out, in], `convert.gguf_blocks.Blocks`' arrays) as a leaf.

  Args:
    q: [O, I] int8.
    scale: [O, I/B] float32.
    offset: [O, I/B] float32, or None.
    nibbles: q two to a byte: None where every q is in [0, 15], or always
      (True) or never (False); see `cpu_kernels.pack_blocks`.
    factored: scales as d * sc (`cpu_kernels.factor_scales`): None where
      they have exact factors, or always (True) or never (False).

  Returns:
    A `Blocks` leaf, or (outputs not a multiple of 32) the `Dense` matrix
    the blocks define, widened exactly.
  """
  if q.shape[0] % PANEL:
    b = q.shape[1] // scale.shape[1]
    w = q.astype(np.float32).reshape(q.shape[0], -1, b) * scale[:, :, None]
    if offset is not None:
      w = w + offset[:, :, None]
    return dense(w.reshape(q.shape).T)
  return Blocks(*jax.block_until_ready(cpu_kernels.pack_blocks(q, scale, offset, nibbles,
                                                                factored)))


def to_bf16_panels(w: Leaf) -> Leaf:
  """A bfloat16 `Dense` / `Table` stored as kernel panels, or unchanged when it cannot be."""
  if not isinstance(w, (Dense, Table)) or not packable(w):
    return w
  packed = to_panels(w)
  return BF16Panels(packed.p) if isinstance(packed, Panels) else w


def to_int8(w: Leaf, panels: bool = False) -> Leaf:
  """W quantized per output (symmetric int8), optionally stored for the int8 kernel.

  The draft only proposes; rejection sampling keeps the output the
  target's for any q, so the draft may be quantized freely (a target's
  int8 form, an explicit opt-in, is `to_int8_blocks`).

  Args:
    w: a float leaf.
    panels: store it as `Int8Panels` when its outputs are a multiple of 32.

  Returns:
    An `Int8` or `Int8Panels` leaf.
  """
  q, scale = _int8_rows(w)
  if panels and q.shape[0] % PANEL == 0:
    packed, sums = cpu_kernels.pack_int8(q)
    return Int8Panels(jax.block_until_ready(packed), sums, scale, inputs=q.shape[1])
  return Int8(q, scale)


INT8_BLOCK = 32  # inputs per repeated scale in `to_int8_blocks` (the block kernel's largest B)


def to_int8_blocks(w: Leaf) -> Leaf:
  """W quantized per output as `to_int8` does, stored as symmetric blocks for float activations.

  The lossy int8 target (`jspec.Settings(target_int8=True)`) is stored so
  because the block kernel widens the int8 weights in registers and keeps
  the activations float32, so each row's product is the same whichever rows
  share the call (a verify row equals a one-row step), which quantizing
  every activation row to int8 (`to_int8`) does not give.

  Args:
    w: a float leaf (`Dense`, `Table`, or a packed form, widened first).

  Returns:
    A `Blocks` leaf with no offsets, each row's scale repeated for every
    block of `INT8_BLOCK` inputs (one block over the whole row when the
    inputs are not a multiple of it); where the outputs are not a multiple
    of 32, the same values widened into a `Dense` (a `Table` for a table).
  """
  q, scale = _int8_rows(w)
  i = q.shape[1]
  size = INT8_BLOCK if i % INT8_BLOCK == 0 else i
  # q is signed: a byte each (an all-zero matrix would fit nibbles; kept alike).
  out = blocks(q, jnp.repeat(scale[:, None], i // size, axis=1), nibbles=False)  # scale [O, I/B]
  if isinstance(w, Table) and isinstance(out, Dense):
    return Table(out.w.T)  # a table the block kernel cannot hold: read by rows
  return out


INT4_MAX = 15  # q of `to_int4_blocks` is in [0, INT4_MAX]


def to_int4_blocks(w: Leaf) -> Leaf:
  """W quantized to 4 bits with a scale and an offset per output and block, for float activations.

  The 4-bit draft (`jspec.Settings(draft_int4=True)`) is stored so because
  a draft only proposes (rejection sampling keeps the output the target's
  for any q), so its weights may lose precision for fewer bytes per step,
  and the block kernel reads 4-bit q two to a byte.

  Args:
    w: a float leaf (`Dense`, `Table`, or a packed form, widened first).

  Returns:
    A `Blocks` leaf whose every block of `INT8_BLOCK` inputs of an output
    (one block over the whole row when the inputs are not a multiple of
    it) holds W as scale * q + offset, with offset the block's minimum,
    scale its range / 15 (1 where the range is 0) and q = round((W -
    offset) / scale) in [0, 15], two to a byte where the inputs are even;
    where the outputs are not a multiple of 32, the same values widened
    into a `Dense` (a `Table` for a table).
  """
  rows = _float_rows(w)  # [O, I]
  i = rows.shape[1]
  size = INT8_BLOCK if i % INT8_BLOCK == 0 else i
  q, scale, offset = jax.block_until_ready(_quantize_int4(rows, size))
  out = blocks(q, scale, offset)  # [O, I] int8, [O, I/B], [O, I/B]
  if isinstance(w, Table) and isinstance(out, Dense):
    return Table(out.w.T)  # a table the block kernel cannot hold: read by rows
  return out


def _float_rows(w: Leaf) -> jax.Array:
  """W.T of a float leaf (`Dense`, `Table`, or a packed form, widened): [O, I], for the 4-bit forms."""
  if isinstance(w, Dense):
    return w.w.T
  if isinstance(w, Table):
    return w.t
  if isinstance(w, (Panels, Blocks, BF16Panels)):
    return matrix(w).T
  raise TypeError(f"cannot quantize a {type(w).__name__} weight")


@functools.partial(jax.jit, static_argnums=1)
def _quantize_int4(m: jax.Array, size: int):  # [O, I] -> ([O, I] int8, [O, I/B], [O, I/B])
  o, i = m.shape
  blocked = m.astype(jnp.float32).reshape(o, i // size, size)
  low, high = jnp.min(blocked, axis=2), jnp.max(blocked, axis=2)  # [O, I/B]
  scale = jnp.where(high > low, (high - low) / INT4_MAX, 1.0)
  q = jnp.clip(jnp.round((blocked - low[..., None]) / scale[..., None]), 0, INT4_MAX)
  return q.reshape(o, i).astype(jnp.int8), scale, low


def to_int4_panels(w: Leaf) -> Leaf:
  """W in 4 bits for the int4 kernel: `to_int4_blocks`' numbers, scale and offset in float16.

  The 4-bit draft where the int4 kernel runs (`cpu_kernels.int4_available`):
  its q are multiplied on int8 activations by `vpdpbusd`, four to an
  instruction, where the block kernel widens each to float32; and its
  scales and offsets take 0.125 bytes a weight instead of 0.25.

  Args:
    w: a float leaf (`Dense`, `Table`, or a packed form, widened first).

  Returns:
    An `Int4Panels` leaf: per output and block of 32 inputs, offset the
    block's minimum and scale its range / 15 (1 where the range is 0), both
    rounded to float16, and q = round((W - offset) / scale) in [0, 15];
    where the outputs or inputs are not multiples of 32, `to_int4_blocks`'
    leaf instead.
  """
  i, o = w.shape
  if i % cpu_kernels.INT4_BLOCK or o % PANEL:
    return to_int4_blocks(w)
  rows = _float_rows(w)  # [O, I]
  q, scale, offset = _quantize_int4_half(rows)
  return Int4Panels(jax.block_until_ready(cpu_kernels.pack_int4(q, scale, offset)))


@jax.jit
def _quantize_int4_half(m: jax.Array):  # [O, I] -> ([O, I] uint8, [O, I/32], [O, I/32])
  o, i = m.shape
  blocked = m.astype(jnp.float32).reshape(o, i // cpu_kernels.INT4_BLOCK, -1)
  low, high = jnp.min(blocked, axis=2), jnp.max(blocked, axis=2)  # [O, I/B]
  # q is chosen against the float16 scale and offset the panels hold.
  offset = low.astype(jnp.float16).astype(jnp.float32)
  scale = jnp.where(high > low, (high - low) / INT4_MAX, 1.0).astype(jnp.float16).astype(jnp.float32)
  scale = jnp.where(scale > 0, scale, 1.0)  # a range below float16's smallest
  q = jnp.clip(jnp.round((blocked - offset[..., None]) / scale[..., None]), 0, INT4_MAX)
  return q.reshape(o, i).astype(jnp.uint8), scale, offset


# Bytes of float32 input quantized per call of `_quantize_rows`: a large
# matrix (a 150k-token table or head) goes through in slices of its outputs,
# so loading holds one slice's copy and temporaries, not the whole matrix's.
QUANTIZE_SLICE_BYTES = 32 << 20


def _int8_rows(w: Leaf, slice_bytes: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
  """W.T quantized per row (`_quantize_rows`): ([O, I] int8, [O] float32), computed.

  Each row's numbers depend on that row alone, so quantizing the outputs in
  slices gives the same bits as one call.

  Args:
    w: a float leaf.
    slice_bytes: float32 input bytes per call (default `QUANTIZE_SLICE_BYTES`).

  Returns:
    (q [O, I] int8, scale [O] float32).
  """
  if isinstance(w, Dense):
    rows = lambda a, b: w.w[:, a:b].T  # [b - a, I]; a view of a mapped matrix
  elif isinstance(w, Table):
    rows = lambda a, b: w.t[a:b]
  elif isinstance(w, (Panels, Blocks, BF16Panels)):
    return jax.block_until_ready(_quantize_rows(matrix(w).T))
  else:
    raise TypeError(f"cannot quantize a {type(w).__name__} weight")
  i, o = w.shape
  step = max(1, (slice_bytes or QUANTIZE_SLICE_BYTES) // (4 * i))
  if step >= o:
    return jax.block_until_ready(_quantize_rows(rows(0, o)))
  q = np.empty((o, i), np.int8)
  scale = np.empty((o,), np.float32)
  for a in range(0, o, step):
    b = min(a + step, o)
    q_part, scale_part = _quantize_rows(rows(a, b))
    q[a:b], scale[a:b] = np.asarray(q_part), np.asarray(scale_part)
  return jnp.asarray(q), jnp.asarray(scale)


@jax.jit
def _quantize_rows(m: jax.Array):  # [O, I] -> ([O, I] int8, [O] float32)
  m = m.astype(jnp.float32)
  amax = jnp.max(jnp.abs(m), axis=1)  # [O]
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(m / scale[:, None]), -127, 127).astype(jnp.int8)
  return q, scale


def to_float(w: Leaf) -> Union[Dense, Table]:
  """A leaf's values in plain float form for XLA's dot: panels and blocks widened exactly."""
  if isinstance(w, (Panels, Blocks, BF16Panels)):
    return Dense(jax.block_until_ready(matrix(w)))
  return w


def matrix(w: Leaf) -> jax.Array:
  """W as a plain [I, O] array (a copy for packed forms; int8 forms scaled back to float).

  For tests and tools: the decode path never materialises this.
  """
  if isinstance(w, Dense):
    return w.w
  if isinstance(w, Table):
    return w.t.T
  if isinstance(w, Panels):
    return cpu_kernels.unpack(w.p)
  if isinstance(w, Int8):
    return (w.q.astype(jnp.float32) * w.scale[:, None]).T
  if isinstance(w, Int8Panels):
    q = cpu_kernels.unpack_int8(w.panels, w.inputs)
    return (q.astype(jnp.float32) * w.scale[:, None]).T
  if isinstance(w, Blocks):
    return cpu_kernels.unpack(cpu_kernels.widen_blocks(w.q, w.scale, w.offset))
  if isinstance(w, BF16Panels):
    return cpu_kernels.unpack(w.p)
  if isinstance(w, Int4Panels):
    q, scale, offset = cpu_kernels.unpack_int4(w.panels)  # [O, I], [O, I/32] x 2
    blocked = q.astype(jnp.float32).reshape(q.shape[0], -1, cpu_kernels.INT4_BLOCK)
    return (blocked * scale[..., None] + offset[..., None]).reshape(q.shape).T
  raise TypeError(f"not a weight leaf: {type(w).__name__}")


def uniform(leaves: Sequence[Leaf]) -> list[Leaf]:
  """Stored forms for one matrix of every layer that the layer loop reads in place.

  The layer loop reads all layers' buffers with one kernel call. A GGUF may
  store a matrix in different k-quants from layer to layer (Q4_K_M keeps
  some layers' `ffn_down` and `attn_v` in Q6_K): `Blocks` of one logical
  shape stay each in its own form, which `pick` groups by form, so each
  layer reads the file's own bytes (4-bit q two to a byte, Q6_K without
  offsets). Any other mix is widened to float32 panels.

  Args:
    leaves: the same matrix of each layer.

  Returns:
    The leaves, in order: as they are where they are of one type and shape,
    or all `Blocks` of one logical shape; else float32 panels.
  """
  leaves = list(leaves)
  form = lambda w: (type(w), tuple((a.shape, jnp.dtype(a.dtype)) for a in jax.tree.leaves(w)))
  if len({form(w) for w in leaves}) == 1:
    return leaves
  if all(isinstance(w, Blocks) for w in leaves) and len({w.shape for w in leaves}) == 1:
    return leaves
  return [to_panels(to_float(w)) for w in leaves]


def _block_form(w: Blocks) -> tuple:
  """The arrays' shapes and dtypes: layers alike in these share one `LayerPick`."""
  return tuple((a.shape, jnp.dtype(a.dtype)) if a is not None else None
               for a in (w.q, w.scale, w.offset))


def pick(layers: list, index: jax.Array) -> Any:
  """Layer `index` of per-layer params, the kernels' weights read where they lie.

  Inside a loop over layers, slicing a stacked [L, ...] weight copies it
  every step; the kernels instead take every layer's buffer and the index
  (`cpu_kernels.LayerPick`). Small arrays (norm scales, biases, int8
  scales) are stacked and indexed: a few KB a layer.

  Args:
    layers: L params trees of one structure, whose matrices are `KERNEL_LEAVES`.
    index: [] int32 layer.

  Returns:
    One params tree of that structure for layer `index`.
  """
  def one(*leaves):
    first = leaves[0]
    if isinstance(first, Panels):
      return Panels(cpu_kernels.LayerPick(tuple(w.p for w in leaves), index))
    if isinstance(first, Int8Panels):
      return Int8Panels(cpu_kernels.LayerPick(tuple(w.panels for w in leaves), index),
                        jnp.stack([w.sums for w in leaves])[index],
                        jnp.stack([w.scale for w in leaves])[index], inputs=first.inputs)
    if isinstance(first, Blocks):
      forms = list(dict.fromkeys(_block_form(w) for w in leaves))  # in order of first use
      group_of = [forms.index(_block_form(w)) for w in leaves]
      local_of = [group_of[:i].count(g) for i, g in enumerate(group_of)]
      local = jnp.asarray(local_of, jnp.int32)[index] if len(forms) > 1 else index

      def group(members: list) -> Blocks:
        each = lambda field: cpu_kernels.LayerPick(tuple(getattr(w, field) for w in members), local)
        return Blocks(each("q"), each("scale"), None if members[0].offset is None else each("offset"))

      if len(forms) == 1:
        return group(list(leaves))
      groups = tuple(group([w for w, h in zip(leaves, group_of) if h == g])
                     for g in range(len(forms)))
      return LayerForms(groups, jnp.asarray(group_of, jnp.int32)[index], local)
    if isinstance(first, BF16Panels):
      return BF16Panels(cpu_kernels.LayerPick(tuple(w.p for w in leaves), index))
    if isinstance(first, Int4Panels):
      return Int4Panels(cpu_kernels.LayerPick(tuple(w.panels for w in leaves), index))
    if first is None:
      return None
    return jnp.stack(leaves)[index]

  return jax.tree.map(one, *layers, is_leaf=lambda x: is_leaf(x) or x is None)


def compute_dtype(w: Leaf) -> jnp.dtype:
  """The activation dtype a model whose head is `w` computes in: its float dtype, float32 for int8."""
  if isinstance(w, Dense):
    return jnp.dtype(w.w.dtype)
  if isinstance(w, Table):
    return jnp.dtype(w.t.dtype)
  if isinstance(w, Panels):
    return jnp.dtype(w.p.dtype)
  return jnp.dtype(jnp.float32)  # int8 forms, blocks and bfloat16 panels widen to float32


def nbytes(tree: Any) -> int:
  """Bytes of every array in a params tree (what reading all of it once costs)."""
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))
