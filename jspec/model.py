"""Qwen2 as Flax modules over an explicit params pytree and an explicit KV cache.

    forward(params, cfg, tokens[B, T], cache) -> (logits[B, T, V], cache)

Axis names used in shape comments and einsum strings:
  B batch, T new tokens, S cache slots, D model width, F MLP width,
  N query heads, K key/value heads, G = N / K query heads per kv head,
  H head width, V vocabulary, L layers.

Params stay per layer (`layers_0`, `layers_1`, ...), never stacked: on XLA
CPU a `lax.scan` over stacked params dynamic-slices (copies) every layer's
weights on every step, which cost 2.7x in decode (9 GB/s against the 25 GB/s
memory roof; see README "Design measurements"). When every matrix is stored
for jspec's CPU kernels, the layers still run as one loop (`_scan_layers`),
the kernels picking each layer's weights by index where they lie, so a
forward compiles one layer instead of L; otherwise they are a Python loop,
unrolled in the XLA program.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec import cache as cache_lib
from jspec import config as config_lib
from jspec import cpu_attention
from jspec import cpu_kernels
from jspec import greedy_head
from jspec import quant

Params = Any  # nested dict of arrays, as returned by `init_params` or `convert`.


def _param(module: nn.Module, name: str, init, shape: tuple, dtype) -> jax.Array:
  """`module.param` without re-tracing the initializer when the value is stored.

  flax checks a stored param by running its initializer under
  `jax.eval_shape` on every call: over the decode program's seven forwards
  that was a quarter of its trace time, which every new process pays even
  when the compiled program comes from the persistent cache. The shape is
  still checked, directly.

  Args:
    module: the module the param belongs to.
    name, init, shape, dtype: as for `flax.linen.Module.param`.

  Returns:
    The stored value, or a freshly initialized one (`init_params`).

  Raises:
    ValueError: a stored value of another shape.
  """
  if not module.has_variable("params", name):
    return module.param(name, init, shape, dtype)
  value = module.get_variable("params", name)
  if tuple(value.shape) != tuple(shape):
    raise ValueError(f"param {'/'.join(module.scope.path)}/{name} has shape {tuple(value.shape)}: "
                     f"expected {tuple(shape)}")
  return value


def _packed_int8(module: nn.Module, names: tuple, rows: int, cols: int) -> quant.PackedTable:
  """An int8 [rows, cols] table stored for jspec's int8 kernel (`quant.pack`), as params.

  Args:
    module: the module the params belong to.
    names: the names of its panels, row sums and row scales.
    rows, cols: the table's shape.

  Returns:
    `quant.PackedTable` of the three params.
  """
  width, group = cpu_kernels.PANEL, cpu_kernels.GROUP
  panels, sums, scale = names
  return quant.PackedTable(
      _param(module, panels, nn.initializers.zeros,
             (rows // width, -(-cols // group), width, group), jnp.int8),
      _param(module, sums, nn.initializers.zeros, (rows,), jnp.int32),
      _param(module, scale, nn.initializers.ones, (rows,), jnp.float32))


class Linear(nn.Module):
  """A dense layer whose weight is stored either way round (see `jspec.layout`).

  Params hold either `kernel` [in, out] (flax's layout, what the converters
  write), `weight` [out, in], `panels` [out/32, in, 32] (jspec's CPU kernel,
  `jspec.cpu_kernels`), or for an int8 draft `qweight` [out, in] and
  `scale` [out] (`jspec.quant`). Which one is static pytree structure, so
  each layout compiles its own program.
  """

  features: int
  use_bias: bool
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
    if self.has_variable("params", "qpanels"):
      table = _packed_int8(self, ("qpanels", "sums", "scale"), self.features, x.shape[-1])
      y = quant.matmul(x, table).astype(self.dtype)
    elif self.has_variable("params", "qweight"):
      qweight = _param(self, "qweight", nn.initializers.zeros, (self.features, x.shape[-1]), jnp.int8)
      scale = _param(self, "scale", nn.initializers.ones, (self.features,), jnp.float32)
      y = quant.matmul(x, quant.Table(qweight, scale)).astype(self.dtype)
    elif self.has_variable("params", "panels"):
      width = cpu_kernels.PANEL
      panels = _param(self, "panels", nn.initializers.zeros,
                      (self.features // width, x.shape[-1], width), self.dtype)
      y = cpu_kernels.matmul(x, panels)
    elif self.has_variable("params", "weight"):
      weight = _param(self, "weight", nn.initializers.zeros, (self.features, x.shape[-1]), self.dtype)
      y = jnp.einsum("...i,oi->...o", x, weight)
    else:
      kernel = _param(self, "kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                          self.dtype)
      y = x @ kernel
    if self.use_bias:
      y = y + _param(self, "bias", nn.initializers.zeros, (self.features,), self.dtype)
    return y


class QuantEmbed(nn.Module):
  """Token embedding from an int8 table with one scale per token (`jspec.quant`).

  The table is `qembedding` [V, D], or when `packed` the int8 kernel's
  `qpanels` and `sums` (`quant.pack`), which the tied head multiplies by.
  """

  num_embeddings: int
  features: int
  packed: bool = False

  def setup(self):
    v, d = self.num_embeddings, self.features
    if self.packed:
      self.packed_table = _packed_int8(self, ("qpanels", "sums", "scale"), v, d)
      self.scale = self.packed_table.scale
    else:
      self.qembedding = _param(self, "qembedding", nn.initializers.zeros, (v, d), jnp.int8)
      self.scale = _param(self, "scale", nn.initializers.ones, (v,), jnp.float32)

  def __call__(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D] float32
    if self.packed:
      q = self.table().rows(tokens, self.features)
    else:
      q = self.qembedding[tokens]
    return q.astype(jnp.float32) * self.scale[tokens][..., None]

  def table(self):
    """The table as the tied output head reads it (a `quant.Table` or `quant.PackedTable`)."""
    if self.packed:
      return self.packed_table
    return quant.Table(self.qembedding, self.scale)


class PackedEmbed(nn.Module):
  """Token embedding read from an output table stored as head panels (`jspec.layout` "packed").

  One copy of a tied table serves both ends: the head multiplies by the
  panels (`cpu_kernels.matmul`) and token v's embedding is column v % 32
  of panel v // 32.
  """

  num_embeddings: int
  features: int
  dtype: jnp.dtype

  def setup(self):
    width = cpu_kernels.PANEL
    self.panels = _param(self, "panels", nn.initializers.zeros,
                         (self.num_embeddings // width, self.features, width), self.dtype)

  def __call__(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    width = cpu_kernels.PANEL
    return self.panels[tokens // width, :, tokens % width]


class RMSNorm(nn.Module):
  """Root-mean-square norm, computed in float32 like the reference."""

  eps: float

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
    weight = _param(self, "weight", nn.initializers.ones, (x.shape[-1],), x.dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return weight * x32.astype(x.dtype)


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


class Attention(nn.Module):
  """Grouped-query attention over the cache, with q/k/v biases and no o bias.

  With `fused`, the caches are only read, by jspec's CPU attention kernel
  (`jspec.cpu_attention`), and the chunk's keys and values are returned for
  the caller to write. With `fresh` (a prefill: every row's cache is empty)
  the chunk attends only to itself, not to every slot of the cache.
  """

  cfg: config_lib.Qwen2Config
  dtype: jnp.dtype
  fused: bool = False
  fresh: bool = False

  @nn.compact
  def __call__(self, x, positions, k_buf, v_buf, layer, starts):
    """Attends T new tokens to the cached prefix and to each other.

    Args:
      x: [B, T, D] normed hidden states.
      positions: [B, T] int32 positions (= slots) of the new tokens.
      k_buf: [L, B, S, K, H] key cache of all layers.
      v_buf: [L, B, S, K, H] value cache of all layers.
      layer: index of this layer in the cache: static, or with `fused` a
        [] int32 array.
      starts: [B] int32 slot of the first new token per row.

    Returns:
      ([B, T, D] output, k_buf, v_buf) with this chunk's keys and values
      written; with `fused` ([B, T, D] output, new_k, new_v [B, T, K, H]).
    """
    cfg = self.cfg
    b, t, _ = x.shape
    n, k, g, h = cfg.num_heads, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
    dense = lambda feats, name, bias: Linear(feats, bias, self.dtype, name=name)
    q = dense(n * h, "q_proj", True)(x).reshape(b, t, n, h)
    new_k = dense(k * h, "k_proj", True)(x).reshape(b, t, k, h)
    new_v = dense(k * h, "v_proj", True)(x).reshape(b, t, k, h)
    q = rope(q, positions, cfg.rope_theta)
    new_k = rope(new_k, positions, cfg.rope_theta)
    o_proj = dense(cfg.hidden_size, "o_proj", False)
    if self.fused:
      out = cpu_attention.attend(q, new_k, new_v, k_buf, v_buf, layer, starts)  # [B, T, N, H]
      return o_proj(out.reshape(b, t, n * h)), new_k, new_v
    k_buf = cache_lib.write_layer(k_buf, layer, new_k, starts)
    v_buf = cache_lib.write_layer(v_buf, layer, new_v, starts)
    if self.fresh:
      # Slots 0..T-1 are the chunk, and past them nothing is visible: a
      # prefill of T = 320 would score 658 slots, twice the work (and 4x the
      # causal half), for masked-out zeros.
      keys, values = new_k, new_v  # [B, T, K, H]
    else:
      keys, values = k_buf[layer], v_buf[layer]  # [B, S, K, H]

    q = q.reshape(b, t, k, g, h)  # query head n = k * G + g, as HF repeat_kv
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, keys,
                        preferred_element_type=jnp.float32) * (h ** -0.5)
    # A slot is visible iff it holds a position at or before the query's: this
    # is the causal mask inside the chunk and hides everything past a row's
    # length (rolled-back drafts, padding, never-written slots) at once.
    slots = jnp.arange(keys.shape[1], dtype=jnp.int32)
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, values).reshape(b, t, n * h)
    return o_proj(out), k_buf, v_buf


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  cfg: config_lib.Qwen2Config
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
    dense = lambda feats, name: Linear(feats, False, self.dtype, name=name)
    f = self.cfg.intermediate_size
    hidden = nn.silu(dense(f, "gate_proj")(x)) * dense(f, "up_proj")(x)  # [B, T, F]
    return dense(self.cfg.hidden_size, "down_proj")(hidden)


class DecoderBlock(nn.Module):
  """Pre-norm attention and MLP with residuals.

  Returns (x, k_buf, v_buf) with the chunk written; with `fused` (see
  `Attention`) (x, new_k, new_v), and the layer index comes as `layer_index`.
  `fresh` as `Attention`'s.
  """

  cfg: config_lib.Qwen2Config
  dtype: jnp.dtype
  layer: int
  fused: bool = False
  fresh: bool = False

  @nn.compact
  def __call__(self, x, positions, k_buf, v_buf, starts, layer_index=None):
    eps = self.cfg.rms_norm_eps
    layer = layer_index if self.fused else self.layer
    attention = Attention(self.cfg, self.dtype, self.fused, self.fresh, name="self_attn")
    attn_out, k_buf, v_buf = attention(
        RMSNorm(eps, name="input_layernorm")(x), positions, k_buf, v_buf, layer, starts)
    x = x + attn_out
    x = x + MLP(self.cfg, self.dtype, name="mlp")(RMSNorm(eps, name="post_attention_layernorm")(x))
    return x, k_buf, v_buf


class Qwen2(nn.Module):
  """The whole decoder: embeddings, L blocks, final norm, output head."""

  cfg: config_lib.Qwen2Config
  dtype: jnp.dtype = jnp.float32
  int8: bool = False  # weights in `jspec.quant`'s form
  packed_table: bool = False  # output table stored as kernel panels (`jspec.layout`, `quant.pack`)
  fresh: bool = False  # every row's cache is empty (see `forward`)
  greedy: bool = False  # only each row's argmax is used (see `forward`)
  vocab_limit: Optional[int] = None  # ids at or past it are never the argmax (with `greedy`)

  @nn.compact
  def __call__(self, tokens, cache: cache_lib.KVCache, logits_at: Optional[jax.Array] = None,
               head: Optional[jax.Array] = None):
    """Runs T new tokens per row after each row's cached prefix.

    Args:
      tokens: [B, T] int32 token ids.
      cache: the KV cache; row b's new tokens go at slots lengths[b] + [0, T).
      logits_at: optional [B, T'] indices into T: compute logits only there
        (prefill needs one position per row; the head is V x D per position).
      head: optional [V', D] output table to use instead of the model's own
        (a `quant.Table` for an int8 model):
        logits only for token ids 0..V'-1 (a cheaper draft head, sliced
        once outside the compiled program; see `jspec.drafters`).

    Returns:
      ([B, T or T', V or V'] float32 logits, cache with lengths advanced by T).
    """
    cfg = self.cfg
    if self.int8:
      embed = QuantEmbed(cfg.vocab_size, cfg.hidden_size, self.packed_table, name="embed_tokens")
    elif self.packed_table and cfg.tie_word_embeddings:
      embed = PackedEmbed(cfg.vocab_size, cfg.hidden_size, self.dtype, name="embed_tokens")
    else:
      embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype,
                       param_dtype=self.dtype, name="embed_tokens")
    t = tokens.shape[1]
    starts = cache.lengths
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    x = embed(tokens)  # [B, T, D]
    k_buf, v_buf = cache.k, cache.v
    layers = None
    if SCAN_LAYERS and self.has_variable("params", "layers_0"):
      layers = [self.get_variable("params", f"layers_{i}") for i in range(cfg.num_layers)]
    if layers is not None and _scannable(layers):
      x, k_buf, v_buf = _scan_layers(cfg, self.dtype, layers, x, positions, k_buf, v_buf, starts,
                                     self.fresh)
    else:
      for layer in range(cfg.num_layers):
        x, k_buf, v_buf = DecoderBlock(cfg, self.dtype, layer, fresh=self.fresh,
                                       name=f"layers_{layer}")(
            x, positions, k_buf, v_buf, starts)
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)  # [B, T', D]
    x = RMSNorm(cfg.rms_norm_eps, name="norm")(x)
    if cfg.tie_word_embeddings and self.int8:
      table = embed.table()  # [V, D] int8, plain or packed
    elif cfg.tie_word_embeddings:
      table = embed.panels if self.packed_table else embed.embedding  # [V/32, D, 32] or [V, D]
    elif self.int8 and self.has_variable("params", "qlm_head_panels"):  # `quant.pack`ed
      table = _packed_int8(self, ("qlm_head_panels", "qlm_head_sums", "qlm_head_scale"),
                           cfg.vocab_size, cfg.hidden_size)
    elif self.int8:
      table = quant.Table(
          _param(self, "qlm_head", nn.initializers.zeros, (cfg.vocab_size, cfg.hidden_size), jnp.int8),
          _param(self, "qlm_head_scale", nn.initializers.ones, (cfg.vocab_size,), jnp.float32))
    elif self.packed_table:
      width = cpu_kernels.PANEL
      table = _param(self, "lm_head_panels", nn.initializers.zeros,
                     (cfg.vocab_size // width, cfg.hidden_size, width), self.dtype)
    else:
      table = _param(self, "lm_head", nn.initializers.normal(0.02),
                         (cfg.vocab_size, cfg.hidden_size), self.dtype)  # [V, D]
    if head is not None:
      table = head  # [V', D]
    if isinstance(table, (quant.Table, quant.PackedTable)):
      logits = quant.matmul(x, table)
    elif table.ndim == 3 and self._greedy_head(x, table):
      b, t, d = x.shape
      bound = self.get_variable("params", greedy_head.PARAM)
      logits = greedy_head.logits(x.reshape(b * t, d), table, bound,
                                  self.vocab_limit).reshape(b, t, -1)
    elif table.ndim == 3:  # panels
      logits = cpu_kernels.matmul(x, table).astype(jnp.float32)
    else:
      logits = jnp.einsum("BTD,VD->BTV", x, table, preferred_element_type=jnp.float32)
    return logits, cache.replace(k=k_buf, v=v_buf, lengths=starts + t)

  def _greedy_head(self, x: jax.Array, table: jax.Array) -> bool:
    """Whether the head takes `jspec.greedy_head`'s exact argmax path for x [B, T', D]."""
    return (self.greedy and self.has_variable("params", greedy_head.PARAM)
            and greedy_head.applies(x.shape[0] * x.shape[1], table))


# Whether forwards over kernel-packed layers run as one loop over layers
# (`_scan_layers`); JSPEC_SCAN_LAYERS=0 unrolls them as for every other
# layout (to compare the two; read once, it is part of `program_store` keys).
SCAN_LAYERS = os.environ.get("JSPEC_SCAN_LAYERS", "1") != "0"
# Whether that loop attends with jspec's CPU kernel over the caches in place
# (`jspec.cpu_attention`); JSPEC_FUSED_ATTENTION=0 keeps XLA's attention on
# a copy of each layer's slice (to compare the two; read once, like
# SCAN_LAYERS).
FUSED_ATTENTION = os.environ.get("JSPEC_FUSED_ATTENTION", "1") != "0"
# Up to this many new tokens per forward: decode steps, verifies and the
# draft's catch-up. The kernel's one query at a time loses to XLA's batched
# dots on long chunks: on the 1.5B's shapes a forward took 0.93x XLA's time
# at 1 token, 0.96x at 17, 1.02x at 64 and 1.05x at a 320-token prefill
# (by hand, 512 slots).
FUSED_MAX_T = 48
_PICKED = ("panels", "qpanels")  # the per-layer weights the kernels pick by index


def _scannable(layers: list) -> bool:
  """Whether every matrix of the layers is one the CPU kernels can pick by layer index.

  Any other matrix would have to be stacked and sliced in the loop, which
  copies it each step (the 2.7x of the module docstring).

  Args:
    layers: the L layers' param trees (one structure: the first is read).

  Returns:
    True on CPU when every matrix is kernel panels (fp32 or int8) and the
    kernels for them are built.
  """
  if jax.default_backend() != "cpu":
    return False
  leaves = jax.tree_util.tree_flatten_with_path(layers[0])[0]
  if any(leaf.ndim > 1 and path[-1].key not in _PICKED for path, leaf in leaves):
    return False
  names = {path[-1].key for path, _ in leaves}
  if "panels" in names and not cpu_kernels.available():
    return False
  return "qpanels" not in names or cpu_kernels.int8_kind() is not None


def _scan_layers(cfg: config_lib.Qwen2Config, dtype, layers: list, x, positions, k_buf, v_buf,
                 starts, fresh: bool = False):
  """The decoder layers as one `lax.scan`: each forward compiles one layer, not L.

  The kernels' weights stay per layer and each step picks its layer's
  (`cpu_kernels.LayerPick`); the small params (norms, biases, scales) are
  stacked, a few KB per layer. The caches are only read in the loop: each
  step attends over its own layer's slots, in place with jspec's CPU
  attention kernel (`FUSED_ATTENTION`), else over a copy of its layer's
  slice with the new chunk written in; the chunks of every layer go into
  the caches once, after the loop.
  Carried through the loop and written each step, they made decode about
  1.2x slower on the real pair, as a copy of the caches per layer would.

  Args:
    cfg: the model's config.
    dtype: activation dtype.
    layers: the L layers' param trees (`_scannable`).
    x: [B, T, D] embedded tokens.
    positions: [B, T] int32.
    k_buf, v_buf: [L, B, S, K, H] caches.
    starts: [B] int32 first new slot per row.
    fresh: every row's cache is empty (`Attention`'s `fresh`; the fused
      kernel reads only visible slots anyway).

  Returns:
    (x [B, T, D] after the last layer, k_buf, v_buf with the chunk written).
  """
  flat = [jax.tree_util.tree_flatten_with_path(layer)[0] for layer in layers]
  treedef = jax.tree_util.tree_structure(layers[0])
  picked = [path[-1].key in _PICKED for path, _ in flat[0]]
  columns = [tuple(leaves[j][1] for leaves in flat) for j in range(len(flat[0]))]
  columns = [c if big else jnp.stack(c) for c, big in zip(columns, picked)]
  t = x.shape[1]

  def chunk(buf):  # [1, B, S, K, H] -> [B, T, K, H] the slots each row just wrote
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, t, axis=0))(buf[0], starts)

  def layer_params(i):  # layer i's params: its kernel weights picked, the rest sliced
    leaves = [cpu_kernels.LayerPick(c, i) if big else c[i] for c, big in zip(columns, picked)]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def fused_body(x, i):  # the attention kernel reads layer i's slots where they lie
    x, new_k, new_v = DecoderBlock(cfg, dtype, 0, fused=True, parent=None).apply(
        {"params": layer_params(i)}, x, positions, k_buf, v_buf, starts, i)
    return x, (new_k, new_v)

  def body(x, i):
    params = layer_params(i)
    k_layer = jax.lax.dynamic_slice_in_dim(k_buf, i, 1, axis=0)  # [1, B, S, K, H]
    v_layer = jax.lax.dynamic_slice_in_dim(v_buf, i, 1, axis=0)
    x, k_layer, v_layer = DecoderBlock(cfg, dtype, 0, fresh=fresh, parent=None).apply(
        {"params": params}, x, positions, k_layer, v_layer, starts)
    return x, (chunk(k_layer), chunk(v_layer))

  fused = FUSED_ATTENTION and t <= FUSED_MAX_T and cpu_attention.usable(x, k_buf)
  x, (new_k, new_v) = jax.lax.scan(fused_body if fused else body, x,
                                   jnp.arange(len(layers), dtype=jnp.int32))
  # new_k, new_v: [L, B, T, K, H]
  return x, cache_lib.write_chunks(k_buf, new_k, starts), cache_lib.write_chunks(v_buf, new_v, starts)


def forward(params: Params, cfg: config_lib.Qwen2Config, tokens: jax.Array,
            cache: cache_lib.KVCache, logits_at: Optional[jax.Array] = None,
            head: Optional[jax.Array] = None, fresh: bool = False, greedy: bool = False,
            vocab_limit: Optional[int] = None):
  """Pure functional forward pass (see `Qwen2.__call__`).

  Args:
    params: the model's params pytree (`{"embed_tokens": ..., "layers_0": ...}`).
    cfg: its config.
    tokens: [B, T] int32 token ids (the caller checks they are in range).
    cache: KV cache to read and extend.
    logits_at: optional [B, T'] positions within T to compute logits at.
    head: optional [V', D] output table replacing the model's own.
    fresh: static; the caller promises every row's cache length is 0 (a
      prefill), so attention reads only the new chunk. The result is the
      same as without it; with a non-empty cache it would be wrong.
    greedy: static; the caller uses only each row's argmax over ids below
      vocab_limit. Where the params carry `jspec.greedy_head`'s int8 head
      (a float32 target laid out "packed", `jspec.layout`) and the call has
      few rows, logits are then exact only where they could be the argmax
      and -inf elsewhere: the same argmax from a quarter of the head's bytes.
    vocab_limit: static; with greedy, ids at or past it are never chosen.

  Returns:
    ([B, T', V'] float32 logits, updated cache).
  """
  int8 = quant.is_quantized(params)
  embed = params["embed_tokens"]
  packed_table = "panels" in embed or "qpanels" in embed or "lm_head_panels" in params
  return Qwen2(cfg, compute_dtype(params), int8, packed_table, fresh, greedy, vocab_limit).apply(
      {"params": params}, tokens, cache, logits_at, head)


def compute_dtype(params: Params) -> jnp.dtype:
  """The dtype a model's activations and KV cache take: its params' (float32 for int8 weights)."""
  if quant.is_quantized(params):
    return jnp.dtype(jnp.float32)
  embed = params["embed_tokens"]
  return (embed["panels"] if "panels" in embed else embed["embedding"]).dtype


def init_params(cfg: config_lib.Qwen2Config, key: jax.Array, dtype=jnp.float32,
                scale: float = 0.02) -> Params:
  """Random params of the right shapes (tests and shape-only benchmarks).

  Args:
    cfg: the config.
    key: PRNG key.
    dtype: param dtype.
    scale: standard deviation of every weight and bias (norm weights are
      1 + noise so that they are not all equal).

  Returns:
    The params pytree.
  """
  cache = cache_lib.init(cfg, 1, 2, dtype)
  shapes = jax.eval_shape(lambda: Qwen2(cfg, dtype).init(key, jnp.zeros((1, 1), jnp.int32), cache))
  leaves, tree = jax.tree_util.tree_flatten_with_path(shapes["params"])
  keys = jax.random.split(key, len(leaves))
  out = []
  for (path, leaf), k in zip(leaves, keys):
    noise = scale * jax.random.normal(k, leaf.shape, jnp.float32)
    if "norm" in jax.tree_util.keystr(path):
      noise = noise + 1.0
    out.append(noise.astype(dtype))
  return jax.tree_util.tree_unflatten(tree, out)
