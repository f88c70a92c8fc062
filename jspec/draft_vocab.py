"""A frequency-ranked draft vocabulary (FR-Spec): the draft's head keeps only the likeliest tokens.

The draft's output head is a large share of its bytes and of its step
(docs/decisions-compact.md), and most of its rows are tokens the output
rarely holds. With `jspec.Settings(draft_vocab=K)` the draft keeps the head
rows of the K most frequent ids (and every special id; by default `DEFAULT`
of them where the vocabulary is larger and a tokenizer ranks it), its logits
elsewhere are -inf (`jspec.modules.Qwen2`), so q is zero outside the subset:
still a distribution, and rejection sampling against the target's p keeps
the output exactly the target's (Zhao et al. 2025, "FR-Spec").

The ranking is counted, not shipped: the Python standard library's sources
(the corpus `jspec.distill_data` draws code prompts from, on every machine)
and its chat instructions, tokenized with the bundle's tokenizer; ties go
to the lower id. It is kept in the jspec cache keyed by the tokenizer's
sha256. A model without a tokenizer (tests) takes an explicit ranking, or
its ids in order.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from jspec import distill_data

RANKING_VERSION = "1"  # bump when the corpus or the counting changes
# K where `draft_vocab` is left to jspec (None): a draft whose vocabulary is
# larger and whose tokenizer ranks the ids keeps this many rows of its head
# (docs/decisions-compact.md, "The ranked draft vocabulary by default").
DEFAULT = 65536
# Ids of a request's prompts outside the subset that its draft may propose
# too, scored from the whole head (`with_prompt_ids`): what a frequency
# ranking misses most is the prompt's own identifiers.
PROMPT_ROWS = 256
_BATCH_CHARS = 4_000_000  # characters per encode_batch call: memory stays small


def check(k: Any, vocab: Optional[int] = None) -> Optional[int]:
  """A `draft_vocab` value, checked: None (jspec's default), 0 (the full head) or K (at most `vocab`).

  Args:
    k: the value given.
    vocab: the draft's vocabulary size, when known.

  Returns:
    None, 0 or K.

  Raises:
    ValueError: not a non-negative int, or more than the vocabulary.
  """
  if k is None:
    return None
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
    raise ValueError(f"draft_vocab={k!r}: expected a positive int (the draft's head keeps the "
                     "K most frequent tokens), 0 for the full vocabulary or None for jspec's "
                     f"default ({DEFAULT} where the vocabulary is larger)")
  if vocab is not None and k > vocab:
    raise ValueError(f"draft_vocab={k}: expected at most the draft's vocabulary of {vocab} "
                     "tokens (or 0 for all of it)")
  return int(k)


def resolve(k: Optional[int], vocab: int, ranked: bool) -> Optional[int]:
  """The rows a draft's head keeps, from a checked `draft_vocab` value.

  Args:
    k: `check`ed: None (jspec's default), 0 (the full head) or K.
    vocab: the draft's vocabulary size.
    ranked: whether a tokenizer or an explicit ranking orders the ids. The
      default cuts only a ranked vocabulary: the first ids in plain order
      miss common tokens (docs/decisions.md, "Removed: draft head cut").

  Returns:
    K, or None for the full head.

  Raises:
    ValueError: K past the vocabulary.
  """
  if k is None:
    return DEFAULT if ranked and vocab > DEFAULT else None
  return check(k, vocab) or None


def subset(k: int, vocab: int, ranking: Optional[Sequence[int]] = None,
           always: Iterable[int] = (), multiple: int = 1) -> np.ndarray:
  """The ids whose head rows the draft keeps: `always`, then the ranking's first, in id order.

  The count is rounded up to `multiple` (the kernels' panel width) with the
  next ids of the ranking, so the smaller head is stored as the full one is.

  Args:
    k: ids wanted from the ranking (`check`ed).
    vocab: the draft's vocabulary size (rows of its head).
    ranking: ids, most frequent first; None: 0, 1, 2, ... Ids past `vocab`
      are skipped, ids it leaves out follow in id order.
    always: ids kept whatever their rank (EOS, chat markers).
    multiple: the count is a multiple of this where the vocabulary allows.

  Returns:
    [K'] int32 ascending distinct ids, K <= K' <= vocab.
  """
  order = np.arange(vocab, dtype=np.int64) if ranking is None else np.asarray(ranking, np.int64)
  order = order[(order >= 0) & (order < vocab)]
  seen = np.zeros(vocab, bool)
  seen[order] = True
  order = np.concatenate([order, np.flatnonzero(~seen)])  # every id once, unranked last
  order = order[np.sort(np.unique(order, return_index=True)[1])]  # first occurrence wins
  keep = np.zeros(vocab, bool)
  keep[[i for i in always if 0 <= i < vocab]] = True
  count = int(keep.sum())
  want = min(vocab, -(-(k + count) // multiple) * multiple)
  ranked = order[~keep[order]]  # the ranking without the ids kept already
  keep[ranked[:want - count]] = True
  return np.flatnonzero(keep).astype(np.int32)


def with_prompt_ids(params: dict, vocab: int, prompts: Sequence[Sequence[int]]) -> dict:
  """A cut draft's params for one request: its prompts' ids outside the subset are scored too.

  The first `PROMPT_ROWS` distinct ids of the prompts, in order, that the
  subset lacks go into the params' `vocab_extra` (the rest of it V, unused),
  a host array of the same shape as before, so no program compiles again.

  Args:
    params: a draft's prepared params (returned as they are where its head
      is whole).
    vocab: the draft's vocabulary size V.
    prompts: the request's prompt ids, one list per row.

  Returns:
    The params, with `vocab_extra` replaced.
  """
  extra = params.get("vocab_extra") if isinstance(params, dict) else None
  if extra is None:
    return params
  flat = np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in prompts] or [[]])
  flat = flat[(flat >= 0) & (flat < vocab)]
  first = np.sort(np.unique(flat, return_index=True)[1])
  ordered = flat[first]
  new = ordered[~np.isin(ordered, np.asarray(params["vocab_ids"]))][:np.shape(extra)[0]]
  out = np.full(np.shape(extra), vocab, np.int32)
  out[:len(new)] = new
  return {**params, "vocab_extra": out}


def special_ids(tokenizer: Any) -> list[int]:
  """Every id a tokenizer adds or ends on (EOS, chat markers): the draft may always propose them.

  Args:
    tokenizer: a `jspec.tokenizer.Tokenizer`, or None.

  Returns:
    The ids, ascending.
  """
  if tokenizer is None:
    return []
  ids = set(int(i) for i in getattr(tokenizer, "eos_token_ids", ()))
  backend = getattr(tokenizer, "backend", None)
  if backend is not None:
    ids.update(int(i) for i in backend.get_added_tokens_decoder())
  return sorted(ids)


def corpus(root: Optional[pathlib.Path] = None) -> Iterable[str]:
  """The ranking's texts: the standard library's sources and the chat instructions.

  Args:
    root: the library's directory (None: this interpreter's).

  Yields:
    One text per file or instruction, in a fixed order.
  """
  for _, source in distill_data.stdlib_sources(root):
    yield source
  yield from distill_data.CHAT


def count(tokenizer: Any, texts: Iterable[str]) -> np.ndarray:
  """How often each id occurs in `texts`, tokenized in batches.

  Args:
    tokenizer: a `jspec.tokenizer.Tokenizer`.
    texts: the corpus.

  Returns:
    [V] int64 counts, V the tokenizer's vocabulary size.
  """
  counts = np.zeros(tokenizer.vocab_size, np.int64)
  batch, size = [], 0

  def flush():
    for enc in tokenizer.backend.encode_batch(batch, add_special_tokens=False):
      np.add.at(counts, np.asarray(enc.ids, np.int64), 1)

  for text in texts:
    batch.append(text)
    size += len(text)
    if size >= _BATCH_CHARS:
      flush()
      batch, size = [], 0
  if batch:
    flush()
  return counts


def order_by_count(counts: np.ndarray) -> np.ndarray:
  """Ids by count, most frequent first, ties by id: [V] counts -> [V] int32 ids."""
  return np.lexsort((np.arange(len(counts)), -counts)).astype(np.int32)


def tokenizer_digest(tokenizer: Any) -> str:
  """sha256 of the tokenizer's own JSON: the ranking is valid for exactly this tokenizer."""
  return hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()


def ranking(tokenizer: Any, cache: Optional[pathlib.Path] = None) -> np.ndarray:
  """The ids ranked by frequency in the corpus, from the cache or counted (seconds) and cached.

  Args:
    tokenizer: a `jspec.tokenizer.Tokenizer`.
    cache: the cache directory (None: `jspec.fetch.cache_dir()`).

  Returns:
    [V] int32 ids, most frequent first, ties by id.
  """
  from jspec import fetch  # pylint: disable=import-outside-toplevel  (platformdirs, only here)
  from convert import store  # pylint: disable=import-outside-toplevel
  digest = tokenizer_digest(tokenizer)
  path = pathlib.Path(cache or fetch.cache_dir()) / "draft_vocab" / f"{digest[:16]}.ranking.json"
  try:
    saved = json.loads(path.read_text())
    if saved.get("version") == RANKING_VERSION and saved.get("tokenizer_sha256") == digest:
      ids = np.asarray(saved["ids"], np.int32)
      if ids.shape == (tokenizer.vocab_size,):
        return ids
  except (OSError, ValueError, KeyError, TypeError):
    pass
  counts = count(tokenizer, corpus())
  ids = order_by_count(counts)
  text = json.dumps({"version": RANKING_VERSION, "tokenizer_sha256": digest,
                     "tokens_counted": int(counts.sum()), "ids": ids.tolist()})
  try:
    store.write_file_atomic(path, lambda tmp: pathlib.Path(tmp).write_text(text))
  except OSError as e:  # it only saves time
    print(f"jspec: cannot write the draft vocabulary ranking {path} "
          f"({e.strerror or type(e).__name__}); continuing without it", file=sys.stderr)
  return ids
