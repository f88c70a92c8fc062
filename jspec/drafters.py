"""Where drafts come from: a small draft model, or prompt lookup (n-gram copy).

Each drafter proposes up to G = gamma_max tokens per row together with the
distribution q each was drawn from, and how many of them count (the
effective gamma). All of it runs inside the compiled decode loop.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from jspec import cache as cache_lib
from jspec import model
from jspec import sampling


def _gather_rows(buf: jax.Array, idx: jax.Array) -> jax.Array:
  """buf [B, W], idx [B, T] -> [B, T] (indices clipped into range)."""
  return jnp.take_along_axis(buf, jnp.clip(idx, 0, buf.shape[1] - 1), axis=1)


def _draft_probs(logits: jax.Array, s: sampling.Sampling | sampling.Traced, vocab: int) -> jax.Array:
  """q over the target's vocabulary from draft logits [B, V'].

  The two tables may differ in padding rows past the shared vocabulary
  (zero probability under `Sampling.vocab_limit`), so q is cut or
  zero-padded to the target's V without losing mass.
  """
  if logits.shape[-1] < vocab:  # ids past the draft's table get q = 0
    logits = jnp.pad(logits, ((0, 0), (0, vocab - logits.shape[-1])), constant_values=-jnp.inf)
  return sampling.probs(logits, s)[..., :vocab]


def _top_prob(logits: jax.Array, q: jax.Array, s: sampling.Sampling | sampling.Traced) -> jax.Array:
  """The draft's confidence in its proposal: its most likely token's probability.

  Sampling, that is q's top probability. Greedy, q is a point mass (always
  1), so the draft's own softmax (temperature 1) is read instead.

  Args:
    logits: [B, V'] draft logits.
    q: [B, vocab] the distribution the draft sampled from.
    s: sampling settings.

  Returns:
    [B] float32 in (0, 1].
  """
  if not s.greedy:
    return jnp.max(q, axis=-1)
  logits = logits.astype(jnp.float32)
  v = logits.shape[-1]
  if s.vocab_limit is not None and s.vocab_limit < v:
    logits = jnp.where(jnp.arange(v) < s.vocab_limit, logits, -jnp.inf)
  # max softmax = exp(max - logsumexp): no [B, V'] probabilities written out.
  return jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))


def catch_up_widths(gamma_max: int, hybrid: bool) -> tuple[int, ...]:
  """Static chunk widths the draft's catch-up feeds (ascending).

  With a draft model alone the draft lacks one or two tokens per round
  (x_{n-1}, and x_{n-2} after a fully accepted round). When prompt lookup
  drafted some rounds instead, the draft missed everything those rounds
  emitted, up to G + 1 tokens each, fed in chunks of up to G + 1. Between 2
  and G + 1 the widths are 9, 17, 33, ...: every width is one more compiled
  draft forward (first-call compile time), and a few more positions cost
  the draft little next to the target's verify.

  Args:
    gamma_max: G.
    hybrid: whether prompt lookup drafts some rounds (method "lookup_model").

  Returns:
    Widths T, each one compiled draft forward over T tokens.
  """
  if not hybrid:
    return (1, 2)
  full = gamma_max + 1
  return tuple(sorted({1, 2, full} | {2**k + 1 for k in range(3, full.bit_length())
                                      if 2**k + 1 < full}))


def catch_up(arch: model.Arch, params, dcache: cache_lib.KVCache, tokens: jax.Array,
                seq_len: jax.Array, draft_len: jax.Array, widths: tuple[int, ...]):
  """Feeds each row the tokens its draft cache lacks, x_{n-1} last; returns the logits for d_1.

  Each pass feeds every row a chunk starting at its own `draft_len`: the
  narrowest width in `widths` that holds what the furthest-behind row still
  lacks, or the widest. Rows that lack less feed padding past x_{n-1},
  which the cache lengths roll back. After a normal round a row lacks x_{n-1}
  (one token: one cheap T=1 step) or also x_{n-2} (the draft's own last
  draft, after a fully accepted round); the batch pays for its furthest
  row.

  Args:
    arch: the draft's arch.
    params: draft params.
    dcache: draft KV cache.
    tokens: [B, W] int32 prompt + output so far.
    seq_len: [B] int32 valid tokens per row (>= 2).
    draft_len: [B] int32 leading tokens of each row the draft cache holds
      (< seq_len; rows with draft_len >= seq_len feed nothing useful).
    widths: static chunk widths (`catch_up_widths`).

  Returns:
    (logits [B, V'] for d_1 over the draft's table, draft cache holding
    every token of each row).
  """
  b = tokens.shape[0]
  v = arch.cfg.vocab_size
  table = jnp.asarray(widths, jnp.int32)
  widest = max(widths)

  # The branches write the cache once, after the switch (`cache_lib.branch_result`).
  def branch(w: int):
    def fn(dcache, start, last):
      chunk = _gather_rows(tokens, start[:, None] + jnp.arange(w)[None])  # [B, w]
      at = jnp.clip(last - start, 0, w - 1)[:, None]  # [B, 1] x_{n-1} if in this chunk
      logits, dcache, chunks = model.forward(arch, params, chunk,
                                             cache_lib.with_lengths(dcache, start),
                                             logits_at=at, write=False)
      return (logits[:, 0], cache_lib.branch_result(dcache, chunks, widest),
              jnp.minimum(start + w, last + 1))
    return fn

  def cond(carry):
    _, _, start = carry
    return jnp.any(start < seq_len)

  def body(carry):
    dcache, logits, start = carry
    lacking = jnp.max(seq_len - start)
    index = jnp.minimum(jnp.searchsorted(table, lacking), len(widths) - 1)
    step, result, new_start = jax.lax.switch(index, [branch(w) for w in widths],
                                             dcache, start, seq_len - 1)
    dcache = cache_lib.after_switch(dcache, result, start)
    fed_last = (start < seq_len) & (new_start >= seq_len)  # this pass fed x_{n-1}
    logits = jnp.where(fed_last[:, None], step, logits)
    return dcache, logits, jnp.maximum(new_start, start)

  start = jnp.minimum(draft_len, seq_len - 1)
  dcache, logits, _ = jax.lax.while_loop(
      cond, body, (dcache, jnp.zeros((b, v), jnp.float32), start))
  return logits, cache_lib.with_lengths(dcache, seq_len)


def draft_model(arch: model.Arch, params, dcache: cache_lib.KVCache, tokens: jax.Array,
                seq_len: jax.Array, gamma: jax.Array, key: jax.Array,
                s: sampling.Sampling | sampling.Traced, gamma_max: int, vocab: int,
                min_confidence: float | jax.Array = 0.0, draft_len: Optional[jax.Array] = None,
                widths: tuple[int, ...] = (1, 2)):
  """Drafts up to gamma tokens per row with the draft model, sampling each from q.

  Step 0 brings the draft up to date (`catch_up`) and proposes d_1; step
  i >= 1 feeds d_i and proposes d_{i+1}. The loop runs while any row wants
  more drafts, so after `steps` steps the draft cache holds d_1..d_{steps-1}
  of every row: a row that accepts all `steps` drafts leaves the draft one
  token behind (see `held_after`).

  Args:
    arch: the draft's arch.
    params: draft params.
    dcache: draft KV cache.
    tokens: [B, W] int32 prompt + output so far.
    seq_len: [B] int32 valid tokens per row (>= 2).
    gamma: [B] int32 drafts wanted per row (1..G).
    key: PRNG key for the drafts.
    s: sampling settings (the target's, applied to q too).
    gamma_max: G, the static number of draft slots.
    vocab: the target's vocabulary size (q is returned over it).
    min_confidence: stop drafting a row once the draft's most likely token
      has probability below this (a number, or [] float32 data) (`_top_prob`: q's when sampling, the
      draft's softmax when greedy; 0 disables; the first draft always counts).
    draft_len: [B] int32 leading tokens of each row the draft cache holds
      (None: all but the last two, the most a normal round leaves it lacking).
    widths: static catch-up chunk widths (`catch_up_widths`).

  Returns:
    (drafts [B, G] int32, q [B, G, vocab] float32, gamma_eff [B] int32,
    steps [] int32 draft forwards run, draft cache).
  """
  b = tokens.shape[0]
  chex.assert_shape([seq_len, gamma], (b,))
  if draft_len is None:
    draft_len = seq_len - 2
  logits0, dcache = catch_up(arch, params, dcache, tokens, seq_len, draft_len, widths)
  q0 = _draft_probs(logits0, s, vocab)  # [B, V]
  d0 = sampling.sample(jax.random.fold_in(key, 0), q0, s)  # [B]
  drafts = jnp.zeros((b, gamma_max), jnp.int32).at[:, 0].set(d0)
  q = jnp.zeros((b, gamma_max, vocab), jnp.float32).at[:, 0].set(q0)
  # A row keeps drafting while it wants more and stays confident.
  gamma_eff = jnp.ones((b,), jnp.int32)
  going = (gamma > 1) & (_top_prob(logits0, q0, s) >= min_confidence)

  def cond(carry):
    i, _, _, _, _, going = carry
    return (i < gamma_max) & jnp.any(going)

  def body(carry):
    i, dcache, drafts, q, gamma_eff, going = carry
    prev = jax.lax.dynamic_slice_in_dim(drafts, i - 1, 1, axis=1)  # [B, 1] d_i
    logits, dcache = model.forward(arch, params, prev, dcache)
    qi = _draft_probs(logits[:, 0], s, vocab)  # [B, V]
    di = sampling.sample(jax.random.fold_in(key, i), qi, s)
    drafts = jax.lax.dynamic_update_slice_in_dim(drafts, di[:, None], i, axis=1)
    q = jax.lax.dynamic_update_slice_in_dim(q, qi[:, None], i, axis=1)
    take = going & (_top_prob(logits[:, 0], qi, s) >= min_confidence)
    gamma_eff = gamma_eff + take.astype(jnp.int32)
    going = take & (i + 1 < gamma)
    return i + 1, dcache, drafts, q, gamma_eff, going

  steps, dcache, drafts, q, gamma_eff, _ = jax.lax.while_loop(
      cond, body, (jnp.int32(1), dcache, drafts, q, gamma_eff, going))
  chex.assert_shape(drafts, (b, gamma_max))
  chex.assert_shape(q, (b, gamma_max, vocab))
  return drafts, q, jnp.minimum(gamma_eff, gamma), steps, dcache


def held_after(seq_len: jax.Array, n: jax.Array, steps: jax.Array) -> jax.Array:
  """Leading tokens the draft cache holds after a draft-model round.

  Args:
    seq_len: [B] int32 tokens per row before the round (x_{n-1} last).
    n: [B] int32 drafts accepted.
    steps: [] int32 draft forwards the round ran (it fed d_1..d_{steps-1}).

  Returns:
    [B] int32: the prefix, then the accepted drafts the draft itself was fed.
  """
  return seq_len + jnp.minimum(n, steps - 1)


def prompt_lookup(tokens: jax.Array, seq_len: jax.Array, gamma: jax.Array,
                  gamma_max: int, ngram: int, vocab: int, min_ngram: int = 1):
  """Drafts what followed the latest earlier occurrence of each row's longest matching suffix.

  A row's last L tokens, for the largest L in [min_ngram, ngram] that
  occurred before (the latest such occurrence), are followed there by up to
  gamma >> (ngram - L) tokens (at least 1): a full-length match drafts
  gamma, each token shorter half as many. Falling back to shorter matches
  finds drafts in more rounds, and a short match predicts less, so it
  drafts less: a wide verify of drafts that are mostly rejected costs more
  than a step (docs/decisions.md, "Prompt lookup"; replayed by
  `python -m bench.tools.lookup_bound`).

  q is a point mass at each draft, so acceptance happens with probability
  p(d) and the residual is p with d removed: still exactly the target's
  distribution. A row with no match of min_ngram tokens drafts nothing
  (gamma_eff 0): the round then emits one target token.

  Args:
    tokens: [B, W] int32 prompt + output so far.
    seq_len: [B] int32 valid tokens per row.
    gamma: [B] int32 most drafts wanted per row.
    gamma_max: G, static number of draft slots.
    ngram: static longest suffix matched (>= 1).
    vocab: the target's vocabulary size.
    min_ngram: static shortest suffix that counts as a match (1..ngram):
      `lookup_model` asks for ngram, and drafts with the model otherwise.

  Returns:
    (drafts [B, G] int32, q [B, G, vocab] one-hot, gamma_eff [B] int32).
  """
  b, w = tokens.shape
  chex.assert_shape([seq_len, gamma], (b,))
  ends = jnp.arange(w)[None]  # [1, W] candidate match ends e: tokens[e] == tokens[n - 1]
  last = seq_len[:, None] - 1  # [B, 1]
  length = jnp.zeros((b, w), jnp.int32)  # [B, W] suffix tokens matched, ending at e
  extends = jnp.ones((b, w), bool)
  for k in range(ngram):
    before = jnp.roll(tokens, k, axis=1)  # [B, W] before[:, e] = tokens[:, e - k]
    extends &= (before == _gather_rows(tokens, last - k)) & (ends >= k) & (last >= k)
    length += extends.astype(jnp.int32)
  # At least one token must follow the match, so it ends before the suffix does.
  length = jnp.where(ends < last, length, 0)
  best = jnp.max(length, axis=1)  # [B]
  e = jnp.max(jnp.where(length == best[:, None], ends, -1), axis=1)  # [B] latest longest match
  found = best >= min_ngram
  follow = e + 1  # [B] first copied position
  drafts = _gather_rows(tokens, follow[:, None] + jnp.arange(gamma_max)[None])  # [B, G]
  wanted = jnp.maximum(gamma >> (ngram - best), 1)
  gamma_eff = jnp.where(found, jnp.minimum(wanted, seq_len - follow), 0).astype(jnp.int32)
  chex.assert_shape(drafts, (b, gamma_max))
  return drafts, jax.nn.one_hot(drafts, vocab, dtype=jnp.float32), gamma_eff
