"""The public entry points: `generate` and `stream` over a loaded model pair.

Host work happens here and only here: tokenize, validate, bucket and pad the
prompts, fetch (or compile once) the two XLA programs, run them, detokenize.
The decode loop itself never returns to Python between rounds.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Any, Callable, Generator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jspec import config as config_lib
from jspec import cpu_kernels
from jspec import decode
from jspec import fetch
from jspec import greedy_head
from jspec import layout
from jspec import program_store
from jspec import quant
from jspec import sampling

Prompt = Union[str, Sequence[int]]

# Prompt widths and generation lengths are rounded up to these buckets so a
# new prompt length reuses an already compiled program.
_MIN_BUCKET = 16
MAX_BATCH = 64

# Chosen by `python -m bench` on the real pair (bench/results/HISTORY.md,
# policies_cpu.json and gamma_sweep_cpu.json; README "Results"): over the
# code prompts, drafting up to 8 tokens while the draft's top probability is
# at least 0.5 had the best median speedup of the policies measured. (Those
# runs predate the greedy fix in `drafters._top_prob`, when greedy rounds
# always drafted 8; re-checked after it on five code prompts by hand, 0.5
# still had the best median of thresholds 0.2-0.7, not by a bench command.)
DEFAULT_POLICY = "confidence"
DEFAULT_GAMMA = {"fixed": 4, "heuristic": 4, "confidence": 8, "cumulative": 16}
# method "lookup_model" with a stopping policy: a copied span costs one verify
# however long it is, so a round may copy up to 16 tokens (the model's own
# drafts still stop on confidence). Measured on the real pair by
# `python -m bench` (bench/results/HISTORY.md, interleaved_cpu.json): the edit
# prompt took 12 rounds instead of 19 at 8 (prefill_cpu.json), and the code prompts'
# median speedup was the default's (2.77x against 2.74x).
DEFAULT_LOOKUP_MODEL_GAMMA = 16


@dataclasses.dataclass
class Model:
  """One model: its config and params pytree (on device)."""

  cfg: config_lib.Qwen2Config
  params: Any


@dataclasses.dataclass
class Bundle:
  """What `jspec.load` returns and `generate` takes: target, optional draft, tokenizer.

  Attributes:
    target: the model whose distribution is sampled.
    draft: the small draft model, or None (prompt lookup and target-only still work).
    tokenizer: text <-> ids (a `jspec.tokenizer.Tokenizer`), or None for id-only use.
    vocab_limit: ids at or past this are embedding padding, never sampled
      (set by `check_pair`); None when target and draft use every row.
    reload_draft: reads the draft's float params again from their file (set
      by `jspec.load`). With it the bundle frees the float draft once its
      int8 copy is made, since the int8 draft is all that CPU decoding reads
      by default, and reads the float one back only when a float draft is
      asked for. None keeps the float draft.
  """

  target: Model
  draft: Optional[Model] = None
  tokenizer: Any = None
  vocab_limit: Optional[int] = None
  reload_draft: Optional[Callable[[], Any]] = None

  def __post_init__(self):
    if self.draft is not None and self.vocab_limit is None:
      self.vocab_limit = check_pair(self.target.cfg, self.draft.cfg, self.tokenizer)
    self._draft_weights: dict[tuple[Optional[int], bool], decode.DraftWeights] = {}
    self._draft_int8: Any = None

  def draft_weights(self, draft_vocab: Optional[int], int8: bool = False) -> decode.DraftWeights:
    """The draft's params, optionally int8, with its output head cut to the first `draft_vocab` ids.

    The int8 copy and each cut are made once and kept, so the compiled
    program reads only V' x D head weights per draft step.

    Args:
      draft_vocab: rows of the draft head to keep; None keeps the full head.
      int8: use the draft's int8 copy (`jspec.quant`), made on first use.

    Returns:
      The `decode.DraftWeights` the decode programs take.
    """
    if self.draft is None:
      raise ValueError("this bundle has no draft model")
    cfg = self.draft.cfg
    if draft_vocab is not None and (not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool)
                                    or not 1 <= draft_vocab <= cfg.vocab_size):
      raise ValueError(f"draft_vocab={draft_vocab!r}: expected an integer in [1, {cfg.vocab_size}] "
                       "or None for the full head")
    if draft_vocab == cfg.vocab_size:
      draft_vocab = None
    if (draft_vocab, int8) not in self._draft_weights:
      if int8:
        if self._draft_int8 is None:
          self._draft_int8 = quant.quantize(self._float_draft())
          if platform(self) == "cpu" and cpu_kernels.int8_available():
            quant.pack(self._draft_int8)  # for jspec's int8 kernel (`jspec.cpu_kernels`)
          self._drop_float_draft()
        params = self._draft_int8
      else:
        params = self._float_draft()
      head = None
      if draft_vocab is not None:
        head = _head_rows(params, cfg, draft_vocab)
      self._draft_weights[(draft_vocab, int8)] = decode.DraftWeights(params, head)
    return self._draft_weights[(draft_vocab, int8)]

  def _float_draft(self) -> Any:
    """The draft's float params, read back from their file if they were freed."""
    if self.draft.params is None:
      self.draft.params = self.reload_draft()
    return self.draft.params

  def _drop_float_draft(self) -> None:
    """Frees the float draft (2.5 GB for the real pair) when it can be read back."""
    if self.reload_draft is None or self.draft.params is self.target.params:
      return
    # Cached float views (a cut head over the float table) would keep it alive.
    for key in [k for k in self._draft_weights if not k[1]]:
      del self._draft_weights[key]
    self.draft.params = None

  def prepare_draft(self, draft_vocab: Optional[int], int8: bool) -> float:
    """Makes `draft_weights(draft_vocab, int8)` ready (see there).

    Returns:
      Seconds spent (0 when it was ready already).
    """
    t0 = time.perf_counter()
    # Work is making the int8 copy, reading back a freed float draft, or
    # cutting a head; a float draft in memory needs none.
    fresh = ((int8 and self._draft_int8 is None) or (not int8 and self.draft.params is None)
             or (draft_vocab is not None and (draft_vocab, int8) not in self._draft_weights))
    self.draft_weights(draft_vocab, int8)
    return time.perf_counter() - t0 if fresh else 0.0

  def lay_out_target(self, kind: str) -> float:
    """Stores the target's dense weights the given way round (`jspec.layout`), in place.

    A float32 target laid out "packed" also gets the int8 copy of its head
    that greedy steps read (`jspec.greedy_head`; 0.23 GB for the real 1.5B).

    Args:
      kind: a `jspec.layout.LAYOUTS` entry ("packed" for jspec's CPU
        kernel, "rows" for one row per step, "cols" for verifies and
        batches, without it).

    Returns:
      Seconds spent (0 when the target was laid out so already).
    """
    params = self.target.params
    wanted = kind == "packed" and greedy_head.ENABLED
    panels = greedy_head.table(params) if wanted else None
    if layout.of(params) == kind and (panels is None) == (greedy_head.PARAM not in params):
      return 0.0
    t0 = time.perf_counter()
    params.pop(greedy_head.PARAM, None)  # made for the packed head, and only kept with it
    self.target.params = params = layout.convert(params, kind)
    panels = greedy_head.table(params) if wanted else None
    if panels is not None:  # the int8 copy greedy steps read (`jspec.greedy_head`)
      params[greedy_head.PARAM] = greedy_head.make(panels)
    return time.perf_counter() - t0


def _head_rows(params, cfg: config_lib.Qwen2Config, rows: int):
  """A copy of the first `rows` rows of a model's output table ([V', D], or a `quant.Table`)."""
  if quant.is_quantized(params):
    table = quant.output_table(params, cfg.tie_word_embeddings)
    if isinstance(table, quant.PackedTable):  # the cut head runs through XLA's dot
      q = table.rows(jnp.arange(rows), cfg.hidden_size)
      return quant.Table(q, jnp.array(table.scale[:rows]))
    return quant.Table(jnp.array(table.q[:rows]), jnp.array(table.scale[:rows]))
  if "panels" in params["embed_tokens"] or "lm_head_panels" in params:  # a draft that is the target
    panels = params["embed_tokens"]["panels"] if cfg.tie_word_embeddings else params["lm_head_panels"]
    return cpu_kernels.unpack_table(panels)[:rows]
  table = params["embed_tokens"]["embedding"] if cfg.tie_word_embeddings else params["lm_head"]
  return jnp.array(table[:rows])  # a copy: not a view of the full table


def platform(bundle: Bundle) -> str:
  """The platform ("cpu", "gpu", ...) the bundle's target params live on.

  Params given as numpy arrays run on the default backend.
  """
  leaf = jax.tree.leaves(bundle.target.params)[0]
  if isinstance(leaf, jax.Array):
    return next(iter(leaf.devices())).platform
  return jax.default_backend()


def draft_int8_default(where: str) -> bool:
  """Whether the draft runs in int8 unless told otherwise: on CPU, yes.

  On XLA CPU an int8 draft step costs about half an fp32 one and its
  proposals agree with the target as often (README "Design measurements");
  the output stays exactly the target's either way. Other devices keep the
  draft's own dtype: the int8 path was measured on CPU only.

  Args:
    where: the params' platform (`platform`).

  Returns:
    True for int8.
  """
  return where == "cpu"


def target_layout(method: str, batch: int, platform: str = "cpu") -> str:
  """The target layout that decodes fastest for a method, batch size and device.

  On CPU with jspec's kernel available (`jspec.cpu_kernels`), "packed"
  for everything: on the AVX-512 host every row count a decode step or
  verify uses ran faster than XLA's dot in either layout, and on the AVX2
  host a target step by [out, in] rows took 1.03x / 1.48x / 1.27x / 1.07x
  as long as packed at 1 / 3 / 9 / 17 rows, timed call by call (README
  "Design measurements"; `python -m bench.forward_cost --paired
  packed,rows --target-t 1,3,9,17 --reps 20`).
  Without it, target-only decoding of one prompt multiplies one row per
  step, where [out, in] ("rows") matrices read fastest (about 12% per
  step); every other method verifies several positions per step, and a
  batch multiplies several rows, where [in, out] ("cols") is fastest by
  far. Other devices keep "cols": the choice was measured on XLA CPU only.

  Args:
    method: a `decode.METHODS` entry.
    batch: prompts per call.
    platform: the platform of the target's params ("cpu", "gpu", ...).

  Returns:
    "rows", "cols" or "packed".
  """
  if platform != "cpu":
    return "cols"
  if cpu_kernels.available():
    return "packed"
  return "rows" if method == "target" and batch == 1 else "cols"


def check_pair(target: config_lib.Qwen2Config, draft: config_lib.Qwen2Config,
               tokenizer: Any = None) -> Optional[int]:
  """Checks that a draft can speak for a target: same vocabulary, maybe padded.

  Args:
    target: target config.
    draft: draft config.
    tokenizer: the shared tokenizer, if any (its size is the real vocabulary).

  Returns:
    The number of real tokens when one table is padded past it (those
    padding rows are then masked out of both p and q), else None.

  Raises:
    ValueError: the vocabularies differ beyond padding.
  """
  real = getattr(tokenizer, "vocab_size", None)
  if target.vocab_size == draft.vocab_size and (real is None or real >= target.vocab_size):
    return None
  shared = min(target.vocab_size, draft.vocab_size)
  if real is None or real > shared:
    raise ValueError(
        f"draft vocabulary ({draft.vocab_size} rows) does not match the target's "
        f"({target.vocab_size} rows)" + (f" for a tokenizer of {real} tokens" if real else "")
        + "; a draft must share the target's tokenizer")
  return real


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


def _bucket(n: int) -> int:
  return max(_MIN_BUCKET, 1 << (n - 1).bit_length())


def _prefill_bucket(n: int) -> int:
  """The padded prompt width prefill computes: `n` rounded up to an eighth of its `_bucket`.

  Prefill costs in proportion to the positions it computes, and with the
  CPU kernels a long prompt's prefill is a large part of a generation (a
  317-token prompt padded to 512 was half of a speculative run's time), so
  it is padded to at most 1/8 (at least 16) past its length, not to the
  next power of two. Only prefill is compiled per such width: the decode
  loop's buffers still follow `_bucket`, so its program is shared.

  Args:
    n: the longest prompt's length.

  Returns:
    The prompt width, at most `_bucket(n)`.
  """
  step = max(_MIN_BUCKET, _bucket(n) // 8)
  return -(-n // step) * step


def _encode(bundle: Bundle, prompt: Prompt) -> list[int]:
  if isinstance(prompt, str):
    if bundle.tokenizer is None:
      raise ValueError("a text prompt needs a tokenizer; this bundle has none (pass token ids)")
    if not prompt:
      raise ValueError("empty prompt: expected at least one character")
    return list(bundle.tokenizer.encode(prompt))
  try:
    ids = [int(t) for t in prompt]
  except (TypeError, ValueError):
    raise ValueError(f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}") from None
  if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
    raise ValueError("prompt token ids must be integers")
  return ids


def _spec(bundle: Bundle, method: str, temperature: float, top_k: int, top_p: float,
          gamma: Optional[int], gamma_max: Optional[int], policy: str, min_confidence: float,
          ngram: int) -> decode.Spec:
  # EOS ids are data (State.eos): strip them from the static configs so that
  # a new stop token reuses the compiled program.
  t_cfg = dataclasses.replace(bundle.target.cfg, eos_token_ids=())
  samp = sampling.Sampling(float(temperature), top_k, float(top_p), bundle.vocab_limit)
  if method == "target":
    return decode.Spec(t_cfg, None, "target", samp, 0, 0, "fixed", 0.0, 3)
  if method in decode.DRAFT_METHODS and bundle.draft is None:
    raise ValueError(f"method {method!r} needs a draft model; load one or use "
                     "method='prompt_lookup'")
  if policy not in decode.POLICIES:
    raise ValueError(f"policy={policy!r}: expected one of {decode.POLICIES}")
  if gamma is None:
    gamma = DEFAULT_GAMMA[policy]
    if method == "lookup_model" and policy in decode.STOPPING_POLICIES:
      gamma = max(gamma, DEFAULT_LOOKUP_MODEL_GAMMA)
  if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
    raise ValueError(f"gamma={gamma!r}: expected an integer >= 1")
  g_max = gamma if gamma_max is None else gamma_max
  if policy == "heuristic" and gamma_max is None:
    g_max = max(gamma, 8)
  if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)):
    raise ValueError(f"min_confidence={min_confidence!r}: expected a probability in [0, 1]")
  if policy in decode.STOPPING_POLICIES:
    # These policies draft up to gamma while the draft stays sure:
    # gamma is its cap, and verify width G + 1 should match it.
    gamma = g_max
  draft_cfg = (dataclasses.replace(bundle.draft.cfg, eos_token_ids=())
               if method in decode.DRAFT_METHODS else None)
  return decode.Spec(t_cfg, draft_cfg, method, samp, g_max, gamma, policy,
                     float(min_confidence), ngram)


def enable_persistent_cache() -> None:
  """Points JAX's persistent compilation cache at `<jspec cache>/xla` (once).

  A second process then loads the compiled programs instead of compiling
  them again. A cache directory the user configured already is left alone;
  JSPEC_XLA_CACHE=0 turns this off. The cache only saves time, so a
  directory that cannot be created is warned about once and programs are
  compiled without it.
  """
  if not program_store.caching_on() or jax.config.jax_compilation_cache_dir:
    return
  try:
    xla_dir = fetch.cache_dir() / "xla"
    try:
      xla_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
      raise fetch.FetchError(f"cannot create the compilation cache directory {xla_dir} "
                             f"({err.strerror or type(err).__name__})") from None
  except fetch.FetchError as err:
    program_store.warn_once("xla-cache", f"{err}; compiling without a persistent cache")
    return
  jax.config.update("jax_compilation_cache_dir", str(xla_dir))
  # The tiny programs of tests compile in well under a second; cache what matters.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  try:
    tempfile.TemporaryFile(dir=xla_dir).close()
  except OSError as err:  # read-only: JAX would warn about every entry it fails to write
    program_store.warn_once("xla-cache", f"the compilation cache directory {xla_dir} is not "
                            f"writable ({err.strerror or type(err).__name__}); reading compiled "
                            "programs from it without adding any")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))


class _Programs:
  """Compiled prefill/run executables, keyed by spec and shapes (compile once)."""

  def __init__(self):
    self.cache: dict[Any, Any] = {}
    self.jitted: list[Any] = []  # the jitted callables behind them, whose caches hold them too
    self.compiles = 0  # how many programs this process compiled (tests read it)
    self.stored = 0  # how many of those it lowered from `program_store` instead of tracing

  def get(self, name: str, fn, args, static: dict, donate_argnums: tuple[int, ...] = ()):
    key = (name, tuple(sorted(static.items())), jax.tree.map(
        lambda x: (x.shape, x.dtype) if hasattr(x, "shape") else x, args))
    key = (key[0], key[1], str(key[2]))
    if key not in self.cache:
      enable_persistent_cache()
      t0 = time.perf_counter()
      compiled, jitted, stored = program_store.compile_program(name, fn, args, static,
                                                               donate_argnums)
      self.cache[key] = compiled
      self.jitted.append(jitted)
      self.compiles += 1
      self.stored += stored
      return self.cache[key], time.perf_counter() - t0
    return self.cache[key], 0.0

  def clear(self) -> None:
    """Drops every compiled program here and in JAX's caches, so that its memory is freed.

    JAX's caches of the two jitted functions (trace -> HLO -> executable)
    keep each executable alive as well: emptying `self.cache` alone frees
    nothing.
    """
    self.cache.clear()
    for jitted in self.jitted + [decode.prefill, decode.run]:
      jitted.clear_cache()
    self.jitted.clear()


PROGRAMS = _Programs()


def release_programs() -> None:
  """Frees every compiled program; a later `generate` compiles again (or loads the persistent cache).

  Programs are kept per spec and shapes, and on CPU one prefill/run pair of
  the real pair holds about 150 MB of executable: a process that goes
  through many settings or prompt-length buckets piles up gigabytes unless
  it releases the ones it is done with.
  """
  PROGRAMS.clear()


@dataclasses.dataclass
class _Prepared:
  spec: decode.Spec
  draft_vocab: Optional[int]
  draft_int8: bool
  prompts: list[list[int]]
  prompt: jax.Array  # [B, P]
  prompt_len: jax.Array  # [B]
  max_new: jax.Array  # [B]
  eos: jax.Array  # [E]
  width: int
  key: jax.Array
  relayout_s: float
  quantize_s: float


def _prepare(bundle: Bundle, prompt, max_new_tokens, temperature, top_k, top_p, gamma,
             gamma_max, method, policy, min_confidence, ngram, seed, stop_at_eos,
             draft_vocab, draft_int8) -> _Prepared:
  if method not in decode.METHODS:
    raise ValueError(f"method={method!r}: expected one of {decode.METHODS}")
  if isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], (int, np.integer))):
    prompts = [prompt]
  else:
    prompts = list(prompt)
    if not prompts:
      raise ValueError("empty batch: expected at least one prompt")
    if len(prompts) > MAX_BATCH:
      raise ValueError(f"batch of {len(prompts)} prompts exceeds the maximum of {MAX_BATCH}")
    for i, item in enumerate(prompts):
      if not isinstance(item, (str, list, tuple, np.ndarray)):
        raise ValueError(f"batch item {i} is a {type(item).__name__}: expected a string or token ids")
  ids = [_encode(bundle, p) for p in prompts]
  if any(len(i) == 0 for i in ids):
    raise ValueError("empty prompt: expected at least one token")
  vocab = bundle.vocab_limit or bundle.target.cfg.vocab_size
  for row in ids:
    bad = [t for t in row if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
  if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
  longest = max(len(i) for i in ids)
  context = bundle.target.cfg.max_position_embeddings
  if longest + max_new_tokens > context:
    raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds "
                     f"the model's context of {context} tokens")
  spec = _spec(bundle, method, temperature, top_k, top_p, gamma, gamma_max, policy,
               min_confidence, ngram)
  eos = ()
  if stop_at_eos:
    eos = tuple(getattr(bundle.tokenizer, "eos_token_ids", ()) or bundle.target.cfg.eos_token_ids)
  p_width = _prefill_bucket(longest)
  width = decode.buffer_width(_bucket(longest), _bucket(max_new_tokens), spec.gamma_max)
  padded = np.zeros((len(ids), p_width), np.int32)
  for r, row in enumerate(ids):
    padded[r, :len(row)] = row
  where = platform(bundle)
  if draft_int8 is None:
    draft_int8 = draft_int8_default(where)
  elif not isinstance(draft_int8, bool):
    raise ValueError(f"draft_int8={draft_int8!r}: expected True, False or None (the device's default)")
  quantize_s = 0.0
  if method in decode.DRAFT_METHODS:  # validates draft_vocab before any compute
    quantize_s = bundle.prepare_draft(draft_vocab, draft_int8)
  relayout_s = bundle.lay_out_target(target_layout(method, len(ids), where))
  return _Prepared(spec, draft_vocab, draft_int8, ids, jnp.asarray(padded), jnp.asarray([len(i) for i in ids], jnp.int32),
                   jnp.full((len(ids),), max_new_tokens, jnp.int32),
                   jnp.asarray(eos, jnp.int32).reshape(-1), width,
                   jax.random.key(int(seed)), relayout_s, quantize_s)


def _programs(bundle: Bundle, prep: _Prepared, state_like=None):
  dparams = (bundle.draft_weights(prep.draft_vocab, prep.draft_int8)
             if prep.spec.method in decode.DRAFT_METHODS else None)
  # Programs are compiled for the spec's program structure; the temperature,
  # top_p and min_confidence travel as data (`decode.Knobs`), so changing
  # them compiles nothing.
  spec = prep.spec.program()
  args = (bundle.target.params, dparams, prep.prompt, prep.prompt_len, prep.max_new, prep.eos,
          prep.key, prep.spec.knobs())
  pre, t_pre = PROGRAMS.get("prefill", decode.prefill, args, {"spec": spec, "width": prep.width})
  state_shape = pre.out_info  # the loop's input is prefill's output: no second trace
  run, t_run = PROGRAMS.get("run", decode.run,
                            (bundle.target.params, dparams, state_shape, jnp.int32(0)),
                            {"spec": spec}, donate_argnums=(2,))  # run donates its state
  return dparams, pre, run, t_pre + t_run


def _stats(state: decode.State, row: int, n_new: int, compile_s: float, prep: _Prepared,
           prefill_s: float, decode_s: float) -> dict[str, Any]:
  rounds = int(state.row_rounds[row])
  drafted, accepted = int(state.drafted[row]), int(state.accepted[row])
  return {
      "new_tokens": n_new,
      "rounds": rounds,
      "drafted": drafted,
      "accepted": accepted,
      "acceptance_rate": accepted / drafted if drafted else float("nan"),
      # The prefill emits the first token; every round emits the rest.
      "mean_tokens_per_round": (n_new - 1) / rounds if rounds else float("nan"),
      "accepted_histogram": np.asarray(state.hist[row]).tolist(),
      "gamma_trace": np.asarray(state.gamma_trace[row, :rounds]).tolist(),
      "compile_s": compile_s,
      "relayout_s": prep.relayout_s,
      "quantize_s": prep.quantize_s,
      "draft_int8": prep.draft_int8 if prep.spec.method in decode.DRAFT_METHODS else None,
      "prefill_s": prefill_s,
      "decode_s": decode_s,
      "tokens_per_s": n_new / (prefill_s + decode_s) if prefill_s + decode_s > 0 else float("nan"),
  }


def _decode_text(bundle: Bundle, ids: list[int]) -> Optional[str]:
  return None if bundle.tokenizer is None else bundle.tokenizer.decode(ids)


def generate(bundle: Bundle, prompt: Union[Prompt, Sequence[Prompt]], *,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, method: str = "model", gamma: Optional[int] = None,
             gamma_max: Optional[int] = None, policy: str = DEFAULT_POLICY,
             min_confidence: float = 0.5, ngram: int = 3, seed: int = 0,
             stop_at_eos: bool = True,
             draft_vocab: Optional[int] = None,
             draft_int8: Optional[bool] = None) -> Union[Result, list[Result]]:
  """Generates a continuation of one prompt or a batch of prompts.

  Args:
    bundle: target (+ draft) and tokenizer, from `jspec.load`.
    prompt: a string, a sequence of token ids, or a list of either (a batch;
      rows may differ in length and each advances by its own accepted count).
    max_new_tokens: tokens to generate per row (fewer if EOS comes first).
    temperature: 0 for greedy, else the sampling temperature.
    top_k: keep the k most likely tokens (0: off).
    top_p: nucleus mass (1: off).
    method: "model" (draft model), "prompt_lookup" (n-gram copy, no draft
      model), "lookup_model" (n-gram copy where the last n-gram occurred
      before, the draft model elsewhere: for edits that repeat their input),
      or "target" (the target alone: the baseline). For one prompt on
      CPU, "target" stores the target's dense weights [out, in] and the other
      methods [in, out], each the faster way for its work (`jspec.layout`):
      the bundle's target params are converted in place, which takes a few
      seconds for the real target when the method changes.
    gamma: drafts per round: the fixed value, the heuristic's start, the
      confidence and cumulative policies' cap (default: `DEFAULT_GAMMA` of
      the policy; at least `DEFAULT_LOOKUP_MODEL_GAMMA` for "lookup_model"
      with those two policies).
    gamma_max: static bound on gamma (default: gamma; 8 for the heuristic).
    policy: "fixed", "heuristic" (+2 / -1), "confidence" (stop drafting
      when the draft's top probability < min_confidence; the default, chosen
      by the benchmark on the real pair: see README "Results") or
      "cumulative" (stop when the product of the round's top probabilities
      < min_confidence; up to 16 drafts by default).
    min_confidence: threshold of the "confidence" and "cumulative" policies.
    ngram: longest suffix prompt lookup matches (it falls back to shorter
      ones, drafting half as many per token shorter; `lookup_model` copies
      only after a full match).
    seed: one seed reproduces one generation exactly.
    stop_at_eos: end a row at the tokenizer's (or config's) EOS tokens.
    draft_vocab: the draft proposes only token ids below this (its output
      head cut to those rows: a cheaper draft step; still exact, since q is
      then 0 elsewhere). None: the full head.
    draft_int8: run the draft with int8 weights and activations
      (`jspec.quant`): about half the cost of an fp32 draft step on CPU,
      and the output is still exactly the target's, since q is the int8
      draft's own distribution. None: `draft_int8_default` of the device
      (True on CPU). The int8 copy is made once per bundle, on first use.

  Returns:
    A `Result` for one prompt, a list of them for a batch. `stats` holds
    new_tokens, rounds, drafted, accepted, acceptance_rate,
    mean_tokens_per_round, accepted_histogram, gamma_trace, compile_s,
    relayout_s (time spent laying out the target, see `method`),
    quantize_s (time spent getting the draft's weights ready: the int8 copy
    on first use, or reading back a float draft the bundle freed),
    draft_int8 (whether the draft ran in int8; None when no draft model
    ran),
    prefill_s, decode_s and tokens_per_s (new tokens over prefill + decode,
    compile, relayout and quantization excluded).
  """
  single = isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], (int, np.integer)))
  prep = _prepare(bundle, prompt, max_new_tokens, temperature, top_k, top_p, gamma, gamma_max,
                  method, policy, min_confidence, ngram, seed, stop_at_eos, draft_vocab,
                  draft_int8)
  dparams, pre, run, compile_s = _programs(bundle, prep)
  t0 = time.perf_counter()
  state = pre(bundle.target.params, dparams, prep.prompt, prep.prompt_len, prep.max_new, prep.eos,
              prep.key, prep.spec.knobs())
  jax.block_until_ready(state.tokens)
  t1 = time.perf_counter()
  state = run(bundle.target.params, dparams, state, jnp.int32(np.iinfo(np.int32).max))
  tokens = np.asarray(state.tokens)
  t2 = time.perf_counter()
  results = []
  for r, ids in enumerate(prep.prompts):
    start, end = len(ids), int(state.seq_len[r])
    new = tokens[r, start:end].tolist()
    results.append(Result(_decode_text(bundle, new), new,
                          _stats(state, r, len(new), compile_s, prep, t1 - t0, t2 - t1)))
  return results[0] if single else results


def stream(bundle: Bundle, prompt: Prompt, *, rounds_per_dispatch: int = 4,
           **kwargs) -> Generator[tuple[str, list[int]], None, dict[str, Any]]:
  """Yields (text, ids) pieces of one prompt's continuation as rounds finish.

  The compiled loop runs `rounds_per_dispatch` rounds per call and resumes
  from the returned state, so the pieces concatenate to exactly what
  `generate` returns for the same arguments and seed. Text is yielded only
  up to the last complete character: a multi-byte character split across
  tokens waits for its last byte.

  Args:
    bundle: target (+ draft) and tokenizer.
    prompt: one string or sequence of token ids.
    rounds_per_dispatch: rounds per device call (>= 1).
    **kwargs: the keyword options of `generate`.

  Yields:
    (new text, new token ids) since the previous piece; text is "" without a tokenizer.

  Returns:
    The stats dict of `generate` (the generator's return value, e.g. through
    `stats = yield from stream(...)`); prefill_s and decode_s are wall time
    and so include the caller's time between pieces.
  """
  if not isinstance(rounds_per_dispatch, int) or rounds_per_dispatch < 1:
    raise ValueError(f"rounds_per_dispatch={rounds_per_dispatch!r}: expected an integer >= 1")
  if not (isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], (int, np.integer)))):
    raise ValueError("stream takes one prompt (a string or token ids), not a batch")
  defaults = dict(max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, gamma=None,
                  gamma_max=None, method="model", policy=DEFAULT_POLICY, min_confidence=0.5,
                  ngram=3, seed=0, stop_at_eos=True, draft_vocab=None, draft_int8=None)
  unknown = set(kwargs) - set(defaults)
  if unknown:
    raise TypeError(f"stream() got unexpected keyword arguments {sorted(unknown)}")
  opts = {**defaults, **kwargs}
  prep = _prepare(bundle, prompt, **opts)
  dparams, pre, run, compile_s = _programs(bundle, prep)
  t0 = time.perf_counter()
  state = pre(bundle.target.params, dparams, prep.prompt, prep.prompt_len, prep.max_new, prep.eos,
              prep.key, prep.spec.knobs())
  start = len(prep.prompts[0])
  emitted_ids, emitted_text = start, ""
  limit = 0
  prefill_s = None
  while True:
    seq_len = int(state.seq_len[0])
    if prefill_s is None:
      prefill_s = time.perf_counter() - t0
    if seq_len > emitted_ids or bool(state.done[0]):
      all_new = np.asarray(state.tokens[0, start:seq_len]).tolist()
      text = _decode_text(bundle, all_new) or ""
      if not bool(state.done[0]) and text.endswith("\ufffd"):
        text = text[:-1]  # an incomplete UTF-8 sequence: wait for its last byte
      piece_ids = all_new[emitted_ids - start:]
      if text.startswith(emitted_text):
        piece, emitted_text = text[len(emitted_text):], text
      else:
        piece, emitted_text = "", emitted_text
      if piece_ids or piece:
        yield piece, piece_ids
      emitted_ids = seq_len
    if bool(state.done[0]):
      return _stats(state, 0, seq_len - start, compile_s, prep, prefill_s,
                    time.perf_counter() - t0 - prefill_s)
    limit += rounds_per_dispatch
    state = run(bundle.target.params, dparams, state, jnp.int32(limit))
