"""Where drafts come from: a small draft model, or prompt lookup (n-gram copy).

Each drafter proposes up to G = gamma_max tokens per row together with the
distribution q each was drawn from, and how many of them count (the
effective gamma). All of it runs inside the compiled decode loop.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jspec import cache as cache_lib
from jspec import config as config_lib
from jspec import model
from jspec import sampling


def _gather_rows(buf: jax.Array, idx: jax.Array) -> jax.Array:
  """buf [B, W], idx [B, T] -> [B, T] (indices clipped into range)."""
  return jnp.take_along_axis(buf, jnp.clip(idx, 0, buf.shape[1] - 1), axis=1)


def _fit_vocab(q: jax.Array, v: int) -> jax.Array:
  """Pads or cuts q's last axis to the target's vocabulary size v.

  Rows past the shared vocabulary are padding (zero probability under
  `Sampling.vocab_limit`), so cutting or zero-padding them loses no mass.
  """
  if q.shape[-1] > v:
    return q[..., :v]
  if q.shape[-1] < v:
    pad = [(0, 0)] * (q.ndim - 1) + [(0, v - q.shape[-1])]
    return jnp.pad(q, pad)
  return q


def _draft_probs(logits: jax.Array, s: sampling.Sampling | sampling.Traced, vocab: int) -> jax.Array:
  """q over the target's vocabulary from draft logits [B, V'] (V' may be a truncated head)."""
  if logits.shape[-1] < vocab:  # tokens past a truncated head get q = 0
    logits = jnp.pad(logits, ((0, 0), (0, vocab - logits.shape[-1])), constant_values=-jnp.inf)
  return _fit_vocab(sampling.probs(logits, s), vocab)


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


def _first_step(params, cfg: config_lib.Qwen2Config, dcache: cache_lib.KVCache,
                tokens: jax.Array, seq_len: jax.Array, draft_len: jax.Array,
                head: Optional[jax.Array], widths: tuple[int, ...]):
  """Feeds each row the tokens its draft cache lacks, x_{n-1} last; returns the logits for d_1.

  Each pass feeds every row a chunk starting at its own `draft_len`: the
  narrowest width in `widths` that holds what the furthest-behind row still
  lacks, or the widest. Rows that lack less feed padding past x_{n-1},
  which the cache lengths roll back. After a normal round a row lacks x_{n-1}
  (one token: one cheap T=1 step) or also x_{n-2} (the draft's own last
  draft, after a fully accepted round); the batch pays for its furthest
  row.

  Args:
    params: draft params.
    cfg: draft config.
    dcache: draft KV cache.
    tokens: [B, W] int32 prompt + output so far.
    seq_len: [B] int32 valid tokens per row (>= 2).
    draft_len: [B] int32 leading tokens of each row the draft cache holds
      (< seq_len; rows with draft_len >= seq_len feed nothing useful).
    head: optional truncated output table (see `draft_model`).
    widths: static chunk widths (`catch_up_widths`).

  Returns:
    (logits [B, V'] for d_1, draft cache holding every token of each row).
  """
  b = tokens.shape[0]
  v = cfg.vocab_size if head is None else head.shape[0]
  table = jnp.asarray(widths, jnp.int32)

  def branch(w: int):
    def fn(dcache, start, last):
      chunk = _gather_rows(tokens, start[:, None] + jnp.arange(w)[None])  # [B, w]
      at = jnp.clip(last - start, 0, w - 1)[:, None]  # [B, 1] x_{n-1} if in this chunk
      logits, dcache = model.forward(params, cfg, chunk, cache_lib.with_lengths(dcache, start),
                                     logits_at=at, head=head)
      return logits[:, 0], dcache, jnp.minimum(start + w, last + 1)
    return fn

  def cond(carry):
    _, _, start = carry
    return jnp.any(start < seq_len)

  def body(carry):
    dcache, logits, start = carry
    lacking = jnp.max(seq_len - start)
    index = jnp.minimum(jnp.searchsorted(table, lacking), len(widths) - 1)
    step, dcache, new_start = jax.lax.switch(index, [branch(w) for w in widths],
                                             dcache, start, seq_len - 1)
    fed_last = (start < seq_len) & (new_start >= seq_len)  # this pass fed x_{n-1}
    logits = jnp.where(fed_last[:, None], step, logits)
    return dcache, logits, jnp.maximum(new_start, start)

  start = jnp.minimum(draft_len, seq_len - 1)
  dcache, logits, _ = jax.lax.while_loop(
      cond, body, (dcache, jnp.zeros((b, v), jnp.float32), start))
  return logits, cache_lib.with_lengths(dcache, seq_len)


def draft_model(params, cfg: config_lib.Qwen2Config, dcache: cache_lib.KVCache,
                tokens: jax.Array, seq_len: jax.Array, gamma: jax.Array, key: jax.Array,
                s: sampling.Sampling | sampling.Traced, gamma_max: int, vocab: int,
                min_confidence: float | jax.Array = 0.0, head: Optional[jax.Array] = None,
                draft_len: Optional[jax.Array] = None, widths: tuple[int, ...] = (1, 2),
                cumulative: bool = False):
  """Drafts up to gamma tokens per row with the draft model, sampling each from q.

  Step 0 brings the draft up to date (`_first_step`) and proposes d_1; step
  i >= 1 feeds d_i and proposes d_{i+1}. The loop runs while any row wants
  more drafts, so after `steps` steps the draft cache holds d_1..d_{steps-1}
  of every row: a row that accepts all `steps` drafts leaves the draft one
  token behind (see `held_after`).

  Args:
    params: draft params.
    cfg: draft config.
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
    head: optional [V', D] truncated output table (the first V' token ids):
      the draft's head is over a quarter of its weight reads per step, and
      a q that is 0 on rare tokens costs only acceptance, never exactness.
    draft_len: [B] int32 leading tokens of each row the draft cache holds
      (None: all but the last two, the most a normal round leaves it lacking).
    widths: static catch-up chunk widths (`catch_up_widths`).
    cumulative: compare `min_confidence` with the product of the top
      probabilities of the row's drafts so far (the draft's own estimate
      that all of them are accepted) rather than with each draft's own.

  Returns:
    (drafts [B, G] int32, q [B, G, vocab] float32, gamma_eff [B] int32,
    steps [] int32 draft forwards run, draft cache).
  """
  b = tokens.shape[0]
  if draft_len is None:
    draft_len = seq_len - 2
  logits0, dcache = _first_step(params, cfg, dcache, tokens, seq_len, draft_len, head, widths)
  q0 = _draft_probs(logits0, s, vocab)  # [B, V]
  d0 = sampling.sample(jax.random.fold_in(key, 0), q0, s)  # [B]
  drafts = jnp.zeros((b, gamma_max), jnp.int32).at[:, 0].set(d0)
  q = jnp.zeros((b, gamma_max, vocab), jnp.float32).at[:, 0].set(q0)
  # A row keeps drafting while it wants more and stays confident.
  gamma_eff = jnp.ones((b,), jnp.int32)
  sure = _top_prob(logits0, q0, s)  # [B] the product so far, when cumulative
  going = (gamma > 1) & (sure >= min_confidence)

  def cond(carry):
    i, _, _, _, _, going, _ = carry
    return (i < gamma_max) & jnp.any(going)

  def body(carry):
    i, dcache, drafts, q, gamma_eff, going, sure = carry
    prev = jax.lax.dynamic_slice_in_dim(drafts, i - 1, 1, axis=1)  # [B, 1] d_i
    logits, dcache = model.forward(params, cfg, prev, dcache, head=head)
    qi = _draft_probs(logits[:, 0], s, vocab)  # [B, V]
    di = sampling.sample(jax.random.fold_in(key, i), qi, s)
    drafts = jax.lax.dynamic_update_slice_in_dim(drafts, di[:, None], i, axis=1)
    q = jax.lax.dynamic_update_slice_in_dim(q, qi[:, None], i, axis=1)
    top = _top_prob(logits[:, 0], qi, s)
    if cumulative:
      top = top * sure
    take = going & (top >= min_confidence)
    gamma_eff = gamma_eff + take.astype(jnp.int32)
    going = take & (i + 1 < gamma)
    return i + 1, dcache, drafts, q, gamma_eff, going, jnp.where(take, top, sure)

  steps, dcache, drafts, q, gamma_eff, _, _ = jax.lax.while_loop(
      cond, body, (jnp.int32(1), dcache, drafts, q, gamma_eff, going, sure))
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
  than a step. Replayed on the real target's recorded outputs
  (`bench.lookup_bound`), at ngram 3 and up to 16 drafts, the bench's edit
  prompt takes 50 rounds instead of 57 with 3-grams alone, quicksort 95
  instead of 115.

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
  return drafts, jax.nn.one_hot(drafts, vocab, dtype=jnp.float32), gamma_eff
