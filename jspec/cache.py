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


def write_layer(buf: jax.Array, layer: int, new: jax.Array, starts: jax.Array,
                sharded: bool = False) -> jax.Array:
  """Writes one layer's new keys (or values) at each row's own offset.

  Args:
    buf: [L, B, S, K, H] the whole cache buffer.
    layer: static layer index.
    new: [B, T, K, H] entries for T consecutive positions per row.
    starts: [B] int32 first slot to write in each row.
    sharded: the buffer is split over a mesh (see `write_chunks`).

  Returns:
    [L, B, S, K, H] the buffer with the entries written.
  """
  return write_chunks(buf, new[None], starts, first_layer=layer, sharded=sharded)


def write_chunks(buf: jax.Array, new: jax.Array, starts: jax.Array,
                 first_layer: int = 0, sharded: bool = False) -> jax.Array:
  """Writes consecutive layers' new keys (or values) at each row's own offset.

  Args:
    buf: [L, B, S, K, H] the whole cache buffer.
    new: [L', B, T, K, H] entries for T consecutive positions per row, for
      layers first_layer .. first_layer + L' - 1.
    starts: [B] int32 first slot to write in each row.
    first_layer: static index of new's first layer.
    sharded: the buffer is split over a mesh (rows over "data", heads over
      "model"): each row is updated on its own, which the partitioner keeps
      on the devices that hold the row, where it would gather the one
      scatter's windows across them.

  Returns:
    [L, B, S, K, H] the buffer with the entries written.
  """
  if sharded:
    def one_row(row_buf, row_new, start):  # [L, S, K, H], [L', T, K, H], []
      zero = jnp.zeros((), jnp.int32)
      return jax.lax.dynamic_update_slice(row_buf, row_new.astype(row_buf.dtype),
                                          (jnp.int32(first_layer), start, zero, zero))
    return jax.vmap(one_row, in_axes=(1, 1, 0), out_axes=1)(buf, new, starts)
  b = new.shape[1]
  # One scatter over the buffer as it lies: row r's window [L', T, K, H] goes
  # to (first_layer, r, starts[r], 0, 0). A vmapped per-row update would move
  # the rows' axis first, and XLA then transposes the whole cache into that
  # order and back around the write, every step.
  index = jnp.stack([jnp.full((b,), first_layer, jnp.int32), jnp.arange(b, dtype=jnp.int32),
                     starts.astype(jnp.int32)], axis=1)  # [B, 3]
  dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2, 3, 4),
                                         inserted_window_dims=(1,),
                                         scatter_dims_to_operand_dims=(0, 1, 2))
  updates = jnp.moveaxis(new, 1, 0).astype(buf.dtype)  # [B, L', T, K, H]
  # CLIP clamps a window that would run past the buffer back inside it, as
  # dynamic_update_slice does; the caches are sized so that none does.
  return jax.lax.scatter(buf, index, updates, dims, indices_are_sorted=True,
                         unique_indices=True, mode=jax.lax.GatherScatterMode.CLIP)


def branch_result(cache: KVCache, chunks: Optional[tuple[jax.Array, jax.Array]],
                  width: int):
  """What a `lax.switch` branch running a forward returns for the cache.

  A cache written inside the branches is copied into and out of the
  switch on every call, so a branch returns its forward's new keys and
  values (`model.forward(write=False)`) zero-padded to the widest branch's
  `width`, and `after_switch` writes them once. The padding lands in slots
  past every row's new length. Where the layers wrote the cache themselves
  (unrolled layers: `chunks` is None), the branch returns the cache.

  Args:
    cache: the cache the branch's forward returned.
    chunks: (new_k, new_v), each [L, B, T, K, H], or None.
    width: T' >= T, the widest branch's chunk.

  Returns:
    (new_k, new_v), each [L, B, T', K, H], or the cache.
  """
  if chunks is None:
    return cache
  return tuple(jnp.pad(c, [(0, 0), (0, 0), (0, width - c.shape[2]), (0, 0), (0, 0)])
               for c in chunks)


def after_switch(cache: KVCache, result, starts: jax.Array) -> KVCache:
  """The cache after a switch whose branches returned `branch_result`s.

  Args:
    cache: the cache as it went into the switch (its lengths are kept).
    result: what the chosen branch returned for the cache.
    starts: [B] int32 first slot of each row's chunk.

  Returns:
    The cache with the chunk written (or the branch's cache).
  """
  if isinstance(result, KVCache):
    return result
  new_k, new_v = result
  return cache.replace(k=write_chunks(cache.k, new_k, starts),
                       v=write_chunks(cache.v, new_v, starts))


def with_lengths(cache: KVCache, lengths: jax.Array) -> KVCache:
  """Rolls a cache back (or forward) to the given per-row lengths.

  Args:
    cache: the cache.
    lengths: [B] int32 new valid lengths; slots at or past them become invisible.

  Returns:
    The same buffers with the new lengths.
  """
  return cache.replace(lengths=lengths.astype(jnp.int32))
