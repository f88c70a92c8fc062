"""The greedy token of each row of logits (`cpu_argmax.cc`), on CPU.

    argmax(logits [..., V], limit) -> [...] int32

What `jnp.argmax` gives over the ids below `limit`: XLA's CPU argmax is a
(value, index) reduction that runs element by element, and over the real
vocabulary it took a few hundred microseconds a row, several times a round
(docs/decisions.md, "The greedy token by a kernel"). It is built into the
library of `jspec.cpu_kernels`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec import cpu_kernels

# Rows shorter than this keep XLA's argmax: the call costs more than it saves.
MIN_WIDTH = 4096


def usable(logits: jax.Array, kernels: bool = True) -> bool:
  """Whether `argmax` runs the kernel for these logits.

  Args:
    logits: [..., V] logits.
    kernels: the model's backend runs jspec's CPU kernels (`model.Backend`).

  Returns:
    True on CPU with the kernels on and built, float32 logits and V at
    least `MIN_WIDTH`.
  """
  return (kernels and logits.dtype == jnp.float32 and logits.shape[-1] >= MIN_WIDTH
          and jax.default_backend() == "cpu" and cpu_kernels.available())


def argmax(logits: jax.Array, limit: Optional[int] = None) -> jax.Array:
  """The first index of each row's largest logit among ids below `limit` (its first NaN if any).

  Args:
    logits: [..., V] float32.
    limit: static; ids at or past it are never chosen (None: V).

  Returns:
    [...] int32, as `jnp.argmax(jnp.where(ids < limit, logits, -inf), -1)`.

  Raises:
    ValueError: an empty row, or a limit below 1.
  """
  v = logits.shape[-1]
  if v < 1 or (limit is not None and limit < 1):
    raise ValueError(f"argmax: logits {logits.shape} and limit {limit}: expected V >= 1 and "
                     "limit >= 1")
  lead = logits.shape[:-1]
  rows = logits.reshape(-1, v)  # [M, V]
  out_type = jax.ShapeDtypeStruct((rows.shape[0],), jnp.int32)
  ids = jax.ffi.ffi_call(cpu_kernels.TARGET_ARGMAX, out_type)(
      rows, limit=np.int64(v if limit is None else min(limit, v)))
  return ids.reshape(lead)
