"""The public entry points: `generate` and `stream` over a prepared model pair.

Host work happens here and only here: tokenize, validate, bucket and pad the
prompts, fetch (or compile once) the two XLA programs, run them, detokenize.
The decode loop itself never returns to Python between rounds.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Generator, Optional, Sequence, Union

import jax
import numpy as np

from jspec import bundle as bundle_lib
from jspec import decode
from jspec import draft_vocab as draft_vocab_lib
from jspec import mesh as mesh_lib
from jspec import options as options_lib
from jspec import programs

Prompt = Union[str, Sequence[int]]

# Prompt widths and generation lengths are rounded up to these buckets so a
# new prompt length reuses an already compiled program.
MIN_BUCKET = 16


@dataclasses.dataclass
class Result:
  """One row's generation.

  Attributes:
    text: decoded new text (None without a tokenizer).
    token_ids: the new token ids.
    stats: counts and timings (see `generate`).
  """

  text: Optional[str]
  token_ids: list[int]
  stats: dict[str, Any]


def bucket(n: int) -> int:
  """`n` rounded up to a power of two (at least `MIN_BUCKET`)."""
  return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def widths(longest: int, max_new: int, gamma_max: int) -> tuple[int, int]:
  """The padded prompt width and the buffer width of a request: both the same power of two.

  Only the buffer width selects the compiled programs (with the batch size
  and the static settings): the prompt is padded to it and prefill runs it
  in chunks as far as the longest prompt goes (`decode.encode`), so a new
  prompt length compiles nothing unless prompt and new tokens together
  outgrow the power of two (docs/decisions.md, "One program for every
  prompt length").

  Args:
    longest: tokens in the longest prompt.
    max_new: most new tokens of a row.
    gamma_max: the most drafts a round verifies.

  Returns:
    (prompt width, buffer width W).
  """
  width = decode.buffer_width(longest, max_new, gamma_max)
  return width, width


def seed_key(seed: int) -> jax.Array:
  """`jax.random.key(seed)`, made on the host: `key` compiles a program of its own.

  Args:
    seed: an integer in [0, 2**32 - 1] (`Options` checks it).

  Returns:
    The typed key; the same as `jax.random.key(seed)`.
  """
  if jax.config.jax_default_prng_impl != "threefry2x32":
    return jax.random.key(seed)
  # threefry's seed with 32-bit ints: [0, seed] as uint32 (`prng.threefry_seed`).
  return jax.random.wrap_key_data(np.asarray([0, seed], np.uint32), impl="threefry2x32")


def is_single(prompt: Any) -> bool:
  """Whether `prompt` is one prompt (text or token ids) rather than a batch of them."""
  if isinstance(prompt, str):
    return True
  try:
    return len(prompt) > 0 and isinstance(prompt[0], (int, np.integer))
  except TypeError:
    return True  # not a sequence: `encode` says what is wrong with it


def encode(bundle: bundle_lib.Bundle, prompt: Prompt) -> list[int]:
  """One prompt's token ids, checked against the vocabulary.

  Args:
    bundle: gives the tokenizer (text prompts) and the vocabulary.
    prompt: a string, or a sequence of token ids.

  Returns:
    The ids.

  Raises:
    ValueError: an empty or unusable prompt (the message says which).
  """
  if isinstance(prompt, str):
    if bundle.tokenizer is None:
      raise ValueError("a text prompt needs a tokenizer; this bundle has none (pass token ids)")
    if not prompt:
      raise ValueError("empty prompt: expected at least one character")
    try:
      prompt.encode("utf-8")
    except UnicodeEncodeError as err:
      raise ValueError(f"prompt is not valid Unicode text: {err.reason} at position "
                       f"{err.start} ({prompt[err.start:err.end]!r})") from None
    ids = list(bundle.tokenizer.encode(prompt))
  elif isinstance(prompt, (list, tuple, np.ndarray)):
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
      raise ValueError("prompt token ids must be integers")
    ids = [int(t) for t in prompt]
  else:
    raise ValueError(f"prompt must be a string or a sequence of token ids, got "
                     f"{type(prompt).__name__}")
  if not ids:
    raise ValueError("empty prompt: expected at least one token")
  vocab = bundle.vocab_limit or bundle.target.cfg.vocab_size
  bad = [t for t in ids if not 0 <= t < vocab]
  if bad:
    raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
  return ids


@dataclasses.dataclass
class Request:
  """A batch ready to run: the spec, the padded inputs, and the compiled programs.

  Attributes:
    spec: what the programs are compiled for (`decode.Spec`).
    prompts: each row's prompt ids.
    args: prefill's positional arguments.
    prefill, run: the compiled programs (`run` takes the round limit as an int).
    compile_s: seconds spent compiling the prefill now (0 when it was ready);
      `compile_seconds` adds the loop's, which may still be compiling.
    host: the state as numpy for reading results (gathered across processes
      on a mesh), or None to read the device state itself (one device).
  """

  spec: decode.Spec
  prompts: list[list[int]]
  args: tuple
  prefill: Any
  run: Any
  compile_s: float
  host: Any = None

  def compile_seconds(self) -> float:
    """Seconds spent compiling both programs now: waits for a loop still compiling."""
    run = self.run.seconds() if isinstance(self.run, programs.Pending) else 0.0
    return self.compile_s + run


def request(bundle: bundle_lib.Bundle, prompt: Union[Prompt, Sequence[Prompt]],
            options: options_lib.Options) -> Request:
  """Checks a prompt (or batch) against a bundle and gets its programs ready.

  Args:
    bundle: the prepared pair.
    prompt: one prompt or a list of them.
    options: the checked options.

  Returns:
    The `Request`.

  Raises:
    ValueError: bad prompts, or options the bundle cannot serve.
  """
  if prompt is None:
    raise ValueError("prompt is None: expected a string, token ids, or a list of them")
  if is_single(prompt):
    prompts = [prompt]
  else:
    prompts = list(prompt)
    if not prompts:
      raise ValueError("empty batch: expected at least one prompt")
    if len(prompts) > options_lib.MAX_BATCH:
      raise ValueError(f"batch of {len(prompts)} prompts exceeds the maximum of "
                       f"{options_lib.MAX_BATCH}")
  ids = [encode(bundle, p) for p in prompts]
  placement = bundle.target.placement
  mesh_lib.check_batch(len(ids), placement)
  longest = max(len(i) for i in ids)
  context = bundle.target.cfg.max_position_embeddings
  if longest + options.max_new_tokens > context:
    raise ValueError(f"prompt of {longest} tokens + max_new_tokens={options.max_new_tokens} "
                     f"exceeds the model's context of {context} tokens")
  spec = options.spec(bundle.target.arch, bundle.draft.arch if bundle.draft else None,
                      bundle.vocab_limit)
  eos = ()
  if options.stop_at_eos:
    eos = tuple(getattr(bundle.tokenizer, "eos_token_ids", ()) or bundle.target.cfg.eos_token_ids)
  p_width, width = widths(longest, options.max_new_tokens, spec.gamma_max)
  padded = np.zeros((len(ids), p_width), np.int32)
  for r, row in enumerate(ids):
    padded[r, :len(row)] = row
  draft_params = bundle.draft.params if spec.draft is not None else None
  if draft_params is not None and placement is None:  # a mesh keeps the params it placed
    draft_params = draft_vocab_lib.with_prompt_ids(draft_params, bundle.draft.cfg.vocab_size, ids)
  # Host arrays, not jnp ones: each jnp call here would compile a small
  # program of its own in a new process, before the first token.
  args = (bundle.target.params, draft_params, padded,
          np.asarray([len(i) for i in ids], np.int32),
          np.full((len(ids),), options.max_new_tokens, np.int32),
          np.asarray(eos, np.int32).reshape(-1), seed_key(options.seed), spec.knobs())
  # Programs are compiled for the spec's program structure; the temperature,
  # top_p and min_confidence travel as data (`decode.Knobs`), so changing
  # them compiles nothing.
  program = spec.program()
  if placement is not None:
    return _mesh_request(spec, ids, mesh_lib.put_inputs(args, placement), width, placement)
  pre, t_pre = programs.PROGRAMS.get("prefill", decode.prefill, args,
                                     {"spec": program, "width": width})
  # The loop's input is prefill's output: no second trace. It donates its state.
  # The loop compiles in the background while the prefill runs: the first
  # token waits for the prefill's program only (docs/decisions.md, "Fast start").
  run = programs.PROGRAMS.get_later("run", decode.run, (args[0], args[1], pre.out_info,
                                                       np.int32(0)),
                                    {"spec": program}, donate_argnums=(2,))
  return Request(spec, ids, args, pre, run, t_pre)


def _mesh_request(spec: decode.Spec, ids: list[list[int]], args: tuple, width: int,
                  placement) -> Request:
  """`request`'s programs for a bundle on a mesh (`jspec.mesh`): the same two, partitioned."""
  program = spec.program()
  pre, t_pre = mesh_lib.PROGRAMS.get("prefill", decode.prefill, args,
                                     {"spec": program, "width": width})
  run, t_run = mesh_lib.PROGRAMS.get("run", decode.run, (args[0], args[1], pre.out_info,
                                                        mesh_lib.scalar(0, placement)),
                                     {"spec": program})
  def limited(target_params, draft_params, state, limit):
    return run(target_params, draft_params, state,
               mesh_lib.scalar(min(int(limit), np.iinfo(np.int32).max), placement))

  limited.compiled = run  # the executable itself (its HLO, its memory analysis)
  return Request(spec, ids, args, pre, limited, t_pre + t_run, host=mesh_lib.to_host)


def _wait_for_loop(req: Request) -> float:
  """Waits for a loop program still compiling in the background; returns the seconds waited.

  The loop compiles while the prefill runs (`programs.Programs.get_later`);
  what is left of that compile after the prefill is compile time, and
  counting it as decode time would make a request's first run of a new
  buffer width look slow.
  """
  if not isinstance(req.run, programs.Pending):
    return 0.0
  start = time.perf_counter()
  req.run.program()
  return time.perf_counter() - start


def _stats(state: decode.State, row: int, n_new: int, compile_s: float, prefill_s: float,
           decode_s: float) -> dict[str, Any]:
  # Leaves to the host first: indexing device arrays compiles small programs.
  rounds = int(np.asarray(state.row_rounds)[row])
  drafted, accepted = int(np.asarray(state.drafted)[row]), int(np.asarray(state.accepted)[row])
  return {
      "new_tokens": n_new,
      "rounds": rounds,
      "drafted": drafted,
      "accepted": accepted,
      "acceptance_rate": accepted / drafted if drafted else float("nan"),
      # The prefill emits the first token; every round emits the rest.
      "mean_tokens_per_round": (n_new - 1) / rounds if rounds else float("nan"),
      "accepted_histogram": np.asarray(state.hist)[row].tolist(),
      "gamma_trace": np.asarray(state.gamma_trace)[row, :rounds].tolist(),
      "compile_s": compile_s,
      "prefill_s": prefill_s,
      "decode_s": decode_s,
      "tokens_per_s": n_new / (prefill_s + decode_s) if prefill_s + decode_s > 0 else float("nan"),
  }


def _text(bundle: bundle_lib.Bundle, ids: list[int]) -> Optional[str]:
  return None if bundle.tokenizer is None else bundle.tokenizer.decode(ids)


def generate(bundle: bundle_lib.Bundle, prompt: Union[Prompt, Sequence[Prompt]],
             options: Optional[options_lib.Options] = None,
             **kwargs) -> Union[Result, list[Result]]:
  """Generates a continuation of one prompt or a batch of prompts.

  Args:
    bundle: target (+ draft) and tokenizer, from `jspec.load`.
    prompt: a string, a sequence of token ids, or a list of either (a batch;
      rows may differ in length and each advances by its own accepted count).
    options: a `jspec.Options` (None: the defaults).
    **kwargs: fields of `jspec.Options` (max_new_tokens, temperature,
      top_k, top_p, method, gamma, gamma_max, policy, min_confidence,
      ngram, seed, stop_at_eos), replacing those of `options`.

  Returns:
    A `Result` for one prompt, a list of them for a batch. `stats` holds
    new_tokens, rounds, drafted, accepted, acceptance_rate,
    mean_tokens_per_round, accepted_histogram, gamma_trace, compile_s,
    prefill_s, decode_s and tokens_per_s (new tokens over prefill +
    decode; compile time excluded).

  Raises:
    ValueError: a bad prompt or option (before anything runs).
    TypeError: an unknown option name.
  """
  opts = options_lib.make(options, **kwargs)
  req = request(bundle, prompt, opts)
  t0 = time.perf_counter()
  state = req.prefill(*req.args)
  jax.block_until_ready(state.tokens)
  t1 = time.perf_counter()
  t1 += _wait_for_loop(req)  # compiling is not decoding
  state = req.run(req.args[0], req.args[1], state, np.int32(np.iinfo(np.int32).max))
  if req.host is not None:
    state = req.host(state)
  tokens, seq_len = np.asarray(state.tokens), np.asarray(state.seq_len)
  t2 = time.perf_counter()
  results = []
  for r, ids in enumerate(req.prompts):
    new = tokens[r, len(ids):int(seq_len[r])].tolist()
    results.append(Result(_text(bundle, new), new,
                          _stats(state, r, len(new), req.compile_seconds(), t1 - t0, t2 - t1)))
  return results[0] if is_single(prompt) else results


def stream(bundle: bundle_lib.Bundle, prompt: Prompt,
           options: Optional[options_lib.Options] = None, *, rounds_per_dispatch: int = 4,
           **kwargs) -> Generator[tuple[str, list[int]], None, dict[str, Any]]:
  """Yields (text, ids) pieces of one prompt's continuation as rounds finish.

  The compiled loop runs `rounds_per_dispatch` rounds per call and resumes
  from the returned state, so the pieces concatenate to exactly what
  `generate` returns for the same options. Text is yielded only up to the
  last complete character: a multi-byte character split across tokens
  waits for its last byte.

  Args:
    bundle: target (+ draft) and tokenizer.
    prompt: one string or sequence of token ids.
    options: a `jspec.Options` (None: the defaults).
    rounds_per_dispatch: rounds per device call (>= 1).
    **kwargs: fields of `jspec.Options`, replacing those of `options`.

  Yields:
    (new text, new token ids) since the previous piece; text is "" without a tokenizer.

  Returns:
    The stats dict of `generate` (the generator's return value, e.g. through
    `stats = yield from stream(...)`); prefill_s and decode_s are wall time
    and so include the caller's time between pieces.
  """
  if (not isinstance(rounds_per_dispatch, int) or isinstance(rounds_per_dispatch, bool)
      or rounds_per_dispatch < 1):
    raise ValueError(f"rounds_per_dispatch={rounds_per_dispatch!r}: expected an integer >= 1")
  if prompt is not None and not is_single(prompt):
    raise ValueError("stream takes one prompt (a string or token ids), not a batch")
  opts = options_lib.make(options, **kwargs)
  req = request(bundle, prompt, opts)
  t0 = time.perf_counter()
  state = req.prefill(*req.args)
  start = len(req.prompts[0])
  emitted_ids, emitted_text = start, ""
  limit = 0
  prefill_s = None
  waited = 0.0  # seconds spent waiting for the loop's compile: neither prefill nor decode
  while True:
    shown = state if req.host is None else req.host(state)
    # Whole small leaves to the host, then numpy indexing: indexing the
    # device arrays would compile programs of their own. A leaf read so is
    # not donated to the next call (a copy of [B] or [B, W] int32), the
    # caches still are.
    seq_len = int(np.asarray(shown.seq_len)[0])
    if prefill_s is None:
      prefill_s = time.perf_counter() - t0
    done = bool(np.asarray(shown.done)[0])
    if seq_len > emitted_ids or done:
      all_new = np.asarray(shown.tokens)[0, start:seq_len].tolist()
      text = _text(bundle, all_new) or ""
      if not done and text.endswith("\ufffd"):
        text = text[:-1]  # an incomplete UTF-8 sequence: wait for its last byte
      piece_ids = all_new[emitted_ids - start:]
      if text.startswith(emitted_text):
        piece, emitted_text = text[len(emitted_text):], text
      else:
        piece = ""
      if piece_ids or piece:
        yield piece, piece_ids
      emitted_ids = seq_len
    if done:
      return _stats(shown, 0, seq_len - start, req.compile_seconds(), prefill_s,
                    time.perf_counter() - t0 - prefill_s - waited)
    if limit == 0:
      waited = _wait_for_loop(req)
    limit += rounds_per_dispatch
    state = req.run(req.args[0], req.args[1], state, np.int32(limit))
