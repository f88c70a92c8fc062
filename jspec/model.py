"""Qwen2 as Flax NNX modules, run over an explicit params pytree and an explicit KV cache.

    forward(arch, params, tokens[B, T], cache) -> (logits[B, T, V], cache)

The modules define the params tree: `init_params` is `nnx.split` of a
freshly built `Qwen2`, a checkpoint is loaded into the same tree
(`jspec.loading`), and `forward` merges the tree back into the modules inside
the traced program. Matrices are typed leaves (`jspec.weights`), so one
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
from flax import nnx

from convert import config as config_lib
from convert import gguf_blocks
from jspec import cache as cache_lib
from jspec import cpu_attention
from jspec import greedy_head
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


class Derived(nnx.Variable):
  """Arrays made from the params at load, not trained (the greedy head's int8 copy)."""


class Linear(nnx.Module):
  """y = x W (+ b), for W any stored form (`jspec.weights`)."""

  def __init__(self, w: weights.Leaf, bias: Optional[jax.Array] = None):
    self.w = nnx.Param(w)  # logical [I, O]
    self.b = nnx.Param(bias) if bias is not None else None  # [O]

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., I] -> [..., O]
    y = weights.dot(x, self.w.get_value())
    if self.b is not None:
      y = y + self.b[...]
    return y


class RMSNorm(nnx.Module):
  """Root-mean-square norm, computed in float32 like the reference."""

  def __init__(self, scale: jax.Array, eps: float):
    self.scale = nnx.Param(scale)  # [D]
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
    x32 = x.astype(jnp.float32)
    mean = row_sum(x32 * x32) / x32.shape[-1]  # [..., 1]
    x32 = x32 * jax.lax.rsqrt(mean + self.eps)
    return self.scale[...] * x32.astype(x.dtype)


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


class RandomInit:
  """Random weights for `Qwen2`'s constructor: N(0, scale), norm scales 1 + N(0, scale).

  Without `rngs` every array is a `jax.ShapeDtypeStruct`: the module's
  structure and shapes with nothing computed or traced (tracing the random
  init under `nnx.eval_shape` cost seconds a load).
  """

  def __init__(self, rngs: Optional[nnx.Rngs], dtype, scale: float):
    self.rngs, self.dtype, self.scale = rngs, dtype, scale

  def array(self, *shape: int) -> jax.Array:
    if self.rngs is None:
      return jax.ShapeDtypeStruct(shape, jnp.dtype(self.dtype))
    return (self.scale * jax.random.normal(self.rngs.params(), shape, jnp.float32)).astype(self.dtype)

  def dense(self, i: int, o: int) -> weights.Dense:
    return weights.Dense(self.array(i, o))

  def table(self, v: int, d: int) -> weights.Table:
    return weights.Table(self.array(v, d))

  def norm(self, d: int) -> jax.Array:
    if self.rngs is None:
      return self.array(d)
    return (1.0 + self.scale * jax.random.normal(self.rngs.params(), (d,))).astype(self.dtype)


class Attention(nnx.Module):
  """Grouped-query attention over the cache, with q/k/v biases and no o bias."""

  def __init__(self, cfg: config_lib.Qwen2Config, init: RandomInit):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q = Linear(init.dense(d, n * h), init.array(n * h))
    self.k = Linear(init.dense(d, k * h), init.array(k * h))
    self.v = Linear(init.dense(d, k * h), init.array(k * h))
    self.o = Linear(init.dense(n * h, d))
    self.cfg = cfg

  def __call__(self, x, positions, k_buf, v_buf, layer, starts, *, fused: bool = False,
               fresh: bool = False, placement: Optional[sharding.Placement] = None):
    """Attends T new tokens to the cached prefix and to each other.

    With `fused`, the caches are only read, by jspec's CPU attention kernel
    (`jspec.cpu_attention`), and the chunk's keys and values are returned
    for the caller to write. With `fresh` (a prefill: every row's cache is
    empty) the chunk attends only to itself, not to every slot of the cache.

    Args:
      x: [B, T, D] normed hidden states.
      positions: [B, T] int32 positions (= slots) of the new tokens.
      k_buf: [L, B, S, K, H] key cache of all layers.
      v_buf: [L, B, S, K, H] value cache of all layers.
      layer: index of this layer in the cache: static, or with `fused` a
        [] int32 array.
      starts: [B] int32 slot of the first new token per row.
      fused: attend with the kernel (see above).
      fresh: every row's cache is empty (see above).
      placement: on a mesh, heads split over "model" and rows over "data".

    Returns:
      ([B, T, D] output, k_buf, v_buf) with this chunk's keys and values
      written; with `fused` ([B, T, D] output, new_k, new_v [B, T, K, H]).
    """
    cfg = self.cfg
    b, t, _ = x.shape
    n, k, q_per_kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.queries_per_kv, cfg.head_dim
    q = self.q(x).reshape(b, t, n, h)
    new_k = self.k(x).reshape(b, t, k, h)
    new_v = self.v(x).reshape(b, t, k, h)
    q = rope(q, positions, cfg.rope_theta)
    new_k = rope(new_k, positions, cfg.rope_theta)
    if placement is not None:  # each device keeps its own heads (its KV cache slice) end to end
      heads = lambda a: sharding.constrain(a, placement, sharding.DATA, None, sharding.MODEL, None)
      q, new_k, new_v = heads(q), heads(new_k), heads(new_v)
    if fused:
      out = cpu_attention.attend(q, new_k, new_v, k_buf, v_buf, layer, starts)  # [B, T, N, H]
      return self.o(out.reshape(b, t, n * h)), new_k, new_v
    k_buf = sharding.constrain_cache(cache_lib.write_layer(k_buf, layer, new_k, starts), placement)
    v_buf = sharding.constrain_cache(cache_lib.write_layer(v_buf, layer, new_v, starts), placement)
    if fresh:
      # Slots 0..T-1 are the chunk, and past them nothing is visible: a
      # prefill would otherwise score every slot of the buffer for
      # masked-out zeros.
      keys, values = new_k, new_v  # [B, T, K, H]
    else:
      keys, values = k_buf[layer], v_buf[layer]  # [B, S, K, H]

    q = q.reshape(b, t, k, q_per_kv, h)  # query head n = k * Q + q, as HF repeat_kv
    scores = jnp.einsum("BTKQH,BSKH->BKQTS", q, keys,
                        preferred_element_type=jnp.float32) * (h ** -0.5)
    # A slot is visible iff it holds a position at or before the query's: this
    # is the causal mask inside the chunk and hides everything past a row's
    # length (rolled-back drafts, padding, never-written slots) at once.
    slots = jnp.arange(keys.shape[1], dtype=jnp.int32)
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("BKQTS,BSKH->BTKQH", probs, values).reshape(b, t, n * h)
    return self.o(out), k_buf, v_buf


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: config_lib.Qwen2Config, init: RandomInit):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate = Linear(init.dense(d, f))
    self.up = Linear(init.dense(d, f))
    self.down = Linear(init.dense(f, d))

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))  # hidden [B, T, F]


class DecoderBlock(nnx.Module):
  """Pre-norm attention and MLP with residuals."""

  def __init__(self, cfg: config_lib.Qwen2Config, init: RandomInit):
    self.attn_norm = RMSNorm(init.norm(cfg.hidden_size), cfg.rms_norm_eps)
    self.attn = Attention(cfg, init)
    self.mlp_norm = RMSNorm(init.norm(cfg.hidden_size), cfg.rms_norm_eps)
    self.mlp = MLP(cfg, init)

  def __call__(self, x, positions, k_buf, v_buf, starts, layer, *, fused: bool = False,
               fresh: bool = False, placement: Optional[sharding.Placement] = None):
    """x [B, T, D] -> (x, k_buf, v_buf), or with `fused` (x, new_k, new_v); see `Attention`."""
    out, k_buf, v_buf = self.attn(self.attn_norm(x), positions, k_buf, v_buf, layer, starts,
                                  fused=fused, fresh=fresh, placement=placement)
    x = _residual(x + out, placement)
    x = _residual(x + self.mlp(self.mlp_norm(x)), placement)
    return x, k_buf, v_buf


def _residual(x: jax.Array, placement: Optional[sharding.Placement]) -> jax.Array:
  """[B, T, D] the residual stream: on a mesh, rows split over "data", whole on every model device."""
  return sharding.constrain(x, placement, sharding.DATA, None, None)


class Embedding(nnx.Module):
  """The token table [V, D]: looked up by the embedding, multiplied by the tied head."""

  def __init__(self, table: weights.Leaf):
    self.table = nnx.Param(table)  # logical [D, V]: lookup gives rows of [V, D]

  def __call__(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    return weights.lookup(self.table.get_value(), tokens)


class Qwen2(nnx.Module):
  """The whole decoder: embeddings, L blocks, final norm, output head."""

  def __init__(self, cfg: config_lib.Qwen2Config, *, rngs: Optional[nnx.Rngs],
               dtype=jnp.float32, scale: float = 0.02):
    """Builds the model with random weights (`init_params`; a checkpoint replaces them).

    Args:
      cfg: the config.
      rngs: random streams for the weights; None: every weight a
        `jax.ShapeDtypeStruct` (the structure alone, `graphdef`).
      dtype: weight dtype.
      scale: standard deviation of every weight and bias (norm scales are
        1 + noise so that they are not all equal).
    """
    init = RandomInit(rngs, dtype, scale)
    self.embed = Embedding(init.table(cfg.vocab_size, cfg.hidden_size))
    self.layers = nnx.List([DecoderBlock(cfg, init) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(init.norm(cfg.hidden_size), cfg.rms_norm_eps)
    self.head = None if cfg.tie_word_embeddings else Linear(init.table(cfg.vocab_size,
                                                                       cfg.hidden_size))
    self.greedy_head = Derived(None)  # a `greedy_head.GreedyHead` of the head, when prepared
    # A draft's head cut to a frequent subset of the vocabulary (`jspec.draft_vocab`):
    self.vocab_ids = Derived(None)  # [K] int32 ascending ids it keeps
    self.vocab_head = Derived(None)  # a weight leaf [D, K]: the head's rows of those ids
    self.cfg = cfg

  def __call__(self, tokens, cache: cache_lib.KVCache, logits_at: Optional[jax.Array] = None, *,
               backend: Backend = Backend(), fresh: bool = False, greedy: bool = False,
               vocab_limit: Optional[int] = None,
               placement: Optional[sharding.Placement] = None):
    """Runs T new tokens per row after each row's cached prefix (see `forward`)."""
    t = tokens.shape[1]
    starts = cache.lengths
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    x = _residual(self.embed(tokens), placement)  # [B, T, D]
    if _scannable(self, backend):
      x, k_buf, v_buf = self._scan_layers(x, positions, cache.k, cache.v, starts, backend, fresh)
    else:
      k_buf, v_buf = cache.k, cache.v
      for i, block in enumerate(self.layers):
        x, k_buf, v_buf = block(x, positions, k_buf, v_buf, starts, i, fresh=fresh,
                                placement=placement)
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)  # [B, T', D]
    x = self.norm(x)
    head = head_of(self)  # [D, V]
    bound = self.greedy_head.get_value()
    b, t_out, d = x.shape
    if self.vocab_head.get_value() is not None:
      logits = subset_logits(x, self.vocab_head.get_value(), self.vocab_ids.get_value(),
                             self.cfg.vocab_size)
    elif greedy and bound is not None and greedy_head.applies(b * t_out, head, backend.kernels):
      logits = greedy_head.logits(x.reshape(b * t_out, d), head.p, bound,
                                  vocab_limit).reshape(b, t_out, -1)
    else:
      logits = weights.dot(x, head, out_dtype=jnp.float32).astype(jnp.float32)
    return logits, cache.replace(k=k_buf, v=v_buf, lengths=starts + t)

  def _scan_layers(self, x, positions, k_buf, v_buf, starts, backend: Backend, fresh: bool):
    """The decoder layers as one `lax.scan`: each forward compiles one layer, not L.

    The kernels' weights stay per layer and each step picks its layer's
    (`weights.pick`). The caches are only read in the loop: each step
    attends over its own layer's slots, in place with jspec's CPU attention
    kernel, else over a copy of its layer's slice with the new chunk
    written in; the chunks of every layer go into the caches once, after
    the loop (carried through the loop and written each step, they made
    decode slower, as a copy of the caches per layer would).

    Args:
      x: [B, T, D] embedded tokens.
      positions: [B, T] int32.
      k_buf, v_buf: [L, B, S, K, H] caches.
      starts: [B] int32 first new slot per row.
      backend: the model's backend.
      fresh: every row's cache is empty (`Attention`).

    Returns:
      (x [B, T, D] after the last layer, k_buf, v_buf with the chunk written).
    """
    graph = nnx.graphdef(self.layers[0])
    states = [nnx.to_pure_dict(nnx.state(block)) for block in self.layers]  # no int keys inside
    t = x.shape[1]
    fused = (backend.fused_attention and t <= FUSED_MAX_T
             and cpu_attention.usable(x, k_buf, backend.kernels))

    def chunk(buf):  # [1, B, S, K, H] -> [B, T, K, H] the slots each row just wrote
      return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, t, axis=0))(buf[0],
                                                                                      starts)

    def body(x, i):
      block = nnx.merge(graph, weights.pick(states, i))
      if fused:  # the attention kernel reads layer i's slots where they lie
        x, new_k, new_v = block(x, positions, k_buf, v_buf, starts, i, fused=True)
        return x, (new_k, new_v)
      k_layer = jax.lax.dynamic_slice_in_dim(k_buf, i, 1, axis=0)  # [1, B, S, K, H]
      v_layer = jax.lax.dynamic_slice_in_dim(v_buf, i, 1, axis=0)
      x, k_layer, v_layer = block(x, positions, k_layer, v_layer, starts, 0, fresh=fresh)
      return x, (chunk(k_layer), chunk(v_layer))

    x, (new_k, new_v) = jax.lax.scan(body, x, jnp.arange(len(states), dtype=jnp.int32))
    # new_k, new_v: [L, B, T, K, H]
    return x, cache_lib.write_chunks(k_buf, new_k, starts), cache_lib.write_chunks(v_buf, new_v,
                                                                                   starts)


def subset_logits(x: jax.Array, head: weights.Leaf, ids: jax.Array, vocab: int) -> jax.Array:
  """Logits over the whole vocabulary from a head that holds only some ids' rows; -inf elsewhere.

  A draft with a frequency-ranked vocabulary (`jspec.draft_vocab`) reads
  K rows of its head, not V. Putting its logits back at their ids, with
  -inf at every other id, makes q exactly zero outside the subset (a
  valid distribution, so acceptance keeps the output the target's) and
  lets every consumer keep indexing logits by token id.

  Args:
    x: [B, T, D] normed hidden states.
    head: the kept rows, a weight leaf of logical shape [D, K].
    ids: [K] int32 the ids of those rows.
    vocab: V.

  Returns:
    [B, T, V] float32.
  """
  part = weights.dot(x, head, out_dtype=jnp.float32).astype(jnp.float32)  # [B, T, K]
  full = jnp.full((*part.shape[:-1], vocab), -jnp.inf, jnp.float32)  # [B, T, V]
  return full.at[..., ids].set(part, unique_indices=True, indices_are_sorted=True)


def _scannable(model: Qwen2, backend: Backend) -> bool:
  """Whether the layers can run as one loop: every layer matrix is one the kernels read in place.

  Any other matrix would have to be stacked and sliced in the loop, which
  copies it each step.
  """
  if not (backend.kernels and backend.scan_layers):
    return False
  first = nnx.to_pure_dict(nnx.state(model.layers[0]))
  matrices = [leaf for leaf in jax.tree.leaves(first, is_leaf=weights.is_leaf)
              if weights.is_leaf(leaf)]
  return all(isinstance(w, weights.KERNEL_LEAVES) for w in matrices)


def _keys(tree: Any, key) -> Any:
  """A pure-dict state with every dict key passed through `key` (leaves untouched)."""
  if isinstance(tree, dict):
    return {key(k): _keys(v, key) for k, v in tree.items()}
  return tree


def params_of(module: nnx.Module) -> Params:
  """A module's state as a params tree: a pure dict whose keys are all strings.

  `nnx.List` indexes layers by int, and `jax.export` (`jspec.program_store`)
  takes only string keys, so the tree names layer 3 "3", as checkpoints do.
  """
  return _keys(nnx.to_pure_dict(nnx.state(module)), str)


def merge(cfg: config_lib.Qwen2Config, params: Params) -> "Qwen2":
  """The `Qwen2` modules holding `params` (the inverse of `params_of`)."""
  return nnx.merge(graphdef(cfg), _keys(params, lambda k: int(k) if k.isdigit() else k))


def head_of(module: Qwen2) -> weights.Leaf:
  """The output head's weight leaf: the token table when the head is tied."""
  return (module.embed.table if module.head is None else module.head.w).get_value()


@functools.lru_cache(maxsize=None)
def graphdef(cfg: config_lib.Qwen2Config) -> nnx.GraphDef:
  """The module structure of a Qwen2 with this config (what `forward` merges params into)."""
  return nnx.graphdef(Qwen2(cfg, rngs=None))


def abstract_params(cfg: config_lib.Qwen2Config, dtype=jnp.float32) -> Params:
  """The params tree of a Qwen2, as `jax.ShapeDtypeStruct`s (what a checkpoint must fill)."""
  return params_of(Qwen2(cfg, rngs=None, dtype=dtype))


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
            vocab_limit: Optional[int] = None):
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

  Returns:
    ([B, T', V] float32 logits, cache with lengths advanced by T).
  """
  return merge(arch.cfg, params)(tokens, cache, logits_at, backend=arch.backend, fresh=fresh, greedy=greedy,
                vocab_limit=vocab_limit, placement=arch.placement)


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
  return params_of(Qwen2(cfg, rngs=nnx.Rngs(key), dtype=dtype, scale=scale))
