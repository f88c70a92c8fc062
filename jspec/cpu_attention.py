"""Decode attention read in place from the KV cache (`cpu_attention.cc`), on CPU.

    attend(q [B, T, N, H], k_new, v_new [B, T, K, H], k_buf, v_buf [L, B, S, K, H],
           layer [], starts [B]) -> [B, T, N, H]

What `jspec.modules.Attention` computes once the chunk is written into the
cache, with the cache only read: inside the loop over layers
(`modules.Qwen2._scan_layers`) XLA copied and transposed each layer's keys and
values out of the stacked cache for its dots, where this kernel reads each
row where it lies (docs/decisions.md, "Attention kernel"). It is built into the library of `jspec.cpu_kernels`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import cpu_kernels


def usable(q: jax.Array, k_buf: jax.Array, kernels: bool = True) -> bool:
  """Whether `attend` can run here for these operands.

  Args:
    q: [B, T, N, H] queries.
    k_buf: [L, B, S, K, H] key cache.
    kernels: the model's backend runs jspec's CPU kernels (`model.Backend`).

  Returns:
    True on CPU with the kernels on and built and float32 queries and cache.
  """
  return (kernels and q.dtype == jnp.float32 and k_buf.dtype == jnp.float32
          and jax.default_backend() == "cpu" and cpu_kernels.available())


def attend(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_buf: jax.Array, v_buf: jax.Array,
           layer: jax.Array, starts: jax.Array) -> jax.Array:
  """Grouped-query attention of a chunk over one layer's cached prefix and itself.

  Query t of row b (position starts[b] + t) sees cache slots [0, starts[b])
  of `layer` and the chunk's tokens [0, t] (causal); query head n reads kv
  head n // (N / K), as HF's repeat_kv.

  Args:
    q: [B, T, N, H] float32 queries (rotary applied).
    k_new: [B, T, K, H] float32 keys of the chunk (rotary applied).
    v_new: [B, T, K, H] float32 values of the chunk.
    k_buf: [L, B, S, K, H] float32 key cache of every layer (read only).
    v_buf: [L, B, S, K, H] float32 value cache.
    layer: [] int32 the layer to read (traced: one compiled loop body).
    starts: [B] int32 cached tokens per row (the chunk's first slot).

  Returns:
    [B, T, N, H] float32 attention outputs, before the output projection.

  Raises:
    ValueError: shapes that do not fit together (also checked in the kernel).
  """
  b, t, n, h = q.shape
  k = k_buf.shape[3]
  if (k_new.shape != (b, t, k, h) or v_new.shape != k_new.shape or v_buf.shape != k_buf.shape
      or k_buf.shape[1] != b or k_buf.shape[4] != h or n % k or starts.shape != (b,)):
    raise ValueError(f"attend: q {q.shape}, k_new {k_new.shape}, v_new {v_new.shape}, caches "
                     f"{k_buf.shape} and {v_buf.shape}, starts {starts.shape}: expected q "
                     "[B, T, N, H], k_new and v_new [B, T, K, H] with K dividing N, caches "
                     "[L, B, S, K, H] and starts [B]")
  out_type = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  return jax.ffi.ffi_call(cpu_kernels.TARGET_ATTEND, out_type)(
      q, k_new, v_new, starts.astype(jnp.int32), jnp.asarray(layer, jnp.int32), k_buf, v_buf)
