"""Draft distillation: train the draft to agree with its target, and save it as a new draft file.

    bundle = jspec.load("qwen2.5-coder", kernels=None, draft_int8=False)  # a float draft
    report = jspec.distill(bundle, out="distilled.jspec.safetensors")
    tuned = jspec.load("qwen2.5-coder-1.5b", draft="distilled.jspec.safetensors")

Speedup is set by how often the target accepts the draft's tokens, so the
draft is trained on what the target would say (DistillSpec, Zhou et al.
2024). Three phases, each resumable:

  data    the training prompts (`jspec.distill_data`) continued by the draft
          (on-policy samples) and/or by the target (its greedy output, through
          jspec's own speculative decoding); the target's distribution at every
          generated position comes from the target's own forward, kept as its
          top-k log-probabilities (only the argmax when distilling for greedy
          decoding, where the target's distribution, restricted as the engine
          restricts it, is a point mass; on the target's own greedy output that
          argmax is the next token and needs no forward at all);
  train   float32 through XLA (no kernels: they have no gradient): optax AdamW
          with warmup, cosine or linear decay and gradient clipping, one jitted
          step (`jax.value_and_grad` and the update); all parameters, the last
          layers, or low-rank adapters (LoRA) on chosen matrices;
  save    the trained draft (adapters merged) as a jspec safetensors file that
          `jspec.load(..., draft=path)` takes, recording every training
          prompt's hash, the recipe and the costs in its metadata.

The loss, and why TVD to the greedy target is the default. Greedy speculative
decoding accepts a draft iff it equals the target's argmax a*; the default
policy ("confidence") drafts the next token only while the draft's own
softmax puts at least `min_confidence` on its top token. With that
threshold at least 0.5 (the default is), the event "drafted, accepted, and
drafting goes on" at one position is therefore exactly q(a*) >=
min_confidence (if q(a*) > 0.5, a* is the draft's argmax and its
confidence is q(a*)). The total variation distance between the
greedy-restricted target (a point mass at a*) and the draft's softmax is
1 - q(a*): a linear surrogate of that event, whose gradient is largest where
q(a*) is already near the threshold and small where the draft is hopelessly
wrong, so capacity goes to positions it can flip. Forward KL (-log q(a*),
cross-entropy) spends its largest gradients on the hopeless positions; JSD
lies between. "margin" (greedy only) is TVD plus the draft's largest
probability on any other token, 1 - (q(a*) - max_{v != a*} q(v)): the
confidence policy wastes a draft step and a wider verify wherever the draft
puts at least `min_confidence` on a token other than a*, and TVD raises
q(a*) but says nothing against that confident wrong token, which the margin
term lowers, so a position the draft cannot get right ends drafting instead
of wasting it. With a sampling temperature the same three are computed
between the two tempered distributions over the target's top-k tokens and
the rest's mass (a lower bound of the full divergence); there 1 - TVD is the
acceptance probability itself (Leviathan et al. 2023).

Axis letters in shape comments: N sequences, B batch rows, T tokens per row,
G generated (loss) positions per row, K label tokens per position,
V vocabulary, I/O a matrix's inputs/outputs, R the adapters' rank.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import tqdm

from convert import config as config_lib
from convert import keys
from convert import store
from jspec import api
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import distill_data
from jspec import model
from jspec import options
from jspec import rounds
from jspec import weights

try:  # optax only for training: `import jspec` and `jspec generate` work without it
  import optax
except ImportError:  # pragma: no cover - optax is in the test extra
  optax = None

LOSSES = ("tvd", "fkl", "jsd", "margin")
TRAIN = ("lora", "last", "full")
DATA = ("target", "draft", "mixed")
DECAYS = ("cosine", "linear")
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
_GROUP = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp",
          "down": "mlp"}
CHECKPOINT_FORMAT = "jspec-distill-checkpoint"
DATA_FORMAT = "jspec-distill-data"
_FORMAT_VERSION = "1"


class DistillError(ValueError):
  """Bad input to distillation (prompts, draft, recipe, work directory): one line, no traceback."""


def _is_number(x: Any) -> bool:
  """Whether x is a finite int or float (not a bool, not a string)."""
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
  """Whether x is an int (not a bool)."""
  return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Everything that decides a distillation, checked when made.

  The defaults follow the reasoning in the module docstring (TVD to the
  greedy target, the target's own output, LoRA on every matrix); they have
  not yet been compared by measurement on the real pair
  (`bench.tools.distill_eval` is the tool for it).

  Attributes:
    data: where the training continuations come from: "target" (its greedy
      output, as decoding will see it), "draft" (the draft's own samples at
      `sample_temperature`, on-policy) or "mixed" (alternate prompts).
    sample_temperature: the draft's sampling temperature for "draft" data.
    gen_tokens: new tokens generated per prompt (the loss positions).
    max_context: prompt tokens kept (the last ones) before generating.
    temperature: the decoding temperature the draft is distilled for: 0
      (greedy, the default engine: labels are the target's argmax) or a
      sampling temperature (labels are the target's top-k at it).
    top_k: label tokens kept per position when temperature > 0.
    loss: "tvd", "fkl" (forward KL), "jsd" or "margin" (greedy only; see the
      module docstring).
    train: "lora" (adapters on `lora_matrices`, merged on save), "last"
      (the last `last_layers` layers and the final norm) or "full".
    last_layers: layers trained by "last".
    lora_rank: the adapters' rank R.
    lora_alpha: adapter scale alpha (the update is alpha / R * x A B).
    lora_matrices: which matrices of every layer get adapters.
    learning_rate: AdamW's peak learning rate.
    warmup_steps: linear warmup from 0 to the peak.
    decay: "cosine" or "linear" decay to `final_lr_fraction` of the peak.
    final_lr_fraction: the learning rate at the last step, over the peak.
    weight_decay: AdamW's decoupled weight decay (0 keeps a pretrained draft from shrinking).
    clip_norm: global gradient norm clip.
    batch_size: sequences per step.
    epochs: passes over the training sequences (when `steps` is 0).
    steps: optimizer steps (0: `epochs` passes).
    eval_fraction: sequences held out of training to report agreement on.
    gen_batch: prompts per call when the draft samples.
    target_batch: prompts per call when the target generates: 1 runs
      speculative decoding with an int8 copy of the draft (`fast_pair`),
      more runs target-only decoding of that many at once.
    label_batch: sequences per target forward for labels.
    checkpoint_every: steps between checkpoints.
    eval_every: steps between held-out evaluations (0: at the start and the end only).
    seed: data order, adapter init and the draft's samples.
  """

  data: str = "target"
  sample_temperature: float = 1.0
  gen_tokens: int = 128
  max_context: int = 128
  temperature: float = 0.0
  top_k: int = 32
  loss: str = "tvd"
  train: str = "lora"
  last_layers: int = 2
  lora_rank: int = 16
  lora_alpha: float = 32.0
  lora_matrices: tuple[str, ...] = MATRICES
  learning_rate: float = 5e-4
  warmup_steps: int = 10
  decay: str = "cosine"
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  batch_size: int = 4
  epochs: int = 1
  steps: int = 0
  eval_fraction: float = 0.05
  gen_batch: int = 8
  target_batch: int = 1
  label_batch: int = 4
  checkpoint_every: int = 25
  eval_every: int = 0
  seed: int = 0

  def __post_init__(self):
    choices = {"data": DATA, "loss": LOSSES, "train": TRAIN, "decay": DECAYS}
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise DistillError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
    positive = ("gen_tokens", "max_context", "top_k", "last_layers", "lora_rank", "batch_size",
                "epochs", "gen_batch", "target_batch", "label_batch", "checkpoint_every")
    for name in positive:
      value = getattr(self, name)
      if not _is_int(value) or value < 1:
        raise DistillError(f"{name}={value!r}: expected an integer >= 1")
    for name in ("warmup_steps", "steps", "eval_every", "seed"):
      value = getattr(self, name)
      if not _is_int(value) or value < 0:
        raise DistillError(f"{name}={value!r}: expected an integer >= 0")
    if not _is_number(self.learning_rate) or not 0 < self.learning_rate < 1:
      raise DistillError(f"learning_rate={self.learning_rate!r}: expected a number in (0, 1)")
    for name in ("sample_temperature", "lora_alpha", "clip_norm"):
      value = getattr(self, name)
      if not _is_number(value) or value <= 0:
        raise DistillError(f"{name}={value!r}: expected a number > 0")
    if not _is_number(self.temperature) or self.temperature < 0:
      raise DistillError(f"temperature={self.temperature!r}: expected 0 (greedy) or a number > 0")
    if self.loss == "margin" and self.temperature != 0:
      raise DistillError(f"loss='margin' is for greedy decoding only (temperature=0), got "
                         f"temperature={self.temperature!r}: use tvd, fkl or jsd")
    for name in ("weight_decay", "final_lr_fraction"):
      value = getattr(self, name)
      if not _is_number(value) or not 0 <= value <= 1:
        raise DistillError(f"{name}={value!r}: expected a number in [0, 1]")
    if not _is_number(self.eval_fraction) or not 0 <= self.eval_fraction < 1:
      raise DistillError(f"eval_fraction={self.eval_fraction!r}: expected a number in [0, 1)")
    matrices = tuple(self.lora_matrices)
    bad = [m for m in matrices if m not in MATRICES]
    if bad or not matrices:
      raise DistillError(f"lora_matrices={self.lora_matrices!r}: expected some of "
                         f"{', '.join(MATRICES)}")
    object.__setattr__(self, "lora_matrices", matrices)

  @property
  def greedy(self) -> bool:
    """Whether the draft is distilled for greedy decoding (argmax labels)."""
    return self.temperature == 0

  def data_key(self) -> dict[str, Any]:
    """The fields that decide the training data (a data file is reused only if they match)."""
    fields = ["data", "gen_tokens", "max_context", "temperature", "seed"]
    if self.data != "target":
      fields.append("sample_temperature")
    if not self.greedy:
      fields.append("top_k")
    return {f: getattr(self, f) for f in fields}

  def train_key(self) -> dict[str, Any]:
    """The fields that decide training (a checkpoint resumes only if they match)."""
    out = dataclasses.asdict(self)
    for f in ("gen_batch", "target_batch", "label_batch", "checkpoint_every", "eval_every"):
      out.pop(f)
    out["lora_matrices"] = list(self.lora_matrices)
    return out


def make_recipe(recipe: Optional[Recipe] = None, **kwargs) -> Recipe:
  """A `Recipe` from keyword arguments, or `recipe` with them replaced.

  Args:
    recipe: a base recipe (None: the defaults).
    **kwargs: fields of `Recipe`.

  Returns:
    The checked recipe.

  Raises:
    DistillError: an unknown field or a bad value.
  """
  fields = {f.name for f in dataclasses.fields(Recipe)}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise DistillError(f"unknown recipe fields {unknown}; expected some of {sorted(fields)}")
  if recipe is not None and not isinstance(recipe, Recipe):
    raise DistillError(f"recipe must be a jspec.distill.Recipe, got {type(recipe).__name__}")
  return dataclasses.replace(recipe or Recipe(), **kwargs)


# --------------------------------------------------------------------------------------------
# Files: atomic safetensors writes, fingerprints.


def _write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray],
                       metadata: dict[str, str]) -> pathlib.Path:
  """Writes a safetensors file atomically (`convert.store.write_atomic`).

  Args:
    path: destination.
    tensors: name -> array.
    metadata: string -> string.

  Returns:
    path.
  """
  return store.write_atomic(path, {k: np.ascontiguousarray(v) for k, v in tensors.items()},
                            metadata)


def _read_safetensors(path: pathlib.Path, kind: str) -> tuple[dict[str, np.ndarray], dict]:
  """Reads a file written by `_write_safetensors` whose metadata format is `kind`."""
  try:
    with safetensors.safe_open(str(path), framework="numpy") as f:
      meta = f.metadata() or {}
      if meta.get("format") != kind:
        raise DistillError(f"{path}: not a {kind} file (format {meta.get('format')!r})")
      return {name: f.get_tensor(name) for name in f.keys()}, meta
  except DistillError:
    raise
  except Exception as e:  # SafetensorError on a truncated or garbled file
    raise DistillError(f"{path}: unreadable ({type(e).__name__}: {e}); delete it or use "
                       "resume=False") from None


def _digest(obj: Any) -> str:
  """The sha256 (hex) of a JSON-able object, keys sorted."""
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fingerprint(m: bundle_lib.Model) -> str:
  """A cheap identity of a prepared model: its config and the first values of every array.

  Enough to tell one checkpoint from another when resuming; not a hash of every byte.

  Args:
    m: the model.

  Returns:
    A hex digest.
  """
  h = hashlib.sha256(json.dumps(m.cfg.to_dict(), sort_keys=True).encode())
  leaves, _ = jax.tree_util.tree_flatten_with_path(m.params)
  for path, leaf in leaves:
    if not hasattr(leaf, "shape"):
      continue
    h.update(jax.tree_util.keystr(path).encode())
    h.update(str(tuple(leaf.shape)).encode())
    first = leaf[(0,) * (leaf.ndim - 1)][:64] if leaf.ndim else leaf  # no copy of the whole
    h.update(np.asarray(first).tobytes())
  return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Data: prompts -> continuations -> target labels.


@dataclasses.dataclass
class Data:
  """Training sequences and the target's labels at their generated positions.

  Attributes:
    tokens: [N, T] int32 context + continuation, right-padded with 0.
    at: [N, G] int32 positions whose next token is generated (0 where masked).
    mask: [N, G] bool valid loss positions.
    label_ids: [N, G, K] int32 the target's top tokens at each position
      (K = 1 and the argmax when greedy).
    label_logp: [N, G, K] float32 their log-probabilities at the recipe's
      temperature (0 when greedy: a point mass).
    kinds: [N] int8, 0 code and 1 chat.
    sources: [N] int8, 0 draft samples and 1 target output.
    hashes: per sequence, the hash of its prompt (`distill_data.prompt_hash`).
    meta: the data recipe, fingerprints and costs.
  """

  tokens: np.ndarray
  at: np.ndarray
  mask: np.ndarray
  label_ids: np.ndarray
  label_logp: np.ndarray
  kinds: np.ndarray
  sources: np.ndarray
  hashes: list[str]
  meta: dict[str, Any]

  def __len__(self) -> int:
    return self.tokens.shape[0]

  def rows(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays of some sequences, as one batch."""
    return {"tokens": self.tokens[idx], "at": self.at[idx], "mask": self.mask[idx],
            "label_ids": self.label_ids[idx], "label_logp": self.label_logp[idx]}

  def save(self, path: pathlib.Path) -> pathlib.Path:
    """Writes the data atomically (safetensors, no pickle)."""
    tensors = {"tokens": self.tokens, "at": self.at, "mask": self.mask.astype(np.uint8),
               "label_ids": self.label_ids, "label_logp": self.label_logp,
               "kinds": self.kinds, "sources": self.sources}
    meta = {"format": DATA_FORMAT, "format_version": _FORMAT_VERSION,
            "hashes": json.dumps(self.hashes), "meta": json.dumps(self.meta, sort_keys=True)}
    return _write_safetensors(path, tensors, meta)

  @classmethod
  def load(cls, path: pathlib.Path) -> "Data":
    """Reads a file written by `save`."""
    t, meta = _read_safetensors(path, DATA_FORMAT)
    try:
      return cls(t["tokens"], t["at"], t["mask"].astype(bool), t["label_ids"], t["label_logp"],
                 t["kinds"], t["sources"], json.loads(meta["hashes"]), json.loads(meta["meta"]))
    except (KeyError, ValueError) as e:
      raise DistillError(f"{path}: damaged data file ({type(e).__name__}: {e}); delete it or "
                         "use resume=False") from None


def _as_prompts(prompts: Any) -> list[distill_data.Prompt]:
  """The training prompts as `distill_data.Prompt`s (strings are code prompts)."""
  if prompts is None:
    return distill_data.training_prompts()
  if isinstance(prompts, (str, bytes)):
    raise DistillError("prompts must be a list of prompts, not one string")
  try:
    items = list(prompts)
  except TypeError:
    raise DistillError(f"prompts must be a list, got {type(prompts).__name__}") from None
  if not items:
    raise DistillError("no training prompts: expected at least one")
  out = []
  for i, p in enumerate(items):
    if isinstance(p, distill_data.Prompt):
      out.append(p)
    elif isinstance(p, str):
      if not p.strip():
        raise DistillError(f"training prompt {i} is empty")
      out.append(distill_data.Prompt("code", p, f"user:{i}"))
    elif isinstance(p, (list, tuple, np.ndarray)) and len(p) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
      out.append(distill_data.Prompt("code", " ".join(str(int(t)) for t in p), f"ids:{i}"))
    else:
      raise DistillError(f"training prompt {i} is a {type(p).__name__}: expected a string, a "
                         "jspec.distill_data.Prompt or a list of token ids")
  return out


def _encode(bundle: bundle_lib.Bundle, prompt: distill_data.Prompt, max_context: int) -> list[int]:
  """A prompt's token ids (through the chat template for chat prompts), its last `max_context`."""
  if prompt.source.startswith("ids:"):
    ids = [int(t) for t in prompt.text.split()]
  elif bundle.tokenizer is None:
    raise DistillError("text prompts need a tokenizer; this bundle has none (pass token ids)")
  else:
    text = prompt.text
    if prompt.chat:
      text = bundle.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids = list(bundle.tokenizer.encode(text))
  ids = ids[-max_context:]
  vocab = bundle.vocab_limit or bundle.target.cfg.vocab_size
  if not ids or any(not 0 <= t < vocab for t in ids):
    raise DistillError(f"training prompt {prompt.source}: empty, or a token id outside the "
                       f"vocabulary [0, {vocab})")
  return ids


def fast_pair(bundle: bundle_lib.Bundle) -> bundle_lib.Bundle:
  """The pair with an int8 copy of its float draft: the target's greedy output, sooner.

  Speculative decoding's output is the target's whatever the draft, and an
  int8 draft proposes at about half a float one's cost per step.

  Args:
    bundle: the pair (its draft float, or already int8).

  Returns:
    A bundle of the same target and tokenizer with the draft in int8.
  """
  leaves = jax.tree.leaves(bundle.draft.params, is_leaf=weights.is_leaf)
  if any(isinstance(w, (weights.Int8, weights.Int8Panels)) for w in leaves):
    return bundle
  settings = bundle_lib.Settings(kernels=bundle.draft.backend.kernels, draft_int8=True,
                                 fused_attention=bundle.draft.backend.fused_attention,
                                 scan_layers=bundle.draft.backend.scan_layers)
  draft = bundle_lib.prepare(bundle.draft.cfg, dict(bundle.draft.params), "draft", settings)
  return bundle_lib.Bundle(bundle.target, draft, bundle.tokenizer, bundle.vocab_limit)


def _generate(bundle: bundle_lib.Bundle, ids: list[list[int]], recipe: Recipe,
              source: str, seed: int) -> list[list[int]]:
  """Continuations of a batch of prompts by the draft (sampled) or the target (greedy).

  The target's: one prompt at a time by speculative decoding (pass
  `fast_pair(bundle)`), or several at once by target-only decoding, which
  reads the weights once per step for all of them; a speculative verify of
  several rows is compute-bound on a CPU and costs more than both.
  """
  if source == "draft":
    alone = bundle_lib.Bundle(bundle.draft, None, bundle.tokenizer, bundle.vocab_limit)
    rows = api.generate(alone, ids, method="target", temperature=recipe.sample_temperature,
                        max_new_tokens=recipe.gen_tokens, seed=seed)
  elif len(ids) == 1:
    rows = [api.generate(bundle, ids[0], method="model", temperature=0.0,
                         max_new_tokens=recipe.gen_tokens, seed=seed)]
  else:
    rows = api.generate(bundle, ids, method="target", temperature=0.0,
                        max_new_tokens=recipe.gen_tokens, seed=seed)
  return [list(r.token_ids) for r in rows]


@functools.partial(jax.jit, static_argnames=("arch", "k", "temperature", "vocab_limit"))
def _target_labels(arch: model.Arch, params, tokens: jax.Array, at: jax.Array, *, k: int,
                   temperature: float, vocab_limit: Optional[int]):
  """The target's top-k log-probabilities at positions `at` of whole sequences.

  Args:
    arch: the target's arch.
    params: its params (any stored form: the kernels run here, no gradient is taken).
    tokens: [B, T] int32 sequences.
    at: [B, G] int32 positions.
    k: labels per position (1 when greedy: the argmax).
    temperature: 0 (greedy) or the temperature the log-probabilities are taken at.
    vocab_limit: ids at or past it are padding, never labels.

  Returns:
    ([B, G, K] int32 ids, [B, G, K] float32 log-probabilities; zeros when greedy).
  """
  b, t = tokens.shape
  cache = cache_lib.init(arch.cfg, b, t, jnp.dtype(arch.backend.dtype))
  logits, _ = model.forward(arch, params, tokens, cache, logits_at=at, fresh=True)  # [B, G, V]
  logits = logits.astype(jnp.float32)
  if vocab_limit is not None and vocab_limit < logits.shape[-1]:
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
  if temperature == 0:
    ids = jnp.argmax(logits, axis=-1)[..., None].astype(jnp.int32)  # [B, G, 1]
    return ids, jnp.zeros(ids.shape, jnp.float32)
  logp = jax.nn.log_softmax(logits / temperature, axis=-1)
  top, ids = jax.lax.top_k(logp, k)  # [B, G, K]
  return ids.astype(jnp.int32), top


def _layout(contexts: list[list[int]], continuations: list[list[int]],
            gen_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Sequences, loss positions and mask from contexts and their continuations.

  Returns:
    ([N, T] int32 tokens, T a multiple of 16; [N, G] int32 positions; [N, G] bool mask).
  """
  n = len(contexts)
  longest = max(len(c) + len(g) for c, g in zip(contexts, continuations))
  width = -(-longest // 16) * 16
  tokens = np.zeros((n, width), np.int32)
  at = np.zeros((n, gen_tokens), np.int32)
  mask = np.zeros((n, gen_tokens), bool)
  for i, (c, g) in enumerate(zip(contexts, continuations)):
    seq = c + g
    tokens[i, :len(seq)] = seq
    # Position t predicts token t + 1: the generated tokens are predicted at
    # len(c) - 1 .. len(seq) - 2.
    at[i, :len(g)] = np.arange(len(c) - 1, len(seq) - 1)
    mask[i, :len(g)] = True
  return tokens, at, mask


def _save_partial(path: pathlib.Path, key: str, rows: dict[str, list[int]],
                  gen_s: dict[str, float]) -> None:
  """Writes the continuations generated so far (JSON, atomically), so that an interrupted data
  phase resumes where it stopped."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump({"key": key, "rows": rows, "generate_s": gen_s}, f)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _load_partial(path: Optional[pathlib.Path], key: str) -> tuple[dict, dict]:
  """The continuations an earlier, interrupted data phase of the same run left (else none)."""
  if path is None or not path.is_file():
    return {}, {"draft": 0.0, "target": 0.0}
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError):
    return {}, {"draft": 0.0, "target": 0.0}
  if not isinstance(saved, dict) or saved.get("key") != key:
    return {}, {"draft": 0.0, "target": 0.0}
  return dict(saved.get("rows", {})), dict(saved.get("generate_s", {"draft": 0.0, "target": 0.0}))


# Seconds between progress lines when stderr is not a terminal (a log file):
# a line a minute instead of a redraw every tenth of a second.
LOG_PROGRESS_INTERVAL_S = 60.0


class _Lines:
  """A stream for tqdm that ends each redraw with a newline: a log keeps one line per update."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text: str) -> None:
    text = text.replace("\r", "").strip()
    if text:
      self.stream.write(text + "\n")

  def flush(self) -> None:
    self.stream.flush()


def _bar(**kwargs) -> tqdm.tqdm:
  """A progress bar on stderr: redrawn on a terminal, a line a minute into a log.

  Args:
    **kwargs: `tqdm.tqdm` arguments (total, desc, unit, initial, disable).

  Returns:
    The bar.
  """
  if sys.stderr.isatty():
    return tqdm.tqdm(file=sys.stderr, **kwargs)
  return tqdm.tqdm(file=_Lines(sys.stderr), mininterval=LOG_PROGRESS_INTERVAL_S, ascii=True,
                   dynamic_ncols=False, ncols=100, **kwargs)


def make_data(bundle: bundle_lib.Bundle, prompts: Sequence[distill_data.Prompt], recipe: Recipe,
              progress: bool = True, partial: Optional[pathlib.Path] = None) -> Data:
  """Generates the continuations and the target's labels for every training prompt.

  Args:
    bundle: the pair (any stored forms: nothing here takes a gradient).
    prompts: the training prompts.
    recipe: the recipe (its data fields).
    progress: show progress bars on stderr.
    partial: a file that keeps the continuations as they are generated, and
      from which an interrupted call of the same run resumes (None: none).

  Returns:
    The `Data`, with its costs in `meta`.
  """
  t0 = time.perf_counter()
  contexts = [_encode(bundle, p, recipe.max_context) for p in prompts]
  if recipe.data == "mixed":
    sources = ["target" if i % 2 else "draft" for i in range(len(prompts))]
  else:
    sources = [recipe.data] * len(prompts)
  hashes = [distill_data.prompt_hash(p.text) for p in prompts]
  key = _digest([recipe.data_key(), hashes, fingerprint(bundle.target), fingerprint(bundle.draft)])
  done, gen_s = _load_partial(partial, key)
  row_key = lambda i: f"{hashes[i]}:{sources[i]}:{i}"
  continuations: list[Optional[list[int]]] = [done.get(row_key(i)) for i in range(len(prompts))]
  bar = _bar(total=len(prompts), desc="distill: generating", unit="prompt",
             initial=sum(c is not None for c in continuations), disable=not progress)
  fast = fast_pair(bundle) if "target" in sources and recipe.target_batch == 1 else bundle
  for source in ("draft", "target"):
    todo = [i for i in range(len(prompts)) if sources[i] == source]
    todo.sort(key=lambda i: len(contexts[i]))  # similar widths share a program
    rows_per_call = recipe.gen_batch if source == "draft" else recipe.target_batch
    for start in range(0, len(todo), rows_per_call):
      chunk = todo[start:start + rows_per_call]
      if all(continuations[i] is not None for i in chunk):
        continue
      t = time.perf_counter()
      out = _generate(fast if source == "target" else bundle, [contexts[i] for i in chunk],
                      recipe, source, recipe.seed * 1_000_003 + start)
      gen_s[source] = gen_s.get(source, 0.0) + time.perf_counter() - t
      for i, ids in zip(chunk, out):
        continuations[i] = ids
        done[row_key(i)] = ids
      if partial is not None:
        _save_partial(partial, key, done, gen_s)
      bar.update(len(chunk))
  bar.close()
  keep = [i for i in range(len(prompts)) if continuations[i]]
  if not keep:
    raise DistillError("no prompt produced any continuation (every one ended at once)")
  contexts = [contexts[i] for i in keep]
  continuations = [continuations[i] for i in keep]
  sources = [sources[i] for i in keep]
  tokens, at, mask = _layout(contexts, continuations, recipe.gen_tokens)
  n, g = at.shape
  k = 1 if recipe.greedy else recipe.top_k
  label_ids = np.zeros((n, g, k), np.int32)
  label_logp = np.zeros((n, g, k), np.float32)
  # On the target's own greedy output the target's argmax at each position is
  # the next token: no forward needed.
  free = {i for i in range(n) if recipe.greedy and sources[i] == "target"}
  for i in sorted(free):
    label_ids[i, :, 0] = np.where(mask[i], tokens[i, np.minimum(at[i] + 1, tokens.shape[1] - 1)], 0)
  need = [i for i in range(n) if i not in free]
  t_label = time.perf_counter()
  if need:
    bar = _bar(total=len(need), desc="distill: target labels", unit="seq", disable=not progress)
    for start in range(0, len(need), recipe.label_batch):
      chunk = need[start:start + recipe.label_batch]
      rows = chunk + [chunk[-1]] * (recipe.label_batch - len(chunk))  # one program shape
      ids, logp = _target_labels(bundle.target.arch, bundle.target.params,
                                 jnp.asarray(tokens[rows]), jnp.asarray(at[rows]), k=k,
                                 temperature=float(recipe.temperature),
                                 vocab_limit=bundle.vocab_limit)
      ids, logp = np.asarray(ids), np.asarray(logp)
      for j, i in enumerate(chunk):
        label_ids[i] = np.where(mask[i, :, None], ids[j], 0)
        label_logp[i] = np.where(mask[i, :, None], logp[j], 0.0)
      bar.update(len(chunk))
    bar.close()
  label_s = time.perf_counter() - t_label
  kinds = np.array([1 if prompts[i].chat else 0 for i in keep], np.int8)
  src = np.array([1 if s == "target" else 0 for s in sources], np.int8)
  meta = {
      "recipe": recipe.data_key(),
      "prompts_digest": _digest([distill_data.prompt_hash(p.text) for p in prompts]),
      "target": fingerprint(bundle.target), "draft": fingerprint(bundle.draft),
      "sequences": n, "prompts": len(prompts),
      "generated_tokens": int(mask.sum()),
      "generated_by_draft": int(mask[src == 0].sum()),
      "generated_by_target": int(mask[src == 1].sum()),
      "label_forward_tokens": int(sum(int(at[i][mask[i]].max()) + 2 for i in need)),
      "generate_s": gen_s, "label_s": label_s, "data_s": time.perf_counter() - t0,
  }
  return Data(tokens, at, mask, label_ids, label_logp, kinds, src,
              [distill_data.prompt_hash(prompts[i].text) for i in keep], meta)


# --------------------------------------------------------------------------------------------
# The trained parameters: all, the last layers, or low-rank adapters.


def float_params(m: bundle_lib.Model) -> Any:
  """A model's params with plain float leaves (`Dense`, `Table`) for XLA and autodiff.

  Args:
    m: a prepared draft: float (`Dense`, `Table` or kernel `Panels`), not int8.

  Returns:
    The params tree (kernel panels copied back to [I, O]; the draft's own arrays otherwise).

  Raises:
    DistillError: an int8 draft, whose float weights are gone.
  """
  leaves = [leaf for leaf in jax.tree.leaves(m.params, is_leaf=weights.is_leaf)
            if weights.is_leaf(leaf)]
  if any(isinstance(w, (weights.Int8, weights.Int8Panels)) for w in leaves):
    raise DistillError("the draft is stored in int8; distillation trains its float weights: "
                       "load the pair with draft_int8=False (--float-draft)")
  template = model.abstract_params(m.cfg)
  stored = dict(m.params)
  stored["greedy_head"] = None

  def plain(want, w):  # the form `model.init_params` makes: Dense [I, O] or Table [V, D]
    if isinstance(want, weights.Table):
      return w if isinstance(w, weights.Table) else weights.Table(weights.matrix(w).T)
    if isinstance(want, weights.Dense):
      return w if isinstance(w, weights.Dense) else weights.Dense(weights.matrix(w))
    return w

  return jax.tree.map(plain, template, stored, is_leaf=lambda x: weights.is_leaf(x) or x is None)


def _layer_names(cfg: config_lib.Qwen2Config, recipe: Recipe) -> list[str]:
  """The adapted matrices, `<layer>/<group>/<matrix>`."""
  return [f"{i}/{_GROUP[m]}/{m}" for i in range(cfg.num_layers) for m in recipe.lora_matrices]


def init_trainable(cfg: config_lib.Qwen2Config, params: Any, recipe: Recipe) -> Any:
  """The trained part of the draft before any step.

  Args:
    cfg: the draft's config.
    params: its float params (`float_params`).
    recipe: what to train.

  Returns:
    "full": the params (greedy head dropped); "last": {"layers": the last
    layers, "norm": the final norm}; "lora": {name: {"a": [I, R], "b":
    [R, O]}}, a drawn from N(0, 1/I) and b zero, so the first step starts
    from the draft itself. Copies: the step donates them, and the bundle's
    arrays must survive it.
  """
  copy = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
  if recipe.train == "full":
    return copy({k: v for k, v in params.items() if k != "greedy_head"})
  if recipe.train == "last":
    n = min(recipe.last_layers, cfg.num_layers)
    last = range(cfg.num_layers - n, cfg.num_layers)
    return copy({"layers": {str(i): params["layers"][str(i)] for i in last},
                 "norm": params["norm"]})
  key = jax.random.key(recipe.seed)
  out = {}
  for j, name in enumerate(_layer_names(cfg, recipe)):
    layer, group, mat = name.split("/")
    i, o = params["layers"][layer][group][mat]["w"].shape
    a = jax.random.normal(jax.random.fold_in(key, j), (i, recipe.lora_rank), jnp.float32)
    out[name] = {"a": a / math.sqrt(i), "b": jnp.zeros((recipe.lora_rank, o), jnp.float32)}
  return out


def _combine(params: Any, trainable: Any, recipe: Recipe) -> Any:
  """The params a forward runs with: frozen params with the trained part put in (not LoRA)."""
  if recipe.train == "full":
    return {**params, **trainable}
  if recipe.train == "last":
    layers = {**params["layers"], **trainable["layers"]}
    return {**params, "layers": layers, "norm": trainable["norm"]}
  return params


def draft_logits(cfg: config_lib.Qwen2Config, params: Any, trainable: Any, recipe: Recipe,
                 tokens: jax.Array, at: jax.Array) -> jax.Array:
  """The draft's logits at positions `at` of whole sequences, differentiable in `trainable`.

  Args:
    cfg: the draft's config.
    params: its float params (frozen part).
    trainable: the trained part (`init_trainable`).
    recipe: what is trained.
    tokens: [B, T] int32 sequences.
    at: [B, G] int32 positions.

  Returns:
    [B, G, V] float32 logits.
  """
  module = model.merge(cfg, _combine(params, trainable, recipe))
  if recipe.train == "lora":
    # Imported here: `import jspec` does not import flax (`jspec.model`).
    from jspec import modules  # pylint: disable=import-outside-toplevel
    scale = recipe.lora_alpha / recipe.lora_rank
    for name, ab in trainable.items():
      layer, group, mat = name.split("/")
      parent = getattr(module.layers[int(layer)], group)
      setattr(parent, mat, modules.LowRankLinear(getattr(parent, mat), ab["a"], ab["b"], scale))
  b, t = tokens.shape
  cache = cache_lib.init(cfg, b, t)
  logits, _ = module(tokens, cache, at, backend=model.Backend(), fresh=True)
  return logits


def merged_params(params: Any, trainable: Any, recipe: Recipe) -> Any:
  """The draft's float params with the trained part in and adapters merged: W + alpha / R * A B.

  Args:
    params: the frozen float params.
    trainable: the trained part.
    recipe: what was trained.

  Returns:
    A params tree of `Dense` / `Table` leaves, the draft's structure.
  """
  out = _combine(params, trainable, recipe)
  if recipe.train != "lora":
    return out
  scale = recipe.lora_alpha / recipe.lora_rank
  layers = {k: jax.tree.map(lambda x: x, v, is_leaf=weights.is_leaf)
            for k, v in out["layers"].items()}
  for name, ab in trainable.items():
    layer, group, mat = name.split("/")
    lin = dict(layers[layer][group][mat])
    w = lin["w"]
    lin["w"] = weights.Dense(w.w + scale * (ab["a"] @ ab["b"]).astype(w.w.dtype))
    layers[layer] = {**layers[layer], group: {**layers[layer][group], mat: lin}}
  return {**out, "layers": layers}


# --------------------------------------------------------------------------------------------
# Losses.


def losses(logits: jax.Array, label_ids: jax.Array, label_logp: jax.Array,
           temperature: float) -> dict[str, jax.Array]:
  """Per-position divergences between the target's labels and the draft, and agreement.

  Args:
    logits: [B, G, V] draft logits.
    label_ids: [B, G, K] the target's top tokens (K = 1 when greedy).
    label_logp: [B, G, K] their log-probabilities (ignored when greedy).
    temperature: 0 (greedy: the target is a point mass at label_ids[..., 0]
      and the draft's distribution is its softmax at temperature 1, which
      the confidence policy reads) or the temperature both are taken at.

  Returns:
    [B, G] arrays: "tvd", "fkl", "jsd", "margin" (greedy only: 1 - (q(a*) -
    max_{v != a*} q(v))), "agree" (the draft's argmax equals the target's),
    "q_top" (q at the target's argmax).
  """
  logits = logits.astype(jnp.float32)
  agree = (jnp.argmax(logits, axis=-1) == label_ids[..., 0]).astype(jnp.float32)
  if temperature == 0:
    logq = jax.nn.log_softmax(logits, axis=-1)  # [B, G, V]
    lq = jnp.take_along_axis(logq, label_ids[..., :1], axis=-1)[..., 0]  # [B, G] log q(a*)
    q = jnp.exp(lq)
    log2 = jnp.log(2.0)
    # JSD(point mass at a*, q), m = (p + q) / 2:
    #   KL(p || m) = -log((1 + q_a) / 2);  KL(q || m) = q_a log(2 q_a / (1 + q_a)) + (1 - q_a) log 2.
    kl_pm = log2 - jnp.log1p(q)
    kl_qm = q * (log2 + lq - jnp.log1p(q)) + (1.0 - q) * log2
    # The draft's largest probability on a token other than a*: a* masked out of the max.
    vocab = jnp.arange(logq.shape[-1])  # [V]
    others = jnp.where(vocab == label_ids[..., :1], -jnp.inf, logq)  # [B, G, V]
    q_other = jnp.exp(jnp.max(others, axis=-1))  # [B, G]
    return {"tvd": 1.0 - q, "fkl": -lq, "jsd": 0.5 * (kl_pm + kl_qm),
            "margin": 1.0 - (q - q_other), "agree": agree, "q_top": q}
  logq = jax.nn.log_softmax(logits / temperature, axis=-1)
  lq = jnp.take_along_axis(logq, label_ids, axis=-1)  # [B, G, K]
  p, q = jnp.exp(label_logp), jnp.exp(lq)
  # The target's top K tokens and one bucket for the rest of the vocabulary.
  p_all = jnp.concatenate([p, jnp.clip(1.0 - p.sum(-1, keepdims=True), 0.0, 1.0)], axis=-1)
  q_all = jnp.concatenate([q, jnp.clip(1.0 - q.sum(-1, keepdims=True), 0.0, 1.0)], axis=-1)
  m = 0.5 * (p_all + q_all)
  rel = jax.scipy.special.rel_entr
  fkl = jnp.sum(rel(p_all, jnp.maximum(q_all, 1e-30)), axis=-1)
  jsd = 0.5 * jnp.sum(rel(p_all, m) + rel(q_all, m), axis=-1)
  tvd = 0.5 * jnp.sum(jnp.abs(p_all - q_all), axis=-1)
  return {"tvd": tvd, "fkl": fkl, "jsd": jsd, "agree": agree, "q_top": q[..., 0]}


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean of x [B, G] over the positions where mask [B, G] is 1 (0 without any): []."""
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


# --------------------------------------------------------------------------------------------
# The optimizer and the jitted step.


def _require_optax() -> None:
  """Raises a one-line `DistillError` when optax is not installed."""
  if optax is None:
    raise DistillError("distillation needs optax: pip install optax (it is in jspec's test "
                       "extra: pip install -e '.[test]')")


def schedule(recipe: Recipe, total_steps: int) -> Callable:
  """The learning rate per step: linear warmup to the peak, then cosine or linear decay.

  Args:
    recipe: peak, warmup, decay and its final fraction.
    total_steps: steps in the whole run.

  Returns:
    An optax schedule.
  """
  _require_optax()
  peak = recipe.learning_rate
  end = peak * recipe.final_lr_fraction
  warm = min(recipe.warmup_steps, max(total_steps - 1, 0))
  decay_steps = max(total_steps - warm, 1)
  if recipe.decay == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warm, warm + decay_steps, end)
  pieces = [optax.linear_schedule(0.0, peak, max(warm, 1)),
            optax.linear_schedule(peak, end, decay_steps)]
  return optax.join_schedules(pieces, [warm]) if warm else pieces[1]


def optimizer(recipe: Recipe, total_steps: int):
  """AdamW with the recipe's schedule after clipping the global gradient norm.

  Args:
    recipe: the recipe.
    total_steps: steps in the whole run (the schedule's length).

  Returns:
    An `optax.GradientTransformation`.
  """
  _require_optax()
  return optax.chain(optax.clip_by_global_norm(recipe.clip_norm),
                     optax.adamw(schedule(recipe, total_steps), b1=0.9, b2=0.999, eps=1e-8,
                                 weight_decay=recipe.weight_decay))


def make_step(cfg: config_lib.Qwen2Config, recipe: Recipe, tx) -> Callable:
  """The training step: one jitted function of value_and_grad and the optax update.

  Args:
    cfg: the draft's config.
    recipe: loss, temperature and what is trained.
    tx: the optax transformation.

  Returns:
    step(trainable, opt_state, params, batch) -> (trainable, opt_state,
    metrics), jitted, trainable and opt_state donated. batch holds tokens
    [B, T], at [B, G], mask [B, G], label_ids [B, G, K], label_logp [B, G, K];
    metrics holds loss, agree, tvd, q_top and grad_norm, each [].
  """
  temperature = float(recipe.temperature)

  def loss_fn(trainable, params, batch):
    tokens, at, mask = batch["tokens"], batch["at"], batch["mask"]
    b, t = tokens.shape
    g = at.shape[1]
    k = batch["label_ids"].shape[-1]
    chex.assert_shape(at, (b, g))
    chex.assert_shape(mask, (b, g))
    chex.assert_shape([batch["label_ids"], batch["label_logp"]], (b, g, k))
    logits = draft_logits(cfg, params, trainable, recipe, tokens, at)
    chex.assert_shape(logits, (b, g, cfg.vocab_size))
    per = losses(logits, batch["label_ids"], batch["label_logp"], temperature)
    mask = mask.astype(jnp.float32)
    metrics = {name: _masked_mean(per[name], mask) for name in ("agree", "tvd", "q_top")}
    return _masked_mean(per[recipe.loss], mask), metrics

  def step(trainable, opt_state, params, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, params, batch)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, trainable)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, trainable)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    return trainable, opt_state, {"loss": loss, "grad_norm": norm, **metrics}

  return jax.jit(step, donate_argnums=(0, 1))


@functools.partial(jax.jit, static_argnames=("cfg", "recipe"))
def _eval_batch(cfg, recipe, params, trainable, batch):
  """Per-position losses and the draft's confidence on one batch, no gradient."""
  logits = draft_logits(cfg, params, trainable, recipe, batch["tokens"], batch["at"])
  per = losses(logits, batch["label_ids"], batch["label_logp"], float(recipe.temperature))
  # The confidence policy reads the draft's softmax at temperature 1 when greedy.
  top = jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
  return {**per, "confidence": top}


def simulate_rounds(agree: np.ndarray, confidence: np.ndarray, mask: np.ndarray,
                    min_confidence: float = options.DEFAULT_MIN_CONFIDENCE,
                    gamma: int = options.DEFAULT_GAMMA["confidence"]) -> float:
  """Tokens per round the greedy confidence policy would emit on held-out target output.

  Each sequence's rounds are replayed as the engine runs them
  (`rounds.replay_round`): the first draft always counts, drafting goes on
  while the newest draft's top probability is at least `min_confidence`
  (up to gamma drafts), computed drafts fill the verify width's spare
  positions, the drafts up to the first disagreement are accepted, and the
  round emits them plus the target's own token. Exact for the target's
  greedy output but for what the policy is shown after a wrong draft (see
  `jspec.rounds`); an estimate on other text.

  Args:
    agree: [N, G] bool, the draft's argmax equals the target's.
    confidence: [N, G] the draft's top probability.
    mask: [N, G] valid positions (a prefix of each row).
    min_confidence: the policy's threshold (default: the library's).
    gamma: its cap, and the static bound on drafts (default: the library's).

  Returns:
    Mean tokens per round over all rounds (nan without rounds).
  """
  rule = rounds.confidence(min_confidence)
  tokens = n_rounds = 0
  for ok, conf, valid in zip(agree, confidence, mask):
    n = int(valid.sum())
    t, r = rounds.tokens_and_rounds(np.asarray(ok[:n], bool), np.asarray(conf[:n]), rule, gamma,
                                    gamma)
    tokens += t
    n_rounds += r
  return tokens / n_rounds if n_rounds else float("nan")


def evaluate(cfg: config_lib.Qwen2Config, params: Any, trainable: Any, recipe: Recipe,
             data: Data, idx: np.ndarray) -> dict[str, float]:
  """Held-out figures of the draft as it is now.

  Args:
    cfg: the draft's config.
    params: its frozen float params.
    trainable: the trained part.
    recipe: the recipe.
    data: the data.
    idx: the held-out sequences.

  Returns:
    loss (the recipe's), tvd, fkl, jsd, margin (greedy), agree (argmax agreement: greedy
    acceptance per draft), confident_right (q(a*) at least the library's
    `min_confidence`: drafted, accepted and drafting goes on) and
    tokens_per_round (`simulate_rounds` with the library's policy, target
    sequences only).
  """
  if len(idx) == 0:
    return {}
  sums: dict[str, float] = {}
  total = 0.0
  agree_rows, conf_rows, mask_rows = [], [], []
  b = recipe.batch_size
  for start in range(0, len(idx), b):
    chunk = idx[start:start + b]
    rows = np.concatenate([chunk, np.repeat(chunk[-1:], b - len(chunk))])
    batch = {k: jnp.asarray(v) for k, v in data.rows(rows).items()}
    out = {k: np.asarray(v)[:len(chunk)] for k, v in
           _eval_batch(cfg, recipe, params, trainable, batch).items()}
    mask = data.mask[chunk]
    for name in ("tvd", "fkl", "jsd", "margin", "agree"):
      if name not in out:  # margin: greedy only
        continue
      sums[name] = sums.get(name, 0.0) + float((out[name] * mask).sum())
    sums["confident_right"] = sums.get("confident_right", 0.0) + float(
        ((out["q_top"] >= options.DEFAULT_MIN_CONFIDENCE) * mask).sum())
    total += float(mask.sum())
    target_rows = data.sources[chunk] == 1
    agree_rows.append(out["agree"][target_rows] > 0.5)
    conf_rows.append(out["confidence"][target_rows])
    mask_rows.append(mask[target_rows])
  result = {k: v / max(total, 1.0) for k, v in sums.items()}
  result["loss"] = result[recipe.loss]
  result["tokens_per_round"] = simulate_rounds(np.concatenate(agree_rows), np.concatenate(conf_rows),
                                               np.concatenate(mask_rows))
  return result


# --------------------------------------------------------------------------------------------
# Checkpoints: the trained part, the optimizer state and the step, resumable bit for bit.


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
  """A tree's leaves, each with its tree path as a string (the checkpoint's tensor names)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def save_checkpoint(path: pathlib.Path, step: int, trainable: Any, opt_state: Any,
                    meta: dict[str, Any], history: Optional[dict[str, Any]] = None) -> pathlib.Path:
  """Writes the trained part, the optax state (leaves named by their tree paths) and the step.

  Args:
    path: the checkpoint file (written atomically).
    step: steps done.
    trainable: the trained part.
    opt_state: the optax state.
    meta: what the checkpoint must match to resume (recipe, data, draft).
    history: the loss curve, evaluations and seconds so far (carried across resumes).

  Returns:
    path.
  """
  tensors = {f"trainable{name}": np.asarray(x) for name, x in _named_leaves(trainable)}
  tensors.update({f"opt{name}": np.asarray(x) for name, x in _named_leaves(opt_state)})
  metadata = {"format": CHECKPOINT_FORMAT, "format_version": _FORMAT_VERSION, "step": str(step),
              "meta": json.dumps(meta, sort_keys=True), "history": json.dumps(history or {})}
  return _write_safetensors(path, tensors, metadata)


def load_checkpoint(path: pathlib.Path, trainable: Any, opt_state: Any,
                    meta: dict[str, Any]) -> tuple[int, Any, Any, dict[str, Any]]:
  """Reads a checkpoint into trees shaped like `trainable` and `opt_state`.

  Args:
    path: the checkpoint file.
    trainable: a template of the trained part (its structure and shapes).
    opt_state: a template of the optax state.
    meta: what this run is; the checkpoint's must be the same.

  Returns:
    (step, trainable, opt_state, history).

  Raises:
    DistillError: another recipe, data or draft, or a damaged file.
  """
  tensors, header = _read_safetensors(path, CHECKPOINT_FORMAT)
  saved = json.loads(header.get("meta", "{}"))
  if saved != meta:
    diff = sorted(k for k in set(saved) | set(meta) if saved.get(k) != meta.get(k))
    raise DistillError(f"checkpoint {path} was made by another run (it differs in "
                       f"{', '.join(diff)}); use resume=False (--no-resume) or another work "
                       "directory")

  def fill(prefix: str, template: Any) -> Any:
    leaves, tree = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for p, leaf in leaves:
      name = prefix + jax.tree_util.keystr(p)
      if name not in tensors:
        raise DistillError(f"checkpoint {path} lacks {name}; use resume=False (--no-resume)")
      value = tensors[name]
      if value.size == np.size(leaf):  # safetensors keeps a scalar as [1]
        value = value.reshape(np.shape(leaf))
      if tuple(value.shape) != tuple(np.shape(leaf)) or value.dtype != np.asarray(leaf).dtype:
        raise DistillError(f"checkpoint {path}: {name} is {value.dtype}{list(value.shape)}, "
                           f"expected {np.asarray(leaf).dtype}{list(np.shape(leaf))}")
      out.append(jnp.asarray(value))
    return jax.tree_util.tree_unflatten(tree, out)

  history = json.loads(header.get("history") or "{}")
  return int(header["step"]), fill("trainable", trainable), fill("opt", opt_state), history


# --------------------------------------------------------------------------------------------
# Saving the distilled draft.


def draft_tensors(params: Any) -> dict[str, np.ndarray]:
  """A float params tree as the tensors of a jspec file: matrices [I, O], tables [V, D].

  Args:
    params: `Dense` / `Table` leaves and plain arrays.

  Returns:
    {jspec path: array}.
  """
  out = {}
  leaves, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=weights.is_leaf)
  for path, leaf in leaves:
    if leaf is None:
      continue
    name = model.path_name(path)
    if isinstance(leaf, weights.Dense):
      out[name] = np.asarray(leaf.w)
    elif isinstance(leaf, weights.Table):
      out[name] = np.asarray(leaf.t)
    elif weights.is_leaf(leaf):
      raise DistillError(f"{name} is a {type(leaf).__name__}: only float leaves can be saved")
    else:
      out[name] = np.asarray(leaf)
  return out


def save_draft(path, cfg: config_lib.Qwen2Config, params: Any,
               record: dict[str, Any]) -> pathlib.Path:
  """Writes a distilled draft as a jspec checkpoint with its distillation record.

  The file is what `convert.store.save` writes (format, version and config in
  the metadata, tensors by their params paths, checked against the config,
  written to a temporary and renamed), plus the record under
  `distill_data.METADATA_KEY`, which `store.save` has no parameter for.

  Args:
    path: the destination file.
    cfg: the draft's config.
    params: its float params.
    record: the distillation record (prompt_hashes, recipe, costs).

  Returns:
    The path written.
  """
  path = store.resolve_path(path)
  tensors = draft_tensors(params)
  want = keys.expected_shapes(cfg)
  if set(tensors) != set(want) or any(tuple(tensors[k].shape) != want[k] for k in want):
    raise DistillError("the trained draft's tensors do not match its config")
  meta = {"format": store.FORMAT, "format_version": store.FORMAT_VERSION,
          "config": json.dumps(cfg.to_dict(), sort_keys=True), "blocks": json.dumps({}),
          distill_data.METADATA_KEY: json.dumps(record, sort_keys=True)}
  return _write_safetensors(path, tensors, meta)


# --------------------------------------------------------------------------------------------
# The whole run.


@dataclasses.dataclass
class Report:
  """What a distillation did.

  Attributes:
    path: the distilled draft file.
    steps: optimizer steps done in all (resumed runs included).
    resumed_from: the step this call resumed at (0: from the start).
    stopped_early: max_minutes or max_steps ended training before its last step.
    curve: per step (resumed runs included): step, loss, agree, tvd, q_top,
      grad_norm, lr and its seconds.
    evals: held-out evaluations: step and `evaluate`'s figures.
    data: the data's meta (sequences, generated tokens, costs).
    train_s: seconds of training in all (resumed runs and compiles included).
    compile_s: seconds of this call's first step (its compile).
    trained_tokens: loss positions seen by the optimizer in all.
  """

  path: pathlib.Path
  steps: int
  resumed_from: int
  stopped_early: bool
  curve: list[dict[str, float]]
  evals: list[dict[str, float]]
  data: dict[str, Any]
  train_s: float
  compile_s: float
  trained_tokens: int


def _check_bundle(bundle: Any) -> None:
  """Raises a one-line `DistillError` unless bundle is a pair whose vocabularies match."""
  if not isinstance(bundle, bundle_lib.Bundle):
    raise DistillError(f"bundle must be a jspec.Bundle (from jspec.load), got "
                       f"{type(bundle).__name__}")
  if bundle.draft is None:
    raise DistillError("the bundle has no draft model to distill: load one (jspec.load(target, "
                       "draft=...))")
  try:
    bundle_lib.check_pair(bundle.target.cfg, bundle.draft.cfg, bundle.tokenizer)
  except ValueError as e:
    raise DistillError(str(e)) from None


def _order(n: int, seed: int, epoch: int) -> np.ndarray:
  """The training sequences' order in one epoch: a fixed function of seed and epoch (resume)."""
  return np.random.default_rng([seed, epoch]).permutation(n)


def _split(data: Data, fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(training, held-out) sequence indices: held out by prompt hash, so stable across runs.

  The score is a hash of the prompt's hash, not the hash itself: the
  built-in prompts are ordered by their hash, so a prefix of them (a
  smaller set) has small hashes only, and would all fall below `fraction`.
  """
  if fraction <= 0 or len(data) < 2:
    return np.arange(len(data)), np.zeros((0,), np.int64)
  scores = np.array([int(hashlib.sha256(f"held-out:{h}".encode()).hexdigest()[:8], 16) / 16**8
                     for h in data.hashes])
  held = scores < fraction
  if held.all():
    held[np.argmax(scores)] = False
  return np.flatnonzero(~held), np.flatnonzero(held)


def _batch_rows(train_idx: np.ndarray, seed: int, step: int, per_epoch: int,
                batch: int) -> np.ndarray:
  """The training sequences of one step: a fixed function of the step (so a resume sees the same).

  Args:
    train_idx: [N] the training sequences' indices.
    seed: the recipe's seed.
    step: steps done before this one.
    per_epoch: steps per pass over the training sequences.
    batch: sequences per step.

  Returns:
    [batch] sequence indices.
  """
  epoch, pos = divmod(step, per_epoch)
  return train_idx[_order(len(train_idx), seed, epoch)[pos * batch:(pos + 1) * batch]]


def _initial_state(cfg: config_lib.Qwen2Config, params: Any, recipe: Recipe, tx,
                   ckpt: pathlib.Path, meta: dict[str, Any],
                   resume: bool) -> tuple[int, Any, Any, dict[str, Any]]:
  """Where training starts: the untrained part and a fresh optimizer, or a checkpoint's.

  Args:
    cfg: the draft's config.
    params: its float params.
    recipe: what is trained.
    tx: the optax transformation.
    ckpt: the checkpoint file.
    meta: what this run is (a checkpoint resumes only if it matches).
    resume: continue from `ckpt` when it exists.

  Returns:
    (steps done, the trained part, the optax state, the history so far).
  """
  trainable = init_trainable(cfg, params, recipe)
  opt_state = tx.init(trainable)
  history: dict[str, Any] = {"curve": [], "evals": [], "train_s": 0.0}
  if not (resume and ckpt.is_file()):
    return 0, trainable, opt_state, history
  start, trainable, opt_state, saved = load_checkpoint(ckpt, trainable, opt_state, meta)
  history.update(saved)
  return start, trainable, opt_state, history


def train(cfg: config_lib.Qwen2Config, params: Any, data: Data, recipe: Recipe,
          work_dir: pathlib.Path, resume: bool = True, progress: bool = True,
          max_minutes: Optional[float] = None, base: str = "",
          max_steps: Optional[int] = None) -> tuple[Any, Report]:
  """Trains the draft on the data, checkpointing as it goes.

  Args:
    cfg: the draft's config.
    params: its float params (`float_params`).
    data: the training data.
    recipe: the recipe.
    work_dir: where the checkpoint lives.
    resume: continue from the checkpoint there, if any.
    progress: show a progress bar (loss and estimated acceptance).
    max_minutes: stop training after this long (a checkpoint is kept; a
      later call resumes).
    base: the base draft's fingerprint (a checkpoint resumes only onto it).
    max_steps: stop after this many steps in this call (a checkpoint is
      kept; a later call resumes).

  Returns:
    (the trained part, the `Report` without its path).
  """
  _require_optax()
  train_idx, eval_idx = _split(data, recipe.eval_fraction)
  if len(train_idx) == 0:
    raise DistillError("no training sequences after holding some out")
  batch = min(recipe.batch_size, len(train_idx))
  per_epoch = max(len(train_idx) // batch, 1)
  total = recipe.steps or recipe.epochs * per_epoch
  tx = optimizer(recipe, total)
  lr = schedule(recipe, total)
  meta = {"recipe": recipe.train_key(), "data": _digest([data.meta["recipe"], data.hashes,
                                                         data.meta.get("target")]),
          "draft": base, "total_steps": total}
  ckpt = work_dir / "checkpoint.safetensors"
  start, trainable, opt_state, history = _initial_state(cfg, params, recipe, tx, ckpt, meta,
                                                        resume)
  step_fn = make_step(cfg, recipe, tx)
  if start == 0 and len(eval_idx):
    history["evals"].append({"step": 0, **evaluate(cfg, params, trainable, recipe, data,
                                                   eval_idx)})
  bar = _bar(total=total, initial=start, desc="distill: training", unit="step",
             disable=not progress)
  t0 = time.perf_counter()
  before_s = history["train_s"]
  compile_s = 0.0
  stopped = False
  ema_loss = ema_acc = None
  step = start

  def keep(at_step: int) -> None:
    history["train_s"] = before_s + time.perf_counter() - t0
    save_checkpoint(ckpt, at_step, trainable, opt_state, meta, history)

  try:
    while step < total:
      rows = _batch_rows(train_idx, recipe.seed, step, per_epoch, batch)
      feed = {k: jnp.asarray(v) for k, v in data.rows(rows).items()}
      t = time.perf_counter()
      trainable, opt_state, metrics = step_fn(trainable, opt_state, params, feed)
      metrics = {k: float(v) for k, v in metrics.items()}
      if step == start:
        compile_s = time.perf_counter() - t
      step += 1
      history["curve"].append({"step": step, **metrics, "lr": float(lr(step - 1)),
                               "s": time.perf_counter() - t})
      ema_loss = metrics["loss"] if ema_loss is None else 0.9 * ema_loss + 0.1 * metrics["loss"]
      ema_acc = metrics["agree"] if ema_acc is None else 0.9 * ema_acc + 0.1 * metrics["agree"]
      # accept: the draft's argmax agreeing with the target's on the batch
      # (greedy acceptance per draft), smoothed over steps.
      bar.set_postfix(loss=f"{ema_loss:.4f}", accept=f"{ema_acc:.3f}")
      bar.update(1)
      if recipe.eval_every and step % recipe.eval_every == 0 and step < total and len(eval_idx):
        history["evals"].append({"step": step, **evaluate(cfg, params, trainable, recipe, data,
                                                          eval_idx)})
      if step % recipe.checkpoint_every == 0 or step == total:
        keep(step)
      out_of_time = max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes
      if (out_of_time or (max_steps is not None and step - start >= max_steps)) and step < total:
        keep(step)
        stopped = True
        break
  except KeyboardInterrupt:
    bar.close()
    try:
      keep(step)
      where = f"at step {step}"
    except (RuntimeError, ValueError):  # interrupted inside a step: its inputs were donated
      where = f"at step {step - step % recipe.checkpoint_every} (the last one kept)"
    print(f"\njspec distill: interrupted; checkpoint {where} in {ckpt} (run again to resume)",
          file=sys.stderr)
    raise
  bar.close()
  if len(eval_idx) and (not history["evals"] or history["evals"][-1]["step"] != step):
    history["evals"].append({"step": step, **evaluate(cfg, params, trainable, recipe, data,
                                                      eval_idx)})
    keep(step)
  history["train_s"] = before_s + time.perf_counter() - t0
  per_row = float(data.mask[train_idx].sum()) / len(train_idx)
  report = Report(pathlib.Path(), step, start, stopped, history["curve"], history["evals"],
                  dict(data.meta), history["train_s"], compile_s, int(per_row * batch * step))
  return trainable, report


def prepare_data(bundle: bundle_lib.Bundle, prompts: Optional[Sequence[Any]], recipe: Recipe,
                 work_dir: pathlib.Path, resume: bool = True, progress: bool = True,
                 held_out: Optional[dict[str, str]] = None) -> Data:
  """The data phase: the training sequences and labels, made once and kept in `work_dir`.

  Args:
    bundle: the pair (any stored forms).
    prompts: training prompts (see `distill`).
    recipe: the recipe.
    work_dir: where `data.safetensors` is kept.
    resume: reuse the data file there when it was made by the same prompts,
      recipe and models.
    progress: progress bars on stderr.
    held_out: {name: text} of prompts never to train on (None: the bench's).

  Returns:
    The `Data`.

  Raises:
    DistillError: bad prompts or bundle, or a data file of another run.
  """
  _check_bundle(bundle)
  items = _as_prompts(prompts)
  held = distill_data.eval_texts() if held_out is None else held_out
  kept = distill_data.disjoint(items, held)
  if not kept:
    raise DistillError("every training prompt is an evaluation prompt; give others")
  path = work_dir / "data.safetensors"
  if resume and path.is_file():
    data = Data.load(path)
    want = _digest([distill_data.prompt_hash(p.text) for p in kept])
    if (data.meta.get("recipe") != recipe.data_key() or data.meta.get("prompts_digest") != want
        or data.meta.get("draft") != fingerprint(bundle.draft)
        or data.meta.get("target") != fingerprint(bundle.target)):
      raise DistillError(f"{path} holds data of another run (other prompts, recipe or models); "
                         "use resume=False (--no-resume) or another work directory")
    return data
  partial = work_dir / "continuations.json"
  if not resume:
    partial.unlink(missing_ok=True)
  data = make_data(bundle, kept, recipe, progress, partial)
  data.save(path)
  return data


def finish(cfg: config_lib.Qwen2Config, params: Any, data: Data, recipe: Recipe, out: pathlib.Path,
           work_dir: pathlib.Path, resume: bool = True, progress: bool = True,
           max_minutes: Optional[float] = None, max_steps: Optional[int] = None) -> Report:
  """The training and save phases: trains on `data` and writes the distilled draft to `out`.

  Args:
    cfg: the draft's config.
    params: its float params (`float_params`, or a checkpoint's `model.params_from_tensors`).
    data: from `prepare_data`.
    recipe: the recipe.
    out: the distilled draft's file.
    work_dir: where the checkpoint is kept.
    resume: continue from the checkpoint there.
    progress: a progress bar on stderr.
    max_minutes: stop training after this long (a later call resumes).
    max_steps: stop after this many steps in this call (a later call resumes).

  Returns:
    The `Report`.
  """
  trainable, report = train(cfg, params, data, recipe, work_dir, resume, progress, max_minutes,
                            data.meta["draft"], max_steps)
  merged = merged_params(params, trainable, recipe)
  record = {
      "prompt_hashes": sorted(set(data.hashes)),
      "recipe": {**dataclasses.asdict(recipe), "lora_matrices": list(recipe.lora_matrices)},
      "base_draft": data.meta["draft"], "target": data.meta["target"],
      "steps": report.steps, "stopped_early": report.stopped_early,
      "data": report.data, "train_s": report.train_s, "trained_tokens": report.trained_tokens,
      "evals": report.evals,
      "curve": [{k: round(v, 6) for k, v in c.items()} for c in report.curve],
  }
  report.path = save_draft(out, cfg, merged, record)
  return report


def _paths(out: Any, work_dir: Any) -> tuple[pathlib.Path, pathlib.Path]:
  """(the output file, the work directory: `<out>.work` unless given)."""
  out = store.resolve_path(pathlib.Path(out).expanduser())
  work = pathlib.Path(work_dir).expanduser() if work_dir else out.with_name(out.name + ".work")
  return out, work


def _check_limits(max_minutes: Any, max_steps: Any) -> None:
  """Raises a one-line `DistillError` for a max_minutes or max_steps that is not a positive number."""
  if max_minutes is not None and (not _is_number(max_minutes) or max_minutes <= 0):
    raise DistillError(f"max_minutes={max_minutes!r}: expected a number > 0")
  if max_steps is not None and (not _is_int(max_steps) or max_steps < 1):
    raise DistillError(f"max_steps={max_steps!r}: expected an integer >= 1")


def distill(bundle: bundle_lib.Bundle, prompts: Optional[Sequence[Any]] = None,
            out: Union[str, os.PathLike] = "distilled.jspec.safetensors", *,
            recipe: Optional[Recipe] = None, work_dir: Optional[Union[str, os.PathLike]] = None,
            resume: bool = True, progress: bool = True, max_minutes: Optional[float] = None,
            max_steps: Optional[int] = None, held_out: Optional[dict[str, str]] = None,
            **recipe_kwargs) -> Report:
  """Distills the bundle's draft toward its target and writes the new draft file.

  Args:
    bundle: the pair, its draft in float (`jspec.load(..., draft_int8=False)`;
      the target in any form).
    prompts: training prompts: strings (continued as they stand),
      `distill_data.Prompt`s (kind "chat" goes through the chat template) or
      token id lists; None: `distill_data.training_prompts()` (stdlib code
      and built-in chat instructions, none of them an evaluation prompt).
    out: the distilled draft's file.
    recipe: a `Recipe` (None: the defaults).
    work_dir: where the data and checkpoints live (None: `<out>.work`).
    resume: reuse the data and continue from the checkpoint in work_dir.
    progress: progress bars on stderr.
    max_minutes: stop training after this long and save what there is (a
      later call resumes).
    max_steps: stop after this many steps in this call and save what there
      is (a later call resumes).
    held_out: {name: text} of prompts that must not be trained on (None:
      the bench's evaluation prompts); matching training prompts are dropped.
    **recipe_kwargs: fields of `Recipe`, replacing those of `recipe`.

  Returns:
    The `Report`; the file is `report.path`.

  Raises:
    DistillError: bad prompts, bundle or recipe, or a work directory of another run.
  """
  _require_optax()
  recipe = make_recipe(recipe, **recipe_kwargs)
  _check_limits(max_minutes, max_steps)
  out, work = _paths(out, work_dir)
  _check_bundle(bundle)
  params = float_params(bundle.draft)  # an int8 draft is refused before any data is made
  data = prepare_data(bundle, prompts, recipe, work, resume, progress, held_out)
  return finish(bundle.draft.cfg, params, data, recipe, out, work, resume, progress, max_minutes,
                max_steps)


# --------------------------------------------------------------------------------------------
# `jspec distill`.


def _read_prompts(path: str) -> list[distill_data.Prompt]:
  """Training prompts from a JSON Lines file: a string, {"text": ..., "chat": bool} or {"ids": [...]} a line."""
  try:
    lines = pathlib.Path(path).expanduser().read_text(encoding="utf-8").splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise DistillError(f"--prompts {path}: cannot read it ({e})") from None
  out = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      item = json.loads(line)
    except json.JSONDecodeError as e:
      raise DistillError(f"--prompts {path}, line {n}: not JSON ({e.msg}); expected a JSON "
                         'string or {"text": ..., "chat": true|false}') from None
    if isinstance(item, dict) and isinstance(item.get("text"), str):
      kind = "chat" if item.get("chat") else "code"
      out.append(distill_data.Prompt(kind, item["text"], f"{path}:{n}"))
    elif (isinstance(item, dict) and isinstance(item.get("ids"), list) and item["ids"]
          and all(isinstance(t, int) and not isinstance(t, bool) for t in item["ids"])):
      out.append(distill_data.Prompt("code", " ".join(str(t) for t in item["ids"]),
                                     f"ids:{path}:{n}"))
    elif isinstance(item, str):
      out.append(distill_data.Prompt("code", item, f"{path}:{n}"))
    else:
      raise DistillError(f"--prompts {path}, line {n}: expected a JSON string, "
                         '{"text": ..., "chat": true|false} or {"ids": [token ids]}')
  if not out:
    raise DistillError(f"--prompts {path}: no prompts in it")
  return out


def build_parser(prog: str = "jspec distill"):
  """The `jspec distill` argument parser (errors are one line, as for every jspec command).

  Args:
    prog: the program name shown in help.

  Returns:
    The parser.
  """
  from jspec import cli  # pylint: disable=import-outside-toplevel  (cli imports this lazily)

  d = Recipe()
  num, integer = cli._number(float), cli._number(int)  # pylint: disable=protected-access
  p = cli._Parser(prog=prog, description="Train the draft to agree with the target (distillation "  # pylint: disable=protected-access
                  "on the draft's or the target's continuations of training prompts) and write "
                  "a new draft file that jspec load/generate take (--draft-model).")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--model", metavar="NAME", help="a known pair (default: qwen2.5-coder)")
  which.add_argument("--target", metavar="PATH", help="target checkpoint (with --draft-model)")
  p.add_argument("--draft-model", metavar="PATH", help="the draft to distill")
  p.add_argument("--tokenizer", metavar="PATH", help="tokenizer source for a target without one")
  p.add_argument("--out", default="distilled.jspec.safetensors", metavar="PATH",
                 help="the distilled draft file (default: distilled.jspec.safetensors)")
  p.add_argument("--work-dir", metavar="DIR", help="data and checkpoints (default: OUT.work)")
  p.add_argument("--no-resume", action="store_true",
                 help="start over instead of reusing the data and checkpoint in the work dir")
  p.add_argument("--prompts", metavar="FILE", help="training prompts, JSON Lines: a string "
                 'per line, {"text": ..., "chat": true} or {"ids": [...]} (default: the '
                 "built-in set)")
  p.add_argument("--code-prompts", type=integer, default=768, metavar="N",
                 help="built-in stdlib code prompts (default: 768)")
  p.add_argument("--chat-prompts", type=integer, default=256, metavar="N",
                 help=f"built-in chat instructions, at most {len(distill_data.CHAT)} "
                 "(default: 256)")
  p.add_argument("--max-minutes", type=num, metavar="M",
                 help="stop training after M minutes and save (run again to resume)")
  p.add_argument("--max-steps", type=integer, metavar="N",
                 help="stop after N steps in this run and save (run again to resume)")
  p.add_argument("--json", action="store_true", help="print the report as one JSON object")
  r = p.add_argument_group("recipe")
  r.add_argument("--data", choices=DATA, default=d.data,
                 help=f"whose continuations to train on (default: {d.data})")
  r.add_argument("--loss", choices=LOSSES, default=d.loss, help=f"divergence (default: {d.loss})")
  r.add_argument("--train", choices=TRAIN, default=d.train,
                 help=f"what to train (default: {d.train})")
  r.add_argument("--lora-rank", type=integer, default=d.lora_rank, metavar="R")
  r.add_argument("--lora-alpha", type=num, default=d.lora_alpha, metavar="A")
  r.add_argument("--lora-matrices", default=",".join(d.lora_matrices), metavar="LIST",
                 help=f"comma-separated, of {','.join(MATRICES)}")
  r.add_argument("--last-layers", type=integer, default=d.last_layers, metavar="N")
  r.add_argument("--learning-rate", "--lr", type=num, default=d.learning_rate, metavar="LR")
  r.add_argument("--warmup-steps", type=integer, default=d.warmup_steps, metavar="N")
  r.add_argument("--decay", choices=DECAYS, default=d.decay)
  r.add_argument("--final-lr-fraction", type=num, default=d.final_lr_fraction, metavar="F")
  r.add_argument("--weight-decay", type=num, default=d.weight_decay, metavar="W")
  r.add_argument("--clip-norm", type=num, default=d.clip_norm, metavar="C")
  r.add_argument("--batch-size", type=integer, default=d.batch_size, metavar="B")
  r.add_argument("--epochs", type=integer, default=d.epochs, metavar="E")
  r.add_argument("--steps", type=integer, default=d.steps, metavar="N",
                 help="optimizer steps (default 0: --epochs passes)")
  r.add_argument("--gen-tokens", type=integer, default=d.gen_tokens, metavar="N")
  r.add_argument("--max-context", type=integer, default=d.max_context, metavar="N")
  r.add_argument("--temperature", type=num, default=d.temperature, metavar="T",
                 help="the decoding temperature to distill for (default 0: greedy)")
  r.add_argument("--sample-temperature", type=num, default=d.sample_temperature, metavar="T")
  r.add_argument("--top-k", type=integer, default=d.top_k, metavar="K")
  r.add_argument("--eval-fraction", type=num, default=d.eval_fraction, metavar="F")
  r.add_argument("--eval-every", type=integer, default=d.eval_every, metavar="N")
  r.add_argument("--checkpoint-every", type=integer, default=d.checkpoint_every, metavar="N")
  r.add_argument("--gen-batch", type=integer, default=d.gen_batch, metavar="N",
                 help="prompts per call when the draft samples")
  r.add_argument("--target-batch", type=integer, default=d.target_batch, metavar="N",
                 help="prompts per call when the target generates (1: speculative)")
  r.add_argument("--label-batch", type=integer, default=d.label_batch, metavar="N")
  r.add_argument("--seed", type=integer, default=d.seed)
  return p


def _recipe_from(args) -> Recipe:
  """The `Recipe` from parsed `jspec distill` arguments (errors name the flag)."""
  names = [f.name for f in dataclasses.fields(Recipe)]
  values = {n: getattr(args, n) for n in names if n != "lora_matrices"}
  values["lora_matrices"] = tuple(m.strip() for m in args.lora_matrices.split(",") if m.strip())
  try:
    return Recipe(**values)
  except DistillError as e:
    flag = str(e).split("=", 1)[0].replace("_", "-")
    raise DistillError(f"--{flag}: {e}") from None


def main(argv: Sequence[str], prog: str = "jspec distill") -> int:
  """Runs `jspec distill`: loads the pair, makes the data, frees the target, trains, saves.

  Args:
    argv: arguments after the subcommand.
    prog: the program name shown in help.

  Returns:
    0; errors raise (`jspec.cli.main` prints them as one line and exits 2).
  """
  from jspec import fetch  # pylint: disable=import-outside-toplevel
  from jspec import loading  # pylint: disable=import-outside-toplevel

  args = build_parser(prog).parse_args(list(argv))
  _require_optax()
  recipe = _recipe_from(args)
  _check_limits(args.max_minutes, args.max_steps)
  if args.target and not args.draft_model:
    raise DistillError("--target needs --draft-model (the draft to distill)")
  prompts = (_read_prompts(args.prompts) if args.prompts else
             distill_data.training_prompts(args.code_prompts, args.chat_prompts))
  if not prompts:
    raise DistillError("no training prompts (--code-prompts 0 and --chat-prompts 0)")
  target = args.target or args.model or loading.DEFAULT_PAIR
  draft = args.draft_model
  if draft is None and target in fetch.PAIRS:
    target, draft = fetch.PAIRS[target]
  if draft is None:
    raise DistillError(f"{target} is not a pair: pass --draft-model PATH, the draft to distill")
  out, work = _paths(args.out, args.work_dir)
  progress = True  # a terminal redraws the bars; a log gets a line a minute (`_bar`)
  bundle = loading.load(target, draft, progress=sys.stderr.isatty(), tokenizer=args.tokenizer,
                        settings=bundle_lib.Settings(draft_int8=False, draft_vocab=0))
  data = prepare_data(bundle, prompts, recipe, work, not args.no_resume, progress)
  cfg = bundle.draft.cfg
  params = float_params(bundle.draft)
  del bundle  # the target is not needed to train: free its memory first
  report = finish(cfg, params, data, recipe, out, work, not args.no_resume, progress,
                  args.max_minutes, args.max_steps)
  if args.json:
    print(json.dumps({"path": str(report.path), "steps": report.steps,
                      "stopped_early": report.stopped_early, "evals": report.evals,
                      "data": report.data, "train_s": report.train_s,
                      "trained_tokens": report.trained_tokens}))
  else:
    first, last = (report.evals[0], report.evals[-1]) if report.evals else ({}, {})
    line = f"jspec: distilled draft {report.path} after {report.steps} steps"
    if first:
      line += (f"; held-out agreement {first['agree']:.3f} -> {last['agree']:.3f}, "
               f"{recipe.loss} {first['loss']:.4f} -> {last['loss']:.4f}")
    print(line + (" (stopped early: run again to resume)" if report.stopped_early else ""),
          file=sys.stderr)
  return 0
