"""Int8 weights for the draft: a cheaper proposer that costs no exactness.

The draft only proposes tokens; rejection sampling against the target keeps
the output distribution exactly the target's whatever q the draft used, as
long as q is the distribution the drafts were actually drawn from, which it
is (q comes from this same int8 forward). So the draft may be made cheaper
in ways the target may not.

XLA CPU runs an int8 x int8 -> int32 dot through a fast kernel for two or
more rows, reading a quarter of fp32's bytes (though at a lower rate: a
whole draft step takes about half its fp32 time), but falls back to a path
10-20x slower for a single row (README "Design measurements"). `matmul`
therefore pads one row to two. Weights are quantized per output channel,
activations per row, both symmetric (W8A8 with dynamic activation scales).

A quantized params tree has, in place of each dense `kernel`/`weight`:
  `qweight` [out, in] int8 and `scale` [out] float32,
and in place of `embed_tokens/embedding` (and an untied `lm_head`):
  `qembedding` [V, D] int8 and `scale` [V] float32,
so the tied output head is read as int8 too.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import jax
import jax.numpy as jnp

from jspec import cpu_kernels

class Table(NamedTuple):
  """An int8 [rows, cols] matrix with one float32 scale per row."""

  q: jax.Array  # [R, C] int8
  scale: jax.Array  # [R] float32

  @property
  def shape(self) -> tuple:
    return self.q.shape


class PackedTable(NamedTuple):
  """An int8 [rows, cols] matrix stored for jspec's int8 kernel (`cpu_kernels.pack_int8`)."""

  panels: jax.Array  # [R / 32, ceil(C / 4), 32, 4] int8
  sums: jax.Array  # [R] int32, each row's sum
  scale: jax.Array  # [R] float32

  def rows(self, ids: jax.Array, cols: int) -> jax.Array:
    """Rows `ids` of the int8 matrix, [..., cols] int8 (the token embedding's lookup)."""
    width = cpu_kernels.PANEL
    picked = self.panels[ids // width, :, ids % width, :]  # [..., C/4, 4]
    return picked.reshape(*ids.shape, -1)[..., :cols]


def quantize_rows(matrix) -> Table:
  """Symmetric int8 quantization with one scale per row.

  Runs as one compiled XLA loop per matrix shape, so no float temporaries
  of the matrix's size are made on the host (peak memory is what the bench
  holds against its 1.3x-of-parameters budget).

  Args:
    matrix: [R, C] float array (numpy or jax).

  Returns:
    `Table(q [R, C] int8, scale [R] float32)` with matrix ~= q * scale[:, None].
  """
  q, scale = _quantize_rows(jnp.asarray(matrix))
  return Table(q, scale)


@jax.jit
def _quantize_rows(m: jax.Array):  # [R, C] -> ([R, C] int8, [R] float32)
  m = m.astype(jnp.float32)
  amax = jnp.max(jnp.abs(m), axis=1)  # [R]
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(m / scale[:, None]), -127, 127).astype(jnp.int8)
  return q, scale


def matmul(x: jax.Array, table) -> jax.Array:
  """x @ table.T with x quantized per row: [..., C] x [R, C] -> [..., R] float32.

  Args:
    x: [..., C] float activations.
    table: the int8 weight, [R = out, C = in], per-row (per output) scales:
      a `Table`, or a `PackedTable` for jspec's int8 kernel.

  Returns:
    [..., R] float32.
  """
  lead, c = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, c).astype(jnp.float32)  # [M, C]
  m = rows.shape[0]
  packed = isinstance(table, PackedTable)
  if m == 1 and not packed:  # XLA CPU's int8 dot is 10-20x slower for one row than for two
    rows = jnp.concatenate([rows, rows], axis=0)
  amax = jnp.max(jnp.abs(rows), axis=1, keepdims=True)  # [M, 1]
  x_scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  xq = jnp.clip(jnp.round(rows / x_scale), -127, 127).astype(jnp.int8)
  if packed:
    acc = cpu_kernels.matmul_int8(xq, table.panels, table.sums)  # [M, R]
  else:
    acc = jax.lax.dot_general(xq, table.q, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32)  # [M, R]
  y = acc.astype(jnp.float32) * x_scale * table.scale[None, :]
  return y[:m].reshape(*lead, y.shape[-1])


def is_quantized(params: Dict[str, Any]) -> bool:
  """Whether a params tree holds int8 weights (see the module docstring)."""
  return "qembedding" in params["embed_tokens"] or "qpanels" in params["embed_tokens"]


def is_packed(params: Dict[str, Any]) -> bool:
  """Whether int8 params are stored for jspec's int8 kernel (`pack`)."""
  return "qpanels" in params["layers_0"]["mlp"]["up_proj"]


def pack(params: Dict[str, Any]) -> Dict[str, Any]:
  """Int8 params with every matrix the int8 kernel can take stored for it (`cpu_kernels.pack_int8`).

  `qweight` [out, in] becomes `qpanels` and `sums` (`scale` stays) where
  out is a multiple of 32; a tied `qembedding` the same way, which the
  token lookup then reads through `PackedTable.rows`. An untied head
  `qlm_head` becomes `qlm_head_panels` and `qlm_head_sums`, and its
  embedding stays as it is (only looked up). XLA's int8 dot took 19 ms of
  a 48 ms step of the real draft's shapes for that head (README "Design
  measurements").

  Args:
    params: int8 params as `quantize` returns them; its dicts are modified.

  Returns:
    `params` itself.
  """
  def walk(node: Dict[str, Any]) -> None:
    for key in list(node):
      value = node[key]
      if isinstance(value, dict):
        walk(value)
      elif key in ("qweight", "qembedding") and value.shape[0] % cpu_kernels.PANEL == 0:
        del node[key]
        node["qpanels"], node["sums"] = cpu_kernels.pack_int8(value)

  if "qlm_head" in params:  # untied: the embedding is only looked up
    walk({k: v for k, v in params.items() if k != "embed_tokens"})
    if params["qlm_head"].shape[0] % cpu_kernels.PANEL == 0:
      params["qlm_head_panels"], params["qlm_head_sums"] = cpu_kernels.pack_int8(
          params.pop("qlm_head"))
  else:
    walk(params)
  return params


def quantize(params: Dict[str, Any]) -> Dict[str, Any]:
  """An int8 copy of a model's params; the input is left as it was.

  Every 2-D dense weight and the embedding table are quantized per output
  row; biases and norm weights stay float32.

  Args:
    params: float params in any layout (`jspec.layout`).

  Returns:
    A new params tree in the quantized form.
  """
  def walk(node: Dict[str, Any], embed: bool = False) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in node.items():
      if isinstance(value, dict):
        out[key] = walk(value, embed=key == "embed_tokens")
      elif embed and key in ("embedding", "panels"):  # beside no other scale
        table = value if key == "embedding" else cpu_kernels.unpack_table(value)  # [V, D]
        out["qembedding"], out["scale"] = quantize_rows(table)
      elif key == "panels":
        out["qweight"], out["scale"] = quantize_rows(cpu_kernels.unpack(value).T)  # [out, in]
      elif key in ("kernel", "weight") and getattr(value, "ndim", 0) == 2:
        rows = jnp.asarray(value).T if key == "kernel" else value  # [out, in]
        out["qweight"], out["scale"] = quantize_rows(rows)
      elif key in ("lm_head", "lm_head_panels"):  # top level: names of their own
        table = value if key == "lm_head" else cpu_kernels.unpack_table(value)  # [V, D]
        out["qlm_head"], out["qlm_head_scale"] = quantize_rows(table)
      else:
        out[key] = value
    return out

  return walk(params)


def output_table(params: Dict[str, Any], tied: bool):
  """The int8 output head of quantized params: the embedding table if tied, else `qlm_head`.

  Args:
    params: int8 params (`quantize`, maybe `pack`ed).
    tied: whether the output head is the embedding table.

  Returns:
    A `Table`, or a `PackedTable` for a packed table.
  """
  embed = params["embed_tokens"]
  if not tied and "qlm_head_panels" in params:
    return PackedTable(params["qlm_head_panels"], params["qlm_head_sums"],
                       params["qlm_head_scale"])
  if tied and "qpanels" in embed:
    return PackedTable(embed["qpanels"], embed["sums"], embed["scale"])
  if tied:
    return Table(embed["qembedding"], embed["scale"])
  return Table(params["qlm_head"], params["qlm_head_scale"])
