"""A fixed-size KV cache whose rollback is a change of lengths.

Every row of the batch owns `slots` positions per layer. A forward over T new
tokens writes their keys and values at slots [lengths[b], lengths[b] + T) of
row b and attention only ever reads slots at or before the query's own
position, so whatever lies past a row's length is invisible. Rolling back a
rejected draft is therefore just `lengths = accepted`: the stale slots are
masked now and overwritten by the next write at the same offset.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from convert import config as config_lib
from jspec import sharding


@chex.dataclass(frozen=True, mappable_dataclass=False)
class KVCache:
  """Keys and values of every layer, for every row.

  Attributes:
    k: [L, B, S, K, H] keys (after RoPE).
    v: [L, B, S, K, H] values.
    lengths: [B] int32, valid slots per row (= position of the next token).
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @property
  def slots(self) -> int:
    """S, the fixed capacity of every row."""
    return self.k.shape[2]

  @property
  def batch(self) -> int:
    """B, the number of rows."""
    return self.k.shape[1]


def init(cfg: config_lib.Qwen2Config, batch: int, slots: int,
         dtype: jnp.dtype = jnp.float32,
         placement: Optional[sharding.Placement] = None) -> KVCache:
  """Makes an empty cache.

  Args:
    cfg: the model the cache belongs to.
    batch: rows B.
    slots: capacity S per row; size it max_len + gamma_max + 1 so that a
      verify chunk written at the end of the longest row never falls off.
    dtype: storage dtype of keys and values (the model's compute dtype).
    placement: on a mesh, rows split over "data" and key/value heads over
      "model" (the model's own heads); None: one device.

  Returns:
    A cache with every length 0.
  """
  shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
  k = sharding.constrain_cache(jnp.zeros(shape, dtype), placement)
  v = sharding.constrain_cache(jnp.zeros(shape, dtype), placement)
  lengths = sharding.constrain(jnp.zeros((batch,), jnp.int32), placement, sharding.DATA)
  return KVCache(k=k, v=v, lengths=lengths)


def write_layer(buf: jax.Array, layer: int, new: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes one layer's new keys (or values) at each row's own offset.

  Args:
    buf: [L, B, S, K, H] the whole cache buffer.
    layer: static layer index.
    new: [B, T, K, H] entries for T consecutive positions per row.
    starts: [B] int32 first slot to write in each row.

  Returns:
    [L, B, S, K, H] the buffer with the entries written.
  """
  return write_chunks(buf, new[None], starts, first_layer=layer)


def write_chunks(buf: jax.Array, new: jax.Array, starts: jax.Array,
                 first_layer: int = 0) -> jax.Array:
  """Writes consecutive layers' new keys (or values) at each row's own offset.

  Args:
    buf: [L, B, S, K, H] the whole cache buffer.
    new: [L', B, T, K, H] entries for T consecutive positions per row, for
      layers first_layer .. first_layer + L' - 1.
    starts: [B] int32 first slot to write in each row.
    first_layer: static index of new's first layer.

  Returns:
    [L, B, S, K, H] the buffer with the entries written.
  """
  def one_row(row_buf, row_new, start):  # [L, S, K, H], [L', T, K, H], []
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(row_buf, row_new.astype(row_buf.dtype),
                                        (jnp.int32(first_layer), start, zero, zero))
  return jax.vmap(one_row, in_axes=(1, 1, 0), out_axes=1)(buf, new, starts)


def with_lengths(cache: KVCache, lengths: jax.Array) -> KVCache:
  """Rolls a cache back (or forward) to the given per-row lengths.

  Args:
    cache: the cache.
    lengths: [B] int32 new valid lengths; slots at or past them become invisible.

  Returns:
    The same buffers with the new lengths.
  """
  return cache.replace(lengths=lengths.astype(jnp.int32))
