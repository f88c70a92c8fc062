"""How a model's dense weights are stored: for one-row steps, for verifies, or for jspec's kernel.

XLA CPU multiplies one row by a weight matrix fastest when the matrix is
stored [out, in] (a matrix-vector product over contiguous rows), and a few
rows at once fastest when it is stored [in, out] (its small-matrix kernel
handles an [out, in] right-hand side badly). jspec's own CPU kernel
(`jspec.cpu_kernels`) beats both for every row count a decode uses, on
weights stored in panels. So a model is laid out for the work it does:

  "rows"    every dense weight as `weight` [out, in]: one row per step, as in
            target-only decoding of a single prompt, when the kernel is
            unavailable;
  "cols"    every dense weight as `kernel` [in, out] (flax's own layout, and
            what the converters write): verifies of several positions, and
            batches, when the kernel is unavailable, and other devices;
  "packed"  every dense weight whose out is a multiple of 32 as `panels`
            [out/32, in, 32] (`cpu_kernels.pack`), the rest as `kernel`:
            everything on CPU when the kernel is available.

The figures and commands are in README "Design measurements". `convert`
works in place one matrix at a time, so memory grows by at most two matrices
(the old one and its [in, out] form while the new one is made).
"""

from __future__ import annotations

from typing import Any, Dict

import jax
import jax.numpy as jnp

from jspec import cpu_kernels

LAYOUTS = ("rows", "cols", "packed")
_NAMES = ("weight", "kernel", "panels")  # what a dense matrix is called in each


def of(params: Dict[str, Any]) -> str:
  """The layout of a params pytree.

  Args:
    params: a model's params (`{"layers_0": {"mlp": {"up_proj": ...}}, ...}`).

  Returns:
    "rows", "cols" or "packed".
  """
  up = params["layers_0"]["mlp"]["up_proj"]
  if "panels" in up:
    return "packed"
  return "rows" if "weight" in up else "cols"


def convert(params: Dict[str, Any], layout: str) -> Dict[str, Any]:
  """Lays every dense weight of `params` out the given way round, in place.

  In place so that memory grows by one matrix, not by the model, and so that
  everything holding this params dict (a draft that is the target, a cached
  `DraftWeights`) sees one consistent layout.

  Args:
    params: a model's params in any layout; its dicts are modified.
    layout: "rows" ([out, in] `weight`), "cols" ([in, out] `kernel`) or
      "packed" (`panels` where the out size allows, else `kernel`).

  Returns:
    `params` itself, now in `layout`.

  Raises:
    ValueError: for an unknown layout.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}: expected one of {LAYOUTS}")
  if of(params) == layout:
    return params

  def walk(node: Dict[str, Any]) -> None:
    for key in list(node):
      value = node[key]
      if isinstance(value, dict):
        walk(value)
      elif key in _NAMES and getattr(value, "ndim", 0) >= 2:  # not a norm's [D] weight
        del node[key]
        name, node[name] = _stored(_as_kernel(key, value), layout)
        del value  # the last reference: the old matrix is freed here

  if "lm_head" in params or "lm_head_panels" in params:  # an untied head
    _table(params, "lm_head", "lm_head_panels", layout)
  else:  # tied: the embedding is the head
    _table(params["embed_tokens"], "embedding", "panels", layout)
  walk({k: v for k, v in params.items() if k != "embed_tokens"})
  return params


def _table(node: Dict[str, Any], plain: str, packed: str, layout: str) -> None:
  """Stores an output table [V, D] in panels for "packed", plainly otherwise, in place.

  The head multiplies by the table like any dense weight (in a verify it
  is a sixth of the target's bytes), and the token embedding reads its
  rows from the panels directly (`model.PackedEmbed`), so one copy serves
  both.
  """
  if layout == "packed" and plain in node and node[plain].shape[0] % cpu_kernels.PANEL == 0:
    value = node.pop(plain)
    node[packed] = jax.block_until_ready(cpu_kernels.pack_table(value))
    del value
  elif layout != "packed" and packed in node:
    value = node.pop(packed)
    node[plain] = jax.block_until_ready(cpu_kernels.unpack_table(value))
    del value


def _as_kernel(name: str, value: jax.Array) -> jax.Array:
  """A dense matrix stored under `name` as [in, out] (no copy when it already is)."""
  if name == "kernel":
    return value
  if name == "weight":
    return _transposed(value)
  return jax.block_until_ready(cpu_kernels.unpack(value))


def _stored(kernel: jax.Array, layout: str) -> tuple[str, jax.Array]:
  """(name, value) of an [in, out] matrix in `layout`."""
  if layout == "rows":
    return "weight", _transposed(kernel)
  if layout == "packed" and cpu_kernels.packable(kernel.shape):
    return "panels", jax.block_until_ready(cpu_kernels.pack(kernel))
  return "kernel", kernel


def _transposed(matrix: jax.Array) -> jax.Array:
  # A real copy in the new order (not a lazy view), on the matrix's device.
  return jax.block_until_ready(jnp.asarray(matrix).T.copy())
