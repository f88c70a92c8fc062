"""Qwen2, run over an explicit params pytree and an explicit KV cache.

    forward(arch, params, tokens[B, T], cache) -> (logits[B, T, V], cache)

The Flax NNX modules (`jspec.modules`) define the params tree:
`init_params` is the state of a freshly built `Qwen2`, a checkpoint is
loaded into the same tree (`jspec.loading`), and `forward` merges the tree
back into the modules inside the traced program. This module imports them
(and flax) only when a function here first needs them: a process whose
programs all come from the program store never builds a module, and flax
is a large share of `import jspec` (docs/decisions.md, "Flax off the way
to the first token"). Matrices are typed leaves (`jspec.weights`), so one
module serves every storage format and never reads names to learn one.

Axis letters in shape comments and einsum strings:
  B batch, T new tokens, S cache slots, D model width, F MLP width,
  N query heads, K key/value heads, Q = N / K query heads per kv head,
  H head width, V vocabulary, L layers.

Layers stay separate params (`layers/0`, `layers/1`, ...), never stacked: a
loop over stacked weights slices (copies) every layer's weights each step
(docs/decisions.md, "Layer loop"). When every layer matrix is one the CPU
kernels read in place, the layers run as one `lax.scan` whose kernels pick
each layer's weights by index (`weights.pick`), so a forward compiles one
layer instead of L; otherwise they are a Python loop, unrolled.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from convert import config as config_lib
from convert import gguf_blocks
from jspec import cache as cache_lib
from jspec import sharding
from jspec import weights

Params = Any  # the pure-dict state of a `Qwen2` (`init_params`), matrices as weight leaves

# Up to this many new tokens per forward, attention in the layer loop runs on
# jspec's kernel; longer chunks (a prefill) keep XLA's batched dots
# (docs/decisions.md, "Attention kernel").
FUSED_MAX_T = 48


@dataclasses.dataclass(frozen=True)
class Backend:
  """How a model runs, fixed when it is prepared (`jspec.bundle.prepare`); part of program keys.

  Attributes:
    kernels: jspec's CPU kernels may run (CPU, and the kernels built).
    fused_attention: with kernels, the layer loop attends with
      `jspec.cpu_attention` over the caches in place.
    scan_layers: with kernel-stored layers, run them as one `lax.scan`
      rather than unrolled (compile time; same results).
    dtype: activation and KV cache dtype ("float32" for int8 weights).
  """

  kernels: bool = False
  fused_attention: bool = True
  scan_layers: bool = True
  dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class Arch:
  """Everything static about one model: its config, backend and placement (hashable).

  Attributes:
    cfg: the config.
    backend: how it runs.
    placement: where its arrays live on a mesh (`jspec.sharding`); None on one device.
  """

  cfg: config_lib.Qwen2Config
  backend: Backend = Backend()
  placement: Optional[sharding.Placement] = None


def row_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis by halving, the same float additions for a row whatever rows share the call.

  XLA's CPU reduction (`jnp.sum`, `jnp.mean`) sums a row in an order that
  depends on how many rows it reduces at once, so a one-row decode step and
  a several-row verify could norm the same row an ulp apart and flip a near
  tie. Elementwise adds of halves are per element, so each row is summed in
  one fixed pairwise order (no worse rounded than the sequential sum).

  Args:
    x: [..., D] float.

  Returns:
    [..., 1] the sums.
  """
  while x.shape[-1] > 1:
    n = x.shape[-1]
    half = n // 2
    y = x[..., :half] + x[..., half:2 * half]  # [..., D/2]
    if n % 2:  # the odd element joins the last pair's sum
      y = jnp.concatenate([y[..., :-1], y[..., -1:] + x[..., -1:]], axis=-1)
    x = y
  return x


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, half-split layout (HF `rotate_half`).

  Args:
    x: [B, T, N, H] queries or keys.
    positions: [B, T] int32 absolute position of every token.
    theta: base frequency.

  Returns:
    [B, T, N, H] rotated, in x's dtype.
  """
  half = x.shape[-1] // 2
  # Angles in float32: at positions in the thousands a bf16 angle is off by
  # whole radians.
  inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) / half))  # [H/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)  # [B, T, 1, H/2]
  sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def subset_logits(x: jax.Array, head: weights.Leaf, ids: jax.Array, vocab: int,
                  whole: Optional[weights.Leaf] = None,
                  extra: Optional[jax.Array] = None) -> jax.Array:
  """Logits over the whole vocabulary from a head that holds only some ids' rows; -inf elsewhere.

  A draft with a frequency-ranked vocabulary (`jspec.draft_vocab`) reads
  K rows of its head, not V. Putting its logits back at their ids, with
  -inf at every other id, makes q exactly zero outside the subset (a
  valid distribution, so acceptance keeps the output the target's) and
  lets every consumer keep indexing logits by token id. The request's own
  prompt ids outside the subset (`extra`) are scored from the whole head's
  rows, so that the draft can propose the prompt's rare identifiers.

  Args:
    x: [B, T, D] normed hidden states.
    head: the kept rows, a weight leaf of logical shape [D, K].
    ids: [K] int32 the ids of those rows.
    vocab: V.
    whole: the whole head [D, V] (needed with `extra`).
    extra: [R] int32 more ids, not in `ids` and distinct, or V (unused).

  Returns:
    [B, T, V] float32.
  """
  part = weights.dot(x, head, out_dtype=jnp.float32).astype(jnp.float32)  # [B, T, K]
  full = jnp.full((*part.shape[:-1], vocab), -jnp.inf, jnp.float32)  # [B, T, V]
  full = full.at[..., ids].set(part, unique_indices=True, indices_are_sorted=True)
  if extra is None:
    return full
  rows = weights.lookup(whole, jnp.minimum(extra, vocab - 1)).astype(jnp.float32)  # [R, D]
  more = jnp.einsum("btd,rd->btr", x.astype(jnp.float32), rows)  # [B, T, R]
  return full.at[..., extra].set(more, mode="drop")  # unused slots (V) are dropped


def _keys(tree: Any, key) -> Any:
  """A pure-dict state with every dict key passed through `key` (leaves untouched)."""
  if isinstance(tree, dict):
    return {key(k): _keys(v, key) for k, v in tree.items()}
  return tree


def _nnx():
  """(flax.nnx, jspec.modules), imported on the first call: see the module docstring."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jspec import modules  # pylint: disable=import-outside-toplevel
  return nnx, modules


def params_of(module: Any) -> Params:
  """A module's state as a params tree: a pure dict whose keys are all strings.

  `nnx.List` indexes layers by int, and `jax.export` (`jspec.program_store`)
  takes only string keys, so the tree names layer 3 "3", as checkpoints do.
  """
  nnx, _ = _nnx()
  return _keys(nnx.to_pure_dict(nnx.state(module)), str)


def merge(cfg: config_lib.Qwen2Config, params: Params) -> Any:
  """The `modules.Qwen2` holding `params` (the inverse of `params_of`)."""
  nnx, _ = _nnx()
  return nnx.merge(graphdef(cfg), _keys(params, lambda k: int(k) if k.isdigit() else k))


def head_of(module: Any) -> weights.Leaf:
  """The output head's weight leaf: the token table when the head is tied."""
  return (module.embed.table if module.head is None else module.head.w).get_value()


@functools.lru_cache(maxsize=None)
def graphdef(cfg: config_lib.Qwen2Config) -> Any:
  """The `nnx.GraphDef` of a Qwen2 with this config: what `forward` merges params into."""
  nnx, modules = _nnx()
  return nnx.graphdef(modules.Qwen2(cfg, rngs=None))


def abstract_params(cfg: config_lib.Qwen2Config, dtype=jnp.float32) -> Params:
  """The params tree of a Qwen2, as `jax.ShapeDtypeStruct`s (what a checkpoint must fill)."""
  _, modules = _nnx()
  return params_of(modules.Qwen2(cfg, rngs=None, dtype=dtype))


def path_name(path: tuple) -> str:
  """A params tree path as the `/`-joined name checkpoints use (`layers/3/attn/q/w`)."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def params_from_tensors(cfg: config_lib.Qwen2Config, tensors: dict[str, Any]) -> Params:
  """The params tree of a checkpoint's tensors, each checked against the module's own shape.

  Args:
    cfg: the config.
    tensors: jspec path -> array, matrices [I, O] and token tables [V, D]
      (`convert.load_checkpoint`), or a `convert.gguf_blocks.Blocks` ([out,
      in]) for a matrix kept as the checkpoint's int8 blocks.

  Returns:
    The params tree, matrices as the float leaves `init_params` makes.

  Raises:
    ValueError: a tensor missing, unexpected, or of another shape.
  """
  abstract = abstract_params(cfg)
  leaves, tree = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=weights.is_leaf)
  names = [path_name(path) for path, _ in leaves]
  extra = sorted(set(tensors) - set(names))
  missing = [n for n in names if n not in tensors]
  if extra or missing:
    raise ValueError(f"tensors do not match the model: missing {missing[:5]}, unexpected "
                     f"{extra[:5]}")
  out = []
  for name, (_, leaf) in zip(names, leaves):
    array = tensors[name]
    want = leaf.shape if weights.is_leaf(leaf) else tuple(leaf.shape)
    if isinstance(array, gguf_blocks.Blocks):  # a checkpoint's own int8 blocks, [out, in]
      if not weights.is_leaf(leaf):
        raise ValueError(f"tensor {name!r} is int8 blocks: the model expects a plain array")
      value = weights.blocks(array.q, array.scale, array.offset)
      if isinstance(leaf, weights.Table) and isinstance(value, weights.Dense):
        value = weights.Table(value.w.T)  # a table the block kernel cannot hold: read by rows
    elif isinstance(leaf, weights.Dense):
      value = weights.Dense(array)
    elif isinstance(leaf, weights.Table):
      value = weights.Table(array)
    else:
      value = array
    got = value.shape if weights.is_leaf(value) else tuple(array.shape)
    if tuple(got) != tuple(want):
      raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}: the model expects "
                       f"{tuple(want)} (as [in, out])")
    out.append(value)
  return jax.tree_util.tree_unflatten(tree, out)


def forward(arch: Arch, params: Params, tokens: jax.Array, cache: cache_lib.KVCache,
            logits_at: Optional[jax.Array] = None, *, fresh: bool = False, greedy: bool = False,
            vocab_limit: Optional[int] = None, write: bool = True, head: bool = True):
  """Pure functional forward pass: merges `params` into the modules and runs them.

  Args:
    arch: the model's config and backend (static).
    params: its params tree (`init_params`, or a prepared checkpoint).
    tokens: [B, T] int32 token ids (the caller checks they are in range).
    cache: KV cache to read and extend; row b's new tokens go at slots
      lengths[b] + [0, T).
    logits_at: optional [B, T'] positions within T to compute logits at
      (prefill needs one position per row; the head is V x D per position).
    fresh: static; the caller promises every row's cache length is 0 (a
      prefill), so attention reads only the new chunk. The result is the
      same as without it; with a non-empty cache it would be wrong.
    greedy: static; the caller uses only each row's argmax over ids below
      vocab_limit. Where the params carry a greedy head
      (`jspec.greedy_head`) and the call has few rows, logits are then exact
      only where they could be the argmax and -inf elsewhere: the same
      argmax from a fraction of the head's bytes.
    vocab_limit: static; with greedy, ids at or past it are never chosen.
    write: static; False leaves the chunk's keys and values out of the
      caches where the layers run as one loop, for the caller to write
      (`cache_lib.write_chunks`). A caller that picks one of several
      forwards with `lax.switch` then writes once, after the switch: a cache
      written inside a branch is copied into and out of it.
    head: static; False returns the last layer's hidden states at
      logits_at ([B, T', D], before the final norm) in place of logits, for
      `logits` to finish: a prefill reads the head once, after its last
      chunk, not once per chunk.

  Returns:
    ([B, T', V] float32 logits, cache with lengths advanced by T); with
    write=False, (logits, cache, chunks): chunks is (new_k, new_v), each
    [L, B, T, K, H], with the cache's buffers left as they were, or None
    where the layers wrote the buffers themselves (unrolled layers).
  """
  return merge(arch.cfg, params)(tokens, cache, logits_at, backend=arch.backend, fresh=fresh,
                                 greedy=greedy, vocab_limit=vocab_limit,
                                 placement=arch.placement, write=write, head=head)


def logits(arch: Arch, params: Params, x: jax.Array, *, greedy: bool = False,
           vocab_limit: Optional[int] = None) -> jax.Array:
  """The final norm and the head over hidden states from `forward(..., head=False)`.

  Args:
    arch: the model's config and backend (static).
    params: its params tree.
    x: [B, T', D] hidden states.
    greedy: static; as in `forward`.
    vocab_limit: static; as in `forward`.

  Returns:
    [B, T', V] float32 logits, the bits `forward` gives for the same rows.
  """
  return merge(arch.cfg, params).logits(x, backend=arch.backend, greedy=greedy,
                                        vocab_limit=vocab_limit)


def init_params(cfg: config_lib.Qwen2Config, key: jax.Array, dtype=jnp.float32,
                scale: float = 0.02) -> Params:
  """Random params of the right shapes, as plain `Dense` / `Table` leaves (tests, tools).

  Args:
    cfg: the config.
    key: PRNG key.
    dtype: param dtype.
    scale: standard deviation of every weight and bias (norm scales are
      1 + noise so that they are not all equal).

  Returns:
    The params tree.
  """
  nnx, modules = _nnx()
  return params_of(modules.Qwen2(cfg, rngs=nnx.Rngs(key), dtype=dtype, scale=scale))
