"""Qwen2 as Flax NNX modules: what `jspec.model`'s functions build, merge and run.

`jspec.model` imports this module on first use, not at `import jspec`: a
process whose programs all come from the program store never builds a
module, and importing flax is a large share of jspec's own import
(docs/decisions.md, "Flax off the way to the first token").

Axis letters in shape comments and einsum strings are `jspec.model`'s.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from convert import config as config_lib
from jspec import cache as cache_lib
from jspec import cpu_attention
from jspec import greedy_head
from jspec import model
from jspec import sharding
from jspec import weights


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


def project(x: jax.Array, linears: list[Linear]) -> list[jax.Array]:
  """Each of `linears` applied to the same x, their matrices multiplied together where they can be.

  `weights.dot_many` puts matrices of one stored form in one kernel call;
  each output is the `Linear`'s own bit for bit. A subclass (`LowRankLinear`)
  adds its own terms, so it runs alone.

  Args:
    x: [..., I] activations.
    linears: `Linear`s of I inputs.

  Returns:
    [..., O_j] per `Linear`, in order.
  """
  if any(type(linear) is not Linear for linear in linears):
    return [linear(x) for linear in linears]
  ys = weights.dot_many(x, [linear.w.get_value() for linear in linears])
  return [y if linear.b is None else y + linear.b[...] for linear, y in zip(linears, ys)]


class RMSNorm(nnx.Module):
  """Root-mean-square norm, computed in float32 like the reference."""

  def __init__(self, scale: jax.Array, eps: float):
    self.scale = nnx.Param(scale)  # [D]
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
    x32 = x.astype(jnp.float32)
    mean = model.row_sum(x32 * x32) / x32.shape[-1]  # [..., 1]
    x32 = x32 * jax.lax.rsqrt(mean + self.eps)
    return self.scale[...] * x32.astype(x.dtype)


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
    q, new_k, new_v = project(x, [self.q, self.k, self.v])
    q = q.reshape(b, t, n, h)
    new_k = new_k.reshape(b, t, k, h)
    new_v = new_v.reshape(b, t, k, h)
    q = model.rope(q, positions, cfg.rope_theta)
    new_k = model.rope(new_k, positions, cfg.rope_theta)
    if placement is not None:  # each device keeps its own heads (its KV cache slice) end to end
      heads = lambda a: sharding.constrain(a, placement, sharding.DATA, None, sharding.MODEL, None)
      q, new_k, new_v = heads(q), heads(new_k), heads(new_v)
    if fused:
      out = cpu_attention.attend(q, new_k, new_v, k_buf, v_buf, layer, starts)  # [B, T, N, H]
      return self.o(out.reshape(b, t, n * h)), new_k, new_v
    sharded = placement is not None
    k_buf = sharding.constrain_cache(
        cache_lib.write_layer(k_buf, layer, new_k, starts, sharded=sharded), placement)
    v_buf = sharding.constrain_cache(
        cache_lib.write_layer(v_buf, layer, new_v, starts, sharded=sharded), placement)
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
    gate, up = project(x, [self.gate, self.up])  # [B, T, F]
    return self.down(jax.nn.silu(gate) * up)


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
    # [R] int32: ids of the request's prompts outside vocab_ids, scored from the
    # whole head's rows too (V where unused; `jspec.draft_vocab.with_prompt_ids`).
    self.vocab_extra = Derived(None)
    self.cfg = cfg

  def __call__(self, tokens, cache: cache_lib.KVCache, logits_at: Optional[jax.Array] = None, *,
               backend: model.Backend = model.Backend(), fresh: bool = False, greedy: bool = False,
               vocab_limit: Optional[int] = None,
               placement: Optional[sharding.Placement] = None, write: bool = True,
               head: bool = True):
    """Runs T new tokens per row after each row's cached prefix (see `forward`)."""
    t = tokens.shape[1]
    starts = cache.lengths
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    x = _residual(self.embed(tokens), placement)  # [B, T, D]
    chunks = None
    if scannable(self, backend):
      x, new_k, new_v = self._scan_layers(x, positions, cache.k, cache.v, starts, backend, fresh)
      k_buf, v_buf = cache.k, cache.v
      if write:
        k_buf = cache_lib.write_chunks(k_buf, new_k, starts)
        v_buf = cache_lib.write_chunks(v_buf, new_v, starts)
      else:
        chunks = (new_k, new_v)
    else:
      k_buf, v_buf = cache.k, cache.v
      for i, block in enumerate(self.layers):
        x, k_buf, v_buf = block(x, positions, k_buf, v_buf, starts, i, fresh=fresh,
                                placement=placement)
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)  # [B, T', D]
    logits = self.logits(x, backend=backend, greedy=greedy, vocab_limit=vocab_limit) if head else x
    cache = cache.replace(k=k_buf, v=v_buf, lengths=starts + t)
    if write:
      return logits, cache
    return logits, cache, chunks

  def logits(self, x, *, backend: model.Backend = model.Backend(), greedy: bool = False,
             vocab_limit: Optional[int] = None):
    """The final norm and the head: [B, T', D] hidden states -> [B, T', V] float32 logits.

    See `model.logits`; `__call__` ends with it unless told `head=False`.
    """
    x = self.norm(x)
    head = model.head_of(self)  # [D, V]
    bound = self.greedy_head.get_value()
    b, t_out, d = x.shape
    if self.vocab_head.get_value() is not None:
      return model.subset_logits(x, self.vocab_head.get_value(), self.vocab_ids.get_value(),
                                 self.cfg.vocab_size, head, self.vocab_extra.get_value())
    if greedy and bound is not None and greedy_head.applies(b * t_out, head, backend.kernels):
      return greedy_head.logits(x.reshape(b * t_out, d), head.p, bound,
                                vocab_limit).reshape(b, t_out, -1)
    return weights.dot(x, head, out_dtype=jnp.float32).astype(jnp.float32)

  def _scan_layers(self, x, positions, k_buf, v_buf, starts, backend: model.Backend, fresh: bool):
    """The decoder layers as one `lax.scan`: each forward compiles one layer, not L.

    The kernels' weights stay per layer and each step picks its layer's
    (`weights.pick`). The caches are only read in the loop: each step
    attends over its own layer's slots, in place with jspec's CPU attention
    kernel, else over a copy of its layer's slice with the new chunk
    written in. The loop returns every layer's chunk, for the caller to
    write into the caches once (carried through the loop and written each
    step, they made decode slower, as a copy of the caches per layer would).

    Args:
      x: [B, T, D] embedded tokens.
      positions: [B, T] int32.
      k_buf, v_buf: [L, B, S, K, H] caches.
      starts: [B] int32 first new slot per row.
      backend: the model's backend.
      fresh: every row's cache is empty (`Attention`).

    Returns:
      (x [B, T, D] after the last layer, new_k, new_v [L, B, T, K, H] every
      layer's keys and values of the chunk, not yet in the caches).
    """
    graph = nnx.graphdef(self.layers[0])
    states = [nnx.to_pure_dict(nnx.state(block)) for block in self.layers]  # no int keys inside
    t = x.shape[1]
    fused = (backend.fused_attention and t <= model.FUSED_MAX_T
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
    return x, new_k, new_v  # x [B, T, D]; new_k, new_v [L, B, T, K, H]


class LowRankLinear(Linear):
  """A `Linear` plus a low-rank update: y = x W (+ b) + alpha / R * (x A) B."""

  def __init__(self, base: Linear, a: jax.Array, b: jax.Array, scale: float):
    self.w = base.w
    self.b = base.b
    self.lora_a = a  # [I, R]
    self.lora_b = b  # [R, O]
    self.scale = scale

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., I] -> [..., O]
    low = jnp.einsum("...i,ir->...r", x, self.lora_a)
    return super().__call__(x) + self.scale * jnp.einsum("...r,ro->...o", low, self.lora_b)


def scannable(module: Qwen2, backend: model.Backend) -> bool:
  """Whether the layers can run as one loop: every layer matrix is one the kernels read in place.

  Any other matrix would have to be stacked and sliced in the loop, which
  copies it each step.
  """
  if not (backend.kernels and backend.scan_layers):
    return False
  first = nnx.to_pure_dict(nnx.state(module.layers[0]))
  matrices = [leaf for leaf in jax.tree.leaves(first, is_leaf=weights.is_leaf)
              if weights.is_leaf(leaf)]
  return all(isinstance(w, weights.KERNEL_LEAVES) for w in matrices)
