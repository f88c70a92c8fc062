"""Which way round a model's dense weights are stored: for one-row steps or for verifies.

XLA CPU multiplies one row by a weight matrix fastest when the matrix is
stored [out, in] (a matrix-vector product over contiguous rows), and a few
rows at once fastest when it is stored [in, out] (its small-matrix kernel
handles an [out, in] right-hand side badly). So a model is laid out for the
work it does:

  "rows"  every dense weight as `weight` [out, in]: one row per step, as in
          target-only decoding of a single prompt;
  "cols"  every dense weight as `kernel` [in, out] (flax's own layout, and
          what the converters write): verifies of several positions, and
          batches.

The figures and commands are in README "Design measurements". `convert`
works in place one matrix at a time, so memory grows by at most one matrix.
"""

from __future__ import annotations

from typing import Any, Dict

import jax
import jax.numpy as jnp

LAYOUTS = ("rows", "cols")
_NAME = {"rows": "weight", "cols": "kernel"}


def of(params: Dict[str, Any]) -> str:
  """The layout of a params pytree.

  Args:
    params: a model's params (`{"layers_0": {"mlp": {"up_proj": ...}}, ...}`).

  Returns:
    "rows" or "cols".
  """
  up = params["layers_0"]["mlp"]["up_proj"]
  return "rows" if "weight" in up else "cols"


def convert(params: Dict[str, Any], layout: str) -> Dict[str, Any]:
  """Lays every dense weight of `params` out the given way round, in place.

  In place so that memory grows by one matrix, not by the model, and so that
  everything holding this params dict (a draft that is the target, a cached
  `DraftWeights`) sees one consistent layout.

  Args:
    params: a model's params in either layout; its dicts are modified.
    layout: "rows" ([out, in] `weight`) or "cols" ([in, out] `kernel`).

  Returns:
    `params` itself, now in `layout`.

  Raises:
    ValueError: for an unknown layout.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}: expected one of {LAYOUTS}")
  if of(params) == layout:
    return params
  old, new = _NAME["cols" if layout == "rows" else "rows"], _NAME[layout]

  def walk(node: Dict[str, Any]) -> None:
    for key in list(node):
      value = node[key]
      if isinstance(value, dict):
        walk(value)
      elif key == old and getattr(value, "ndim", 0) == 2:  # not a norm's [D] weight
        del node[key]
        node[new] = _transposed(value)
        del value  # the last reference: the old matrix is freed here

  walk(params)
  return params


def _transposed(matrix: jax.Array) -> jax.Array:
  # A real copy in the new order (not a lazy view), on the matrix's device.
  return jax.block_until_ready(jnp.asarray(matrix).T.copy())
