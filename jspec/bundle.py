"""A model pair ready to generate: configs, backends and weights in their stored forms, decided once.

`prepare` decides how each matrix is stored (`jspec.weights`) from the
device and the settings: on CPU with jspec's kernels built, float32
matrices go into kernel panels and the target gets its greedy head
(`jspec.greedy_head`); the draft runs in int8 on CPU. Nothing changes a
prepared bundle afterwards: `generate` only reads it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from convert import config as config_lib
from jspec import cpu_kernels
from jspec import draft_vocab as draft_vocab_lib
from jspec import greedy_head
from jspec import model
from jspec import sharding
from jspec import weights


@dataclasses.dataclass(frozen=True)
class Settings:
  """How models are prepared; fixed at load (`jspec.load`) and then part of every program key.

  Attributes:
    kernels: run jspec's CPU kernels (`jspec.cpu_kernels`). None: on CPU
      wherever they build.
    draft_int8: store the draft's matrices in int8 (a cheaper proposer;
      the output stays the target's). None: on CPU.
    target_int8: store the target's matrices in int8 with a scale per
      output, multiplied with float32 activations (`weights.to_int8_blocks`).
      Lossy: the output is then no longer exactly the checkpoint's
      model (`bench.tools.target_int8` measures by how much), so it is
      an explicit opt-in for checkpoints that exact storage cannot shrink
      (float32).
    greedy_head: give a float32 kernel-stored target the int8 copy of its
      head that greedy steps read (`jspec.greedy_head`).
    fused_attention: with the kernels, attend over the caches in place
      (`jspec.cpu_attention`).
    scan_layers: with the kernels, run the layers as one loop (one layer
      compiled per forward, not L).
    draft_vocab: K: the draft's head keeps only the rows of the K most
      frequent tokens and the special ones (`jspec.draft_vocab`), a
      cheaper draft step; lossless, as the draft's q is then zero outside
      them. 0: the whole vocabulary. None: `jspec.draft_vocab.DEFAULT`
      rows where the draft's vocabulary is larger and its tokenizer ranks
      the ids, else the whole vocabulary.
    draft_int4: store the draft's matrices in 4 bits, a scale and an
      offset per output and block of 32 inputs: fewer bytes per draft
      step; lossless, as the output stays the target's. Where the CPU has
      AVX-512 VNNI they are multiplied on int8 activations by the int4
      kernel (`weights.to_int4_panels`), else on float32 ones by the block
      kernel (`weights.to_int4_blocks`). True needs jspec's CPU kernels.
      None: on where the int4 kernel runs and `draft_int8` is None (a
      cheaper draft step than int8 there, where the float block form is
      not), else off.
  """

  kernels: Optional[bool] = None
  draft_int8: Optional[bool] = None
  target_int8: bool = False
  greedy_head: bool = True
  fused_attention: bool = True
  scan_layers: bool = True
  draft_vocab: Optional[int] = None
  draft_int4: Optional[bool] = None

  def __post_init__(self):
    object.__setattr__(self, "draft_vocab", draft_vocab_lib.check(self.draft_vocab))
    for name in ("kernels", "draft_int8", "draft_int4"):
      if not any(getattr(self, name) is v for v in (None, True, False)):  # 1 == True: not a bool
        raise ValueError(f"{name}={getattr(self, name)!r}: expected True, False or None "
                         "(the device's default)")
    for name in ("target_int8", "greedy_head", "fused_attention", "scan_layers"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False")
    if self.draft_int4 and self.draft_int8 is not None:
      raise ValueError(f"draft_int4=True with draft_int8={self.draft_int8}: expected draft_int8 "
                       "None (the 4-bit draft replaces the int8 or float one)")
    if self.draft_int4 and self.kernels is False:
      raise ValueError("draft_int4=True with kernels=False: expected kernels True or None "
                       "(the 4-bit draft runs on jspec's CPU kernels)")


def draft_int4(settings: Settings, kernels: bool) -> bool:
  """Whether a draft prepared with `settings` is stored in 4 bits.

  Args:
    settings: the load-time choices.
    kernels: whether jspec's CPU kernels run the draft.

  Returns:
    `settings.draft_int4` where it is set; for None, whether the int4
    kernel runs here and the int8 draft was not asked for by name
    (`draft_int8` None): on int8 activations the 4-bit step is the
    cheaper one, on the float block kernel it is not.
  """
  if settings.draft_int4 is not None:
    return settings.draft_int4
  return settings.draft_int8 is None and kernels and cpu_kernels.int4_available()


@dataclasses.dataclass(frozen=True)
class Model:
  """One prepared model.

  Attributes:
    cfg: its config.
    params: its params tree (`jspec.model`), matrices in their stored forms.
    backend: how it runs (`model.Backend`).
    placement: where its params live on a mesh (`jspec.mesh.shard`); None on one device.
  """

  cfg: config_lib.Qwen2Config
  params: Any
  backend: model.Backend = model.Backend()
  placement: Optional[sharding.Placement] = None

  @property
  def arch(self) -> model.Arch:
    """The static part (config, backend and placement) that programs are compiled for."""
    return model.Arch(self.cfg, self.backend, self.placement)


@dataclasses.dataclass(frozen=True)
class Bundle:
  """What `jspec.load` returns and `generate` takes: target, optional draft, tokenizer.

  Attributes:
    target: the model whose distribution is sampled.
    draft: the small draft model, or None (prompt lookup and target-only still work).
    tokenizer: text <-> ids (a `jspec.tokenizer.Tokenizer`), or None for id-only use.
    vocab_limit: ids at or past this are embedding padding, never sampled
      (`check_pair`); None when target and draft use every row.
  """

  target: Model
  draft: Optional[Model] = None
  tokenizer: Any = None
  vocab_limit: Optional[int] = None

  def __post_init__(self):
    if self.draft is not None and self.vocab_limit is None:
      object.__setattr__(self, "vocab_limit",
                         check_pair(self.target.cfg, self.draft.cfg, self.tokenizer))


def platform_of(params: Any) -> str:
  """The platform ("cpu", "gpu", ...) params live on; numpy arrays run on the default one."""
  for leaf in jax.tree.leaves(params):
    if isinstance(leaf, jax.Array):
      return next(iter(leaf.devices())).platform
  return jax.default_backend()


def _convert_leaves(params: dict, convert_leaf, consume: bool, first: Sequence[str] = ()) -> dict:
  """A copy of a params tree with every weight leaf converted, one at a time.

  With `consume`, each source leaf leaves `params` as soon as its
  replacement exists, so memory grows by one matrix, not by the model.
  A source may be numpy views of a mapped file (`jspec.loading`): what a
  conversion keeps as it is becomes a device array here, so that no view
  outlives its turn. `first` names top-level keys converted before the
  rest (a mapped matrix already read goes first, so its pages go first).
  """
  out = {}
  for key in [k for k in first if k in params] + [k for k in params if k not in first]:
    value = params[key]
    if isinstance(value, dict):
      out[key] = _convert_leaves(value, convert_leaf, consume)
    elif weights.is_leaf(value):
      out[key] = jax.tree.map(jnp.asarray, convert_leaf(value))
    else:
      out[key] = jnp.asarray(value) if value is not None else None
    if consume:
      del params[key]
  return out


def _uniform_layers(layers: dict) -> dict:
  """The layers with each matrix in one stored form across all of them (`weights.uniform`)."""
  names = list(layers)
  flat, trees = zip(*(jax.tree.flatten(layers[n], is_leaf=weights.is_leaf) for n in names))
  if len(set(trees)) != 1:
    raise ValueError("the layers' params differ in structure")
  columns = [weights.uniform(column) if weights.is_leaf(column[0]) else list(column)
             for column in zip(*flat)]
  return {n: jax.tree.unflatten(trees[0], [c[i] for c in columns]) for i, n in enumerate(names)}


def _for_kernels(w: weights.Leaf) -> weights.Leaf:
  """A float matrix stored for jspec's kernels, keeping the checkpoint's own numbers.

  float32 goes into float32 panels; bfloat16 into bfloat16 panels and int8
  blocks stay as they are (both widen exactly in the kernel).
  """
  if isinstance(w, (weights.Dense, weights.Table)):
    dtype = (w.w if isinstance(w, weights.Dense) else w.t).dtype
    if dtype == jnp.bfloat16:
      return weights.to_bf16_panels(w)
    if dtype == jnp.float32:
      return weights.to_panels(w)
  return w


def prepare(cfg: config_lib.Qwen2Config, params: dict, role: str = "target",
            settings: Settings = Settings(), consume: bool = False,
            tokenizer: Any = None, ranking: Optional[Sequence[int]] = None) -> Model:
  """Stores a model's matrices the way its role and device run them fastest.

  Args:
    cfg: the model's config.
    params: its params tree with float matrices (`model.init_params`, or
      a loaded checkpoint).
    role: "target" or "draft" (a draft is 4-bit by default where the int4
      kernel runs and int8 elsewhere on CPU (`draft_int4`): its output is
      exact either way; a target only with `target_int8`, which is lossy;
      only a target gets a greedy head).
    settings: the load-time choices.
    consume: empty `params` as it goes (loading: peak memory is then the
      model plus one matrix); otherwise it is left as it was.
    tokenizer: the pair's tokenizer (or a future of it, waited for only
      where the draft's vocabulary is cut): a draft's ranking is counted
      with it and its special ids are kept (`settings.draft_vocab`).
    ranking: the draft's ids most frequent first, instead of the
      tokenizer's (None and no tokenizer: the ids in order, and by default
      the full head).

  Returns:
    The prepared `Model`.

  Raises:
    ValueError: an unknown role, kernels asked for where they cannot run
      (or a 4-bit draft where they do not), or a draft_vocab past the
      vocabulary.
  """
  if role not in ("target", "draft"):
    raise ValueError(f"role={role!r}: expected 'target' or 'draft'")
  where = platform_of(params)
  kernels = settings.kernels
  if kernels is None:
    kernels = where == "cpu" and cpu_kernels.available()
  elif kernels and not (where == "cpu" and cpu_kernels.available()):
    raise ValueError("kernels=True, but jspec's CPU kernels cannot run here: "
                     + (cpu_kernels.unavailable_reason() or f"the params are on {where}"))
  if role == "draft" and settings.draft_int4 is True and not kernels:
    raise ValueError("draft_int4=True, but jspec's CPU kernels do not run here: expected a CPU "
                     "where they build (" + (cpu_kernels.unavailable_reason()
                                              or f"the params are on {where}") + ")")
  draft_int8 = role == "draft" and (settings.draft_int8 if settings.draft_int8 is not None
                                    else where == "cpu")
  if role == "target" and settings.target_int8:
    # Float activations, not the draft's W8A8: a verify row must equal the step's.
    convert_leaf = weights.to_int8_blocks
  elif role == "draft" and draft_int4(settings, kernels):
    # On int8 activations where the int4 kernel runs, else on float32 ones.
    convert_leaf = (weights.to_int4_panels if cpu_kernels.int4_available()
                    else weights.to_int4_blocks)
  elif draft_int8:
    packed = kernels and cpu_kernels.int8_available()
    convert_leaf = lambda w: weights.to_int8(w, panels=packed)
  elif kernels:
    convert_leaf = _for_kernels
  else:
    convert_leaf = weights.to_float
  keep = None
  k = (draft_vocab_lib.resolve(settings.draft_vocab, cfg.vocab_size,
                               ranked=ranking is not None or tokenizer is not None)
       if role == "draft" else None)
  if k is not None:
    if isinstance(tokenizer, concurrent.futures.Future):  # `jspec.load` reads it beside this
      tokenizer = tokenizer.result()
    if ranking is None and tokenizer is not None:
      ranking = draft_vocab_lib.ranking(tokenizer)
    always = list(cfg.eos_token_ids) + draft_vocab_lib.special_ids(tokenizer)
    # Rounded up to whole kernel panels where the full head fills them too.
    multiple = weights.PANEL if kernels and cfg.vocab_size % weights.PANEL == 0 else 1
    keep = draft_vocab_lib.subset(k, cfg.vocab_size, ranking, always, multiple)
    source = params["embed"]["table"] if cfg.tie_word_embeddings else params["head"]["w"]
    # [K, D] float rows, stored as the full head would be: the same numbers at each kept id.
    rows = weights.Table(jnp.asarray(weights.lookup(source, np.asarray(keep))))
    # Converted now, and neither the rows nor the source kept: while the
    # matrices are converted, loading then holds no float copy of the head,
    # and the source's mapped pages go with its own conversion.
    vocab_head = jax.tree.map(jnp.asarray, convert_leaf(rows))
    del source, rows
  # The lookup read the source's pages: its conversion goes first and frees them.
  first = (("embed",) if cfg.tie_word_embeddings else ("head",)) if keep is not None else ()
  converted = _convert_leaves(params, convert_leaf, consume, first)
  if kernels:  # the layer loop reads each matrix of every layer with one kernel call
    converted["layers"] = _uniform_layers(converted["layers"])
  module = model.merge(cfg, converted)
  head = model.head_of(module)
  dtype = weights.compute_dtype(head)
  if role == "target" and kernels and settings.greedy_head and greedy_head.suits(head):
    module.greedy_head.set_value(greedy_head.make(head.p))
  if keep is not None:
    module.vocab_ids.set_value(jnp.asarray(keep, jnp.int32))
    module.vocab_head.set_value(vocab_head)
    module.vocab_extra.set_value(jnp.full((draft_vocab_lib.PROMPT_ROWS,), cfg.vocab_size,
                                          jnp.int32))
  prepared = model.params_of(module)
  backend = model.Backend(kernels=kernels, fused_attention=settings.fused_attention,
                          scan_layers=settings.scan_layers, dtype=dtype.name)
  return Model(cfg, prepared, backend)


def make(target: tuple[config_lib.Qwen2Config, dict],
         draft: Optional[tuple[config_lib.Qwen2Config, dict]] = None, tokenizer: Any = None,
         settings: Settings = Settings(), ranking: Optional[Sequence[int]] = None) -> Bundle:
  """A bundle from (config, params) pairs, prepared as `jspec.load` would (tests and tools).

  Args:
    target: (config, float params) of the target.
    draft: the same for the draft, or None.
    tokenizer: optional tokenizer.
    settings: the load-time choices.
    ranking: with `settings.draft_vocab`, the draft's ids most frequent
      first (`prepare`).

  Returns:
    The `Bundle`; the given params are left as they were.
  """
  t = prepare(*target, role="target", settings=settings)
  d = (prepare(*draft, role="draft", settings=settings, tokenizer=tokenizer, ranking=ranking)
       if draft is not None else None)
  return Bundle(t, d, tokenizer)


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
