"""The compiled decode loop: prefill, then one `lax.while_loop` over rounds.

One driver serves every method. A round verifies [x_{n-1}, d_1 .. d_G] with
one target forward and accepts by rejection sampling (`jspec.speculative`):

  method "target"         G = 0: the verify is a single-token step and the
                          round is plain KV-cached autoregressive decoding;
                          the fair baseline, compiled the same way.
  method "model"          drafts from a small draft model (`drafters.draft_model`).
  method "prompt_lookup"  drafts copied from earlier matches of the last
                          tokens (the longest suffix up to ngram).
  method "lookup_model"   prompt lookup where the last ngram tokens occurred
                          before, the draft model where it did not (the
                          draft catches up on what lookup rounds emitted).

Rollback is a change of lengths: after each round the target cache is set to
hold every token but the last, whatever the verify wrote past that is masked
and later overwritten. Rows advance by their own accepted counts.

A generation is two programs: `prefill` (the prompt in fixed-size chunks)
and `run` (the while_loop, resumable with a round limit, which is how
streaming works). Both are compiled per buffer width, a power of two: a new
prompt length within it compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import drafters
from jspec import model
from jspec import sampling
from jspec import sharding
from jspec import speculative

METHODS = ("target", "model", "prompt_lookup", "lookup_model")
DRAFT_METHODS = ("model", "lookup_model")  # the methods that run a draft model
LOOKUP_METHODS = ("prompt_lookup", "lookup_model")
POLICIES = ("fixed", "heuristic", "confidence")
STOPPING_POLICIES = ("confidence",)  # stop drafting on the draft's own probabilities
# Prompt tokens per prefill forward (`encode`); prompt widths are powers of
# two, so every width at least this is a multiple of it.
PREFILL_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class Spec:
  """Everything static about a generation (hashable: it keys the compile cache).

  Attributes:
    target: the target's arch (config and backend).
    draft: the draft's arch (methods in DRAFT_METHODS only).
    method: one of METHODS.
    sampling: sampling settings shared by target and draft.
    gamma_max: G, draft slots per round (shapes); 0 for method "target".
    gamma: starting speculation length (1..G).
    policy: "fixed" keeps gamma; "heuristic" does +2 after a fully accepted
      round and -1 otherwise (HF); "confidence" drafts up to G but stops a row
      once the draft's top probability is below `min_confidence`.
    min_confidence: threshold of the "confidence" policy.
    ngram: longest suffix prompt lookup matches (`drafters.prompt_lookup`).
    dynamic_verify: verify only as many positions as the round's longest
      counted draft needs (rounded up to a width in `verify_widths`) rather
      than always G + 1. The widths are static shapes, one compiled target
      forward each, picked by `lax.switch`: a round whose drafts stopped
      early (confidence policy) or found nothing to copy (prompt lookup)
      then pays for a narrow verify.

  The EOS tokens are data (`State.eos`), not part of the spec, so a new stop
  token does not mean a new compile; so are the temperature, the top_p value
  and min_confidence (`Knobs`), and programs are compiled for `program()`.
  """

  target: model.Arch
  draft: Optional[model.Arch] = None
  method: str = "model"
  sampling: sampling.Sampling = sampling.Sampling()
  gamma_max: int = 4
  gamma: int = 4
  policy: str = "fixed"
  min_confidence: float = 0.0
  ngram: int = 3
  dynamic_verify: bool = True

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"method={self.method!r}: expected one of {METHODS}")
    if self.policy not in POLICIES:
      raise ValueError(f"policy={self.policy!r}: expected one of {POLICIES}")
    if self.method == "target":
      if self.gamma_max != 0:
        raise ValueError("method 'target' drafts nothing: gamma_max must be 0")
    else:
      if not isinstance(self.gamma_max, int) or self.gamma_max < 1:
        raise ValueError(f"gamma_max={self.gamma_max!r}: expected an integer >= 1")
      if not 1 <= self.gamma <= self.gamma_max:
        raise ValueError(f"gamma={self.gamma!r}: expected 1 <= gamma <= gamma_max={self.gamma_max}")
    if self.method in DRAFT_METHODS and self.draft is None:
      raise ValueError(f"method {self.method!r} needs a draft config")
    if self.method in LOOKUP_METHODS and (not isinstance(self.ngram, int) or self.ngram < 1):
      raise ValueError(f"ngram={self.ngram!r}: expected an integer >= 1")
    if not 0.0 <= self.min_confidence <= 1.0:  # also refuses nan
      raise ValueError(f"min_confidence={self.min_confidence!r}: expected a probability in [0, 1]")

  def program(self) -> "Spec":
    """This spec with the settings that are data (`knobs`) replaced by placeholders.

    Two specs that differ only in temperature, top_p value or min_confidence
    have one `program()`, so they share their compiled programs.

    Returns:
      The spec to compile `prefill` and `run` for.
    """
    return dataclasses.replace(self, sampling=self.sampling.program(), min_confidence=0.0)

  def knobs(self) -> "Knobs":
    """The settings that reach the programs as data (see `program`).

    Returns:
      Knobs of [] float32 arrays.
    """
    # numpy scalars: jnp.float32 would compile a conversion in a new process.
    return Knobs(temperature=np.asarray(self.sampling.temperature, np.float32),
                 top_p=np.asarray(self.sampling.top_p, np.float32),
                 min_confidence=np.asarray(self.min_confidence, np.float32))


@chex.dataclass(frozen=True, mappable_dataclass=False)
class Knobs:
  """Settings the decode programs take as data, so that changing them compiles nothing.

  Attributes:
    temperature: [] float32 (ignored when the spec is greedy).
    top_p: [] float32 (ignored unless the spec's top_p is on).
    min_confidence: [] float32 (ignored unless the policy stops on confidence).
  """

  temperature: jax.Array
  top_p: jax.Array
  min_confidence: jax.Array


@chex.dataclass(frozen=True, mappable_dataclass=False)
class State:
  """What the decode loop carries from round to round.

  Attributes:
    target_cache: target KV cache, [L, B, S, K, H] buffers.
    draft_cache: draft KV cache (DRAFT_METHODS), else None.
    tokens: [B, W] int32 prompt followed by generated tokens.
    seq_len: [B] int32 valid tokens per row in `tokens`.
    prompt_len: [B] int32 prompt tokens per row.
    max_new: [B] int32 most tokens to generate per row.
    done: [B] bool row finished (EOS or max_new).
    eos: [E] int32 tokens that end a row (E may be 0).
    key: PRNG key; round r uses fold_in(key, r).
    rounds: [] int32 rounds run so far.
    gamma: [B] int32 speculation length for the next round.
    row_rounds: [B] int32 rounds in which the row was still active.
    drafted: [B] int32 drafts proposed (that counted).
    accepted: [B] int32 drafts accepted.
    hist: [B, G+1] int32 rounds by number of drafts accepted.
    gamma_trace: [B, R] int32 effective gamma of each round (R = W).
    draft_len: [B] int32 leading tokens of the row the draft cache holds
      (it lacks x_{n-1}, x_{n-2} after a round that accepted every draft
      it ran, and whatever prompt lookup rounds emitted).
    knobs: the generation's `Knobs`.
  """

  target_cache: cache_lib.KVCache
  draft_cache: Optional[cache_lib.KVCache]
  tokens: jax.Array
  seq_len: jax.Array
  prompt_len: jax.Array
  max_new: jax.Array
  done: jax.Array
  eos: jax.Array
  key: jax.Array
  rounds: jax.Array
  gamma: jax.Array
  row_rounds: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  hist: jax.Array
  gamma_trace: jax.Array
  draft_len: jax.Array
  knobs: Knobs


def buffer_width(prompt_len: int, max_new: int, gamma_max: int) -> int:
  """Slots per row for tokens and caches: a power of two with room for a full verify chunk at the end.

  Args:
    prompt_len: the longest prompt's tokens P.
    max_new: most tokens generated.
    gamma_max: G.

  Returns:
    The power of two W >= P + max_new + G + 2, so a chunk of G + 1 written
    at the last valid position never falls off (dynamic_update_slice would
    clamp it back over valid entries instead), and requests of other
    lengths share W, and so their programs.
  """
  need = prompt_len + max_new + gamma_max + 2
  return 1 << (need - 1).bit_length()


def verify_widths(spec: Spec) -> tuple[int, ...]:
  """The static verify widths a round can pick from (ascending; the last is G + 1).

  On two CPU cores a verify is bound by its multiply-adds, so each position
  costs (docs/decisions.md, "Verify width"): 2 and 3 cover the short rounds
  a low cap drafts, and 2^k + 1 the rest with a few compiled branches. Width
  1 (nothing drafted) only happens with prompt lookup: a draft model always
  counts its first draft.

  Args:
    spec: the generation's static settings.

  Returns:
    Widths T, each one target forward over T positions in the compiled round.
  """
  return verify_widths_for(spec.gamma_max, spec.dynamic_verify, spec.method == "prompt_lookup")


def verify_widths_for(gamma_max: int, dynamic_verify: bool = True,
                      prompt_lookup: bool = False) -> tuple[int, ...]:
  """`verify_widths` from the settings it reads, for replays that have no `Spec`.

  Args:
    gamma_max: the static bound on drafts a round.
    dynamic_verify: whether a round picks its width (else always G + 1).
    prompt_lookup: whether the drafter is prompt lookup (which adds width 1).

  Returns:
    The widths, ascending.
  """
  full = gamma_max + 1
  if not dynamic_verify or gamma_max == 0:
    return (full,)
  widths = {full, 2, 3} | {2**k + 1 for k in range(2, full.bit_length())}
  if prompt_lookup:
    widths.add(1)
  return tuple(sorted(w for w in widths if w <= full))


def verify(params, spec: Spec, chunk: jax.Array, tcache: cache_lib.KVCache,
            counted: jax.Array):
  """The target's verdict at every verify position, from the narrowest forward that covers them.

  Greedy, the verdict is each position's argmax token (`sampling.argmax`),
  taken inside the chosen width's branch: all the round needs
  (`speculative.accept_greedy`), and [B, G+1] tokens instead of G+1 rows of
  V logits to pad, mask and reduce.

  Args:
    params: target params.
    spec: static settings (`verify_widths`, whether greedy).
    chunk: [B, G+1] int32 [x_{n-1}, d_1 .. d_G] per row.
    tcache: target cache holding every token but x_{n-1}.
    counted: [B] int32 drafts that count per row (0 for finished rows).

  Returns:
    (verdict, cache): greedy, [B, G+1] int32 argmax tokens, else [B, G+1, V]
    logits. Positions past the chosen width repeat its last one: they lie
    past every row's counted drafts, so acceptance never uses them, and the
    cache slots they would have filled are past every row's new length
    (rolled back anyway).
  """
  widths = verify_widths(spec)
  full = chunk.shape[1]

  def verdict(tokens, tcache, **kwargs):
    logits, *rest = _target_forward(params, spec, tokens, tcache, **kwargs)
    if spec.sampling.greedy:
      logits = sampling.argmax(logits, spec.sampling)  # [B, T]
    return (logits, *rest)  # logits [B, T] or [B, T, V]

  if len(widths) == 1:
    return verdict(chunk, tcache)

  # The branches write the cache once, after the switch (`cache_lib.branch_result`).
  def branch(w: int):
    def fn(chunk, tcache):
      out, tcache, chunks = verdict(chunk[:, :w], tcache, write=False)
      pad = [(0, 0), (0, full - w)] + [(0, 0)] * (out.ndim - 2)
      return jnp.pad(out, pad, mode="edge"), cache_lib.branch_result(tcache, chunks, full)
    return fn

  out, result = jax.lax.switch(_width_index(widths, counted), [branch(w) for w in widths],
                               chunk, tcache)
  written = cache_lib.after_switch(tcache, result, tcache.lengths)
  return out, cache_lib.with_lengths(written, tcache.lengths + full)


def _target_forward(params, spec: Spec, tokens: jax.Array, tcache: cache_lib.KVCache,
                    **kwargs):
  """`model.forward` of the target, told when only the argmax of its logits is used (greedy)."""
  return model.forward(spec.target, params, tokens, tcache, greedy=spec.sampling.greedy,
                       vocab_limit=spec.sampling.vocab_limit, **kwargs)


def _target_logits(params, spec: Spec, x: jax.Array) -> jax.Array:
  """`model.logits` of the target, with `_target_forward`'s greedy settings."""
  return model.logits(spec.target, params, x, greedy=spec.sampling.greedy,
                      vocab_limit=spec.sampling.vocab_limit)


def _width_index(widths: tuple[int, ...], counted: jax.Array) -> jax.Array:
  """[] int32 index of the first width holding x_{n-1} and every row's counted drafts [B]."""
  index = jnp.searchsorted(jnp.asarray(widths, jnp.int32), jnp.max(counted) + 1)
  return jnp.minimum(index, len(widths) - 1)


def fill_verify(spec: Spec, counted: jax.Array, ready: jax.Array, done: jax.Array) -> jax.Array:
  """Counts the ready drafts that fit in the verify the round pays for anyway.

  The verify runs the narrowest compiled width holding every row's counted
  drafts plus x_{n-1} (`verify`), so its last positions may be spare. The
  draft model has often computed more drafts than it counted: the one whose
  low confidence stopped the row, or those a row ran while another row kept
  the loop going. Counting them into the spare positions costs no draft
  step and no wider verify, and can only add tokens: accepted, a draft
  emits one more; rejected, the round emits the same target token it would
  have emitted there anyway. The count depends on draft-side values only,
  so acceptance stays exact (any stopping rule that does not look at the
  target is allowed).

  Args:
    spec: static settings (`verify_widths`).
    counted: [B] int32 drafts counted per row.
    ready: [B] int32 drafts the draft model computed per row (>= counted).
    done: [B] bool finished rows (they neither count nor widen the verify).

  Returns:
    [B] int32 drafts to count: between `counted` and `ready`, at most the
    chosen width - 1.
  """
  widths = verify_widths(spec)
  width = jnp.asarray(widths, jnp.int32)[_width_index(widths, jnp.where(done, 0, counted))]
  return jnp.maximum(counted, jnp.minimum(ready, width - 1))


def _is_eos(tokens: jax.Array, eos: jax.Array) -> jax.Array:
  """tokens [...], eos [E] -> [...] bool."""
  return jnp.any(tokens[..., None] == eos, axis=-1)


def _write_rows(buf: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
  """buf [B, W], new [B, T], starts [B] -> buf with new[b] at starts[b]."""
  return jax.vmap(lambda r, n, s: jax.lax.dynamic_update_slice(r, n, (s,)))(buf, new, starts)


@functools.partial(jax.jit, static_argnames=("spec", "width"))
def prefill(target_params, draft_params, prompt: jax.Array, prompt_len: jax.Array,
            max_new: jax.Array, eos: jax.Array, key: jax.Array, knobs: Optional[Knobs] = None,
            *, spec: Spec, width: int) -> State:
  """Encodes the prompts and samples each row's first token from the target.

  Args:
    target_params: target params.
    draft_params: the draft's params (DRAFT_METHODS), else None.
    prompt: [B, P] int32 prompts, right-padded.
    prompt_len: [B] int32 real prompt lengths (1..P).
    max_new: [B] int32 tokens to generate per row (>= 1).
    eos: [E] int32 tokens that end a row.
    key: PRNG key of the whole generation.
    knobs: the settings that are data; None takes `spec.knobs()` (compiled
      in as constants: `jspec.generate` passes them, with `spec.program()`).
    spec: static generation settings.
    width: static W from `buffer_width`.

  Returns:
    The loop state after one generated token per row.
  """
  b, p_width = prompt.shape
  chex.assert_shape([prompt_len, max_new], (b,))
  if knobs is None:
    knobs = spec.knobs()
  samp = _sampling(spec, knobs)
  tcache = cache_lib.init(spec.target.cfg, b, width, spec.target.backend.dtype,
                          spec.target.placement)
  per_row = spec.target.placement is None  # on a mesh the rows are split over devices
  logits, tcache = encode(
      lambda *a, **k: _target_forward(target_params, spec, *a, **k), tcache, prompt, prompt_len,
      per_row=per_row, head=lambda x: _target_logits(target_params, spec, x))
  p = sampling.probs(logits, samp)
  first = sampling.sample(jax.random.fold_in(key, 0), p, samp)  # [B]
  tokens = jnp.zeros((b, width), jnp.int32).at[:, :p_width].set(prompt)
  tokens = _write_rows(tokens, first[:, None], prompt_len)

  dcache = None
  if spec.method in DRAFT_METHODS:
    dcache = cache_lib.init(spec.draft.cfg, b, width, spec.draft.backend.dtype,
                            spec.draft.placement)
    _, dcache = encode(lambda *a, **k: model.forward(spec.draft, draft_params, *a, **k), dcache,
                       prompt, prompt_len, per_row=per_row)

  g = spec.gamma_max
  zeros = jnp.zeros((b,), jnp.int32)
  return _placed(spec, State(
      target_cache=tcache, draft_cache=dcache, tokens=tokens, seq_len=prompt_len + 1,
      prompt_len=prompt_len, max_new=max_new,
      done=_is_eos(first, eos) | (max_new <= 1), eos=eos, key=key,
      rounds=jnp.int32(0), gamma=jnp.full((b,), spec.gamma if g else 0, jnp.int32),
      row_rounds=zeros, drafted=zeros, accepted=zeros,
      hist=jnp.zeros((b, g + 1), jnp.int32), gamma_trace=jnp.zeros((b, width), jnp.int32),
      draft_len=prompt_len, knobs=knobs))


def _placed(spec: Spec, state: State) -> State:
  """The loop state pinned to the mesh (rows over "data", caches as their models'); as is on one device.

  Pinning prefill's output and every round's keeps the while loop's carry
  in one layout, so the partitioner never moves a cache between rounds.
  """
  placement = spec.target.placement
  if placement is None:
    return state
  pin_cache = lambda c, p: None if c is None else c.replace(
      k=sharding.constrain_cache(c.k, p), v=sharding.constrain_cache(c.v, p),
      lengths=sharding.constrain(c.lengths, p, sharding.DATA))
  rows = sharding.constrain_rows
  return state.replace(
      target_cache=pin_cache(state.target_cache, placement),
      draft_cache=pin_cache(state.draft_cache, spec.draft.placement if spec.draft else None),
      tokens=rows(state.tokens, placement), seq_len=rows(state.seq_len, placement),
      prompt_len=rows(state.prompt_len, placement), max_new=rows(state.max_new, placement),
      done=rows(state.done, placement), gamma=rows(state.gamma, placement),
      row_rounds=rows(state.row_rounds, placement), drafted=rows(state.drafted, placement),
      accepted=rows(state.accepted, placement), hist=rows(state.hist, placement),
      gamma_trace=rows(state.gamma_trace, placement), draft_len=rows(state.draft_len, placement))


def encode(forward, cache: cache_lib.KVCache, prompt: jax.Array, prompt_len: jax.Array,
           chunk: int = PREFILL_CHUNK, per_row: bool = False, head=None):
  """Runs the prompts through a model in fixed-size chunks, inside one loop.

  The loop runs only as many chunks as the longest prompt fills, so a
  prompt costs its own length (rounded up to a chunk), and one compiled
  program serves every prompt length that fits the buffer
  (docs/decisions.md, "Chunked prefill"). With `per_row`, a batch runs one
  row at a time, each as far as its own prompt: prefill is compute-bound,
  so a batch then costs the sum of its prompts, not B times the longest
  (docs/decisions.md, "Serving batches"). The chunks return hidden states
  (`model.forward(..., head=False)`), and the head runs once, after the
  last chunk: the head is the largest matrix, read for one position.

  Args:
    forward: `model.forward` of the model, its arch and params bound:
      (tokens [B, T], cache, logits_at=, fresh=, head=False) ->
      (hidden [B, 1, D], cache).
    cache: the model's empty cache.
    prompt: [B, P] int32 prompts, right-padded; P a multiple of the chunk
      (or smaller than it).
    prompt_len: [B] int32 real prompt lengths (1..P).
    chunk: static tokens per forward.
    per_row: static; run the rows one after another (one device only: on
      a mesh the rows are split over devices).
    head: `model.logits` of the model, its arch and params bound: (hidden
      [B, 1, D]) -> [B, 1, V]; None when the logits are not wanted (a
      draft's prefill).

  Returns:
    (logits [B, V] float32 at each row's last prompt token, or None
    without `head`; the cache holding each row's prompt).
  """
  # No row here must equal a one-row step's bit for bit (every mode prefills
  # alike), so the block products may take AMX tiles.
  with cpu_kernels.any_order():
    return _encode(forward, cache, prompt, prompt_len, chunk, per_row, head)


def _encode(forward, cache: cache_lib.KVCache, prompt: jax.Array, prompt_len: jax.Array,
            chunk: int, per_row: bool, head):
  """`encode` (same args and returns)."""
  if per_row and prompt.shape[0] > 1:
    return _encode_rows(forward, cache, prompt, prompt_len, chunk, head)
  b, p_width = prompt.shape
  chunk = min(chunk, p_width)
  if p_width % chunk:
    raise ValueError(f"prompt width {p_width} is not a multiple of the prefill chunk {chunk}")
  last = prompt_len - 1  # [B]
  # The first chunk finds every cache empty: it attends to itself only.
  hidden, cache = forward(prompt[:, :chunk], cache,
                          logits_at=jnp.clip(last, 0, chunk - 1)[:, None], fresh=True,
                          head=False)  # [B, 1, D]

  def body(i, carry):
    hidden, cache = carry
    start = i * chunk
    tokens = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)  # [B, C]
    # Every row writes at `start`: a row whose prompt ended earlier writes
    # padding past its length, which the final lengths roll back.
    step, cache = forward(tokens, cache_lib.with_lengths(cache, jnp.full((b,), start)),
                          logits_at=jnp.clip(last - start, 0, chunk - 1)[:, None], head=False)
    here = (last >= start) & (last < start + chunk)  # [B] the row's last token is in this chunk
    return jnp.where(here[:, None, None], step, hidden), cache

  chunks = (jnp.max(prompt_len) + chunk - 1) // chunk
  hidden, cache = jax.lax.fori_loop(1, chunks, body, (hidden, cache))
  logits = None if head is None else head(hidden)[:, 0]  # [B, V]
  return logits, cache_lib.with_lengths(cache, prompt_len)


def _encode_rows(forward, cache: cache_lib.KVCache, prompt: jax.Array, prompt_len: jax.Array,
                 chunk: int, head):
  """`encode` of each row alone, written into the batch's cache (same args and returns).

  A row's forward is the batched one's with one row: the kernels, the norms
  and attention compute each row the same whatever the others are, so the
  logits and the cache are bit for bit the batched prefill's.
  """
  b = prompt.shape[0]

  def one(r, cache):  # row r alone: its prompt [1, P] and its slice of the cache
    row_cache = cache_lib.KVCache(
        k=jax.lax.dynamic_slice_in_dim(cache.k, r, 1, axis=1),
        v=jax.lax.dynamic_slice_in_dim(cache.v, r, 1, axis=1),
        lengths=jax.lax.dynamic_slice_in_dim(cache.lengths, r, 1))
    return encode(forward, row_cache, jax.lax.dynamic_slice_in_dim(prompt, r, 1),
                  jax.lax.dynamic_slice_in_dim(prompt_len, r, 1), chunk, head=head)

  def put(cache, row_cache, r):
    return cache_lib.KVCache(
        k=jax.lax.dynamic_update_slice_in_dim(cache.k, row_cache.k, r, axis=1),
        v=jax.lax.dynamic_update_slice_in_dim(cache.v, row_cache.v, r, axis=1),
        lengths=cache.lengths)

  if head is None:
    cache = jax.lax.fori_loop(0, b, lambda r, cache: put(cache, one(r, cache)[1], r), cache)
    return None, cache_lib.with_lengths(cache, prompt_len)

  logits_shape = jax.eval_shape(one, 0, cache)[0]  # [1, V]
  logits = jnp.zeros((b,) + logits_shape.shape[1:], logits_shape.dtype)  # [B, V]

  def body(r, carry):
    logits, cache = carry
    row_logits, row_cache = one(r, cache)
    logits = jax.lax.dynamic_update_slice_in_dim(logits, row_logits, r, axis=0)
    return logits, put(cache, row_cache, r)

  logits, cache = jax.lax.fori_loop(0, b, body, (logits, cache))
  return logits, cache_lib.with_lengths(cache, prompt_len)


def _sampling(spec: Spec, knobs: Knobs) -> sampling.Traced:
  """The spec's sampling structure with the knobs' temperature and top_p."""
  return spec.sampling.traced(knobs.temperature, knobs.top_p)


def _round(target_params, draft_params, state: State, spec: Spec) -> State:
  """One draft / verify / accept / roll-back round for every row."""
  g = spec.gamma_max
  b = state.tokens.shape[0]
  vocab = spec.target.cfg.vocab_size
  key = jax.random.fold_in(state.key, state.rounds + 1)
  draft_key, accept_key = jax.random.split(key)
  samp = _sampling(spec, state.knobs)

  # 1. Draft.
  dcache = state.draft_cache
  if spec.method in DRAFT_METHODS:
    drafts, q, gamma_eff, steps, used_model, dcache = _draft_with_model(
        draft_params, state, spec, draft_key, vocab)
    gamma_eff = fill_verify(spec, gamma_eff, jnp.where(used_model, steps, gamma_eff), state.done)
  elif spec.method == "prompt_lookup":
    drafts, q, gamma_eff = drafters.prompt_lookup(
        state.tokens, state.seq_len, state.gamma, g, spec.ngram, vocab)
  else:
    drafts = jnp.zeros((b, 0), jnp.int32)
    q = jnp.zeros((b, 0, vocab), jnp.float32)
    gamma_eff = jnp.zeros((b,), jnp.int32)
  chex.assert_shape(drafts, (b, g))
  chex.assert_shape(q, (b, g, vocab))
  chex.assert_shape(gamma_eff, (b,))

  # 2. Verify [x_{n-1}, d_1 .. d_G] in one target forward.
  # The target cache already holds every token but the last (step 5).
  last = jnp.take_along_axis(state.tokens, (state.seq_len - 1)[:, None], axis=1)  # [B, 1]
  verdict, tcache = verify(target_params, spec, jnp.concatenate([last, drafts], axis=1),
                            state.target_cache, jnp.where(state.done, 0, gamma_eff))

  # 3. Accept.
  if spec.sampling.greedy:  # verdict: [B, G+1] the target's argmax tokens
    n, next_token = speculative.accept_greedy(drafts, verdict, gamma_eff)
  else:  # verdict: [B, G+1, V] logits
    p = sampling.probs(verdict, samp)
    n, next_token = speculative.accept(accept_key, drafts, q, p, gamma_eff, samp)
  chex.assert_shape([n, next_token], (b,))
  pos = jnp.arange(g + 1)[None]  # [1, G+1]
  block = jnp.where(pos < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), next_token[:, None])

  # 4. Emit: stop at the first EOS in the block and at max_new.
  eos = _is_eos(block, state.eos) & (pos <= n[:, None])
  hit_eos = jnp.any(eos, axis=1)
  n_emit = jnp.where(hit_eos, jnp.argmax(eos, axis=1) + 1, n + 1)
  room = state.max_new - (state.seq_len - state.prompt_len)
  n_emit = jnp.where(state.done, 0, jnp.minimum(n_emit, room))
  tokens = _write_rows(state.tokens, block, state.seq_len)
  seq_len = state.seq_len + n_emit
  done = state.done | hit_eos | (n_emit >= room)

  # 5. Roll back: the target holds all tokens but the last (the draft is
  # rolled back at the start of its next round, to what it holds).
  tcache = cache_lib.with_lengths(tcache, seq_len - 1)
  draft_len = state.draft_len
  if spec.method in DRAFT_METHODS:
    # A lookup row's draft holds its tokens up to x_{n-1} if the draft ran
    # this round (its catch-up feeds every row), else what it held before.
    draft_len = jnp.where(used_model, drafters.held_after(state.seq_len, n, steps),
                          jnp.where(steps > 0, state.seq_len, state.draft_len))

  active = (~state.done).astype(jnp.int32)
  gamma = state.gamma
  if spec.policy == "heuristic":
    gamma = jnp.clip(gamma + jnp.where(n == gamma_eff, 2, -1), 1, g)
  return _placed(spec, state.replace(
      target_cache=tcache, draft_cache=dcache, tokens=tokens, seq_len=seq_len, done=done,
      rounds=state.rounds + 1, gamma=jnp.where(state.done, state.gamma, gamma),
      row_rounds=state.row_rounds + active,
      drafted=state.drafted + active * gamma_eff,
      accepted=state.accepted + active * n,
      hist=state.hist + active[:, None] * jax.nn.one_hot(n, g + 1, dtype=jnp.int32),
      gamma_trace=_trace(state, gamma_eff), draft_len=draft_len))


def _draft_with_model(draft_params, state: State, spec: Spec, key: jax.Array, vocab: int):
  """Drafts with the draft model, or (method "lookup_model") only where prompt lookup finds nothing.

  Args:
    draft_params: the draft's params.
    state: loop state.
    spec: static settings.
    key: PRNG key for the drafts.
    vocab: the target's vocabulary size.

  Returns:
    (drafts [B, G], q [B, G, V], gamma_eff [B], steps [] int32 draft forwards
    run (0 if the draft did not run), used_model [B] bool rows drafted by the
    draft model, draft cache).
  """
  g = spec.gamma_max
  min_confidence = state.knobs.min_confidence if spec.policy in STOPPING_POLICIES else 0.0
  widths = drafters.catch_up_widths(g, spec.method == "lookup_model")

  def run_model(gamma):
    return drafters.draft_model(
        spec.draft, draft_params, state.draft_cache, state.tokens, state.seq_len, gamma, key,
        _sampling(spec, state.knobs), g, vocab, min_confidence, state.draft_len, widths)

  if spec.method == "model":
    drafts, q, gamma_eff, steps, dcache = run_model(state.gamma)
    return drafts, q, gamma_eff, steps, jnp.ones_like(state.done), dcache
  # Only a full-length match drafts by lookup, else the draft model: with
  # shorter matches counted nearly every round would copy (any token seen
  # before is a 1-gram match), and the draft model would rarely run.
  l_drafts, l_q, l_gamma = drafters.prompt_lookup(
      state.tokens, state.seq_len, state.gamma, g, spec.ngram, vocab, min_ngram=spec.ngram)
  use_model = (l_gamma == 0) & ~state.done

  def with_model(_):
    # Rows that have lookup drafts ask for one model draft: they never keep
    # the draft loop going (their catch-up still runs, batch-wide).
    return run_model(jnp.where(use_model, state.gamma, 1))

  def without(_):
    return (jnp.zeros_like(l_drafts), jnp.zeros_like(l_q), jnp.zeros_like(l_gamma),
            jnp.int32(0), state.draft_cache)

  m_drafts, m_q, m_gamma, steps, dcache = jax.lax.cond(jnp.any(use_model), with_model, without,
                                                       None)
  drafts = jnp.where(use_model[:, None], m_drafts, l_drafts)
  q = jnp.where(use_model[:, None, None], m_q, l_q)
  gamma_eff = jnp.where(use_model, m_gamma, l_gamma)
  return drafts, q, gamma_eff, steps, use_model, dcache


def _trace(state: State, gamma_eff: jax.Array) -> jax.Array:
  """Records each active row's effective gamma at its own round index."""
  idx = jnp.minimum(state.row_rounds, state.gamma_trace.shape[1] - 1)
  vals = jnp.where(state.done, jnp.take_along_axis(state.gamma_trace, idx[:, None], 1)[:, 0],
                   gamma_eff)
  return _write_rows(state.gamma_trace, vals[:, None], idx)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def run(target_params, draft_params, state: State, round_limit: jax.Array, *,
        spec: Spec) -> State:
  """Runs rounds until every row is done or `round_limit` rounds have run in total.

  Args:
    target_params: target params.
    draft_params: the draft's params (DRAFT_METHODS), else None.
    state: loop state from `prefill` or a previous `run`.
    round_limit: [] int32 stop once state.rounds reaches it (streaming
      dispatches a few rounds at a time; `generate` passes a bound no
      generation reaches).
    spec: static generation settings.

  Returns:
    The state after the last round run.
  """
  def cond(s: State):
    return jnp.any(~s.done) & (s.rounds < round_limit)

  return jax.lax.while_loop(cond, lambda s: _round(target_params, draft_params, s, spec), state)
