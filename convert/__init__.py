"""Checkpoints -> jspec (config, params): HF safetensors directories, GGUF files, jspec files.

    cfg, tensors = convert.load_checkpoint("qwen2.5-coder-1.5b.gguf")
    # {"embed/table": [V, D], "layers/0/attn/q/w": [D, N*H], ...}: `jspec.loading` makes
    # them the model's params tree

Every source is read tensor by tensor and each tensor is placed on the device
as soon as it is converted, so the host never holds a second copy of the
model. `python -m convert SRC OUT` (see `convert.cli`) converts once to a jspec
file, which later loads without dequantizing anything; it too writes each
tensor as soon as it is converted and holds no more than a tensor or two.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Callable, Optional

import jax
import numpy as np
import tqdm

from convert import gguf_blocks
from convert import gguf_file
from convert import hf
from convert import keys
from convert import store
from convert import config as config_lib

ConvertError = keys.ConvertError


def open_source(path):
  """Opens an HF checkpoint directory or a GGUF file for reading.

  Args:
    path: a directory with config.json and safetensors, or a .gguf file.

  Returns:
    A source with `.config`, `.path`, `.names` (HF tensor names), `.read(name)`
    (the tensor in HF orientation), `.label(name)` (its name in the file) and
    `.close()`.

  Raises:
    ConvertError: the path is neither, or cannot be read.
  """
  path = pathlib.Path(path)
  if not path.exists():
    raise ConvertError(f"{path}: no such file or directory")
  if path.is_dir():
    if hf.is_checkpoint_dir(path):
      return hf.Source(path)
    raise ConvertError(f"{path}: a directory without config.json (expected an HF checkpoint "
                       "directory: config.json and model.safetensors or its shards)")
  if gguf_file.is_gguf_file(path):
    return gguf_file.Source(path)
  if path.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
    raise ConvertError(f"{path}: a pickle checkpoint; pickle files are not loaded because "
                       "unpickling runs code. Convert it to safetensors first")
  if path.suffix == ".safetensors":
    raise ConvertError(f"{path}: a bare safetensors file carries no config; pass the HF "
                       "checkpoint directory that holds it and its config.json")
  raise ConvertError(f"{path}: not a GGUF file, an HF checkpoint directory or a jspec file")


def assemble(source, dtype: Any = "float32", put: Optional[Callable[[np.ndarray], Any]] = None,
             progress: bool = False) -> tuple[config_lib.Qwen2Config, dict[str, Any]]:
  """Reads, checks and converts every tensor of an open source.

  Args:
    source: from `open_source`.
    dtype: params dtype: "float32", "bfloat16" or "float16", or `keys.EXACT`
      (GGUF quantized matrices as exact int8 blocks, bfloat16 as it is).
    put: applied to each converted array (e.g. `jax.device_put`); None keeps numpy.
    progress: show a tqdm bar over tensors on stderr.

  Returns:
    (config, {jspec path: tensor}): arrays, and with `keys.EXACT`
    `gguf_blocks.Blocks` (numpy, HF orientation) for quantized matrices.
  """
  assembler = keys.Assembler(source.config, dtype, put, source=str(source.path))
  _feed(source, assembler, dtype, progress)
  return source.config, assembler.finish()


def _feed(source, assembler: keys.Assembler, dtype: Any, progress: bool) -> None:
  """Reads every tensor of a source into an assembler, one at a time."""
  names = tqdm.tqdm(source.names, desc=f"converting {source.path.name}", unit="tensor",
                    disable=not progress)
  exact = dtype == keys.EXACT
  for name in names:
    assembler.add(name, source.read(name, exact=exact), label=source.label(name))


def _forms(source, dtype: Any) -> dict[str, Any]:
  """What each param of a source will be (dtype, or int8-block form), before reading any data.

  A param the source lacks gets the plain dtype: converting then fails on
  it with the assembler's own message.
  """
  exact = dtype == keys.EXACT
  names = set(source.names)
  forms = {}
  for path, hf_name in keys.hf_names(source.config).items():
    form = source.form(hf_name, exact=exact) if hf_name in names else None
    forms[path] = form if isinstance(form, gguf_blocks.Form) else keys.stored_dtype(form, dtype)
  return forms


def load_checkpoint(path, dtype: Any = "float32",
                    progress: bool = False) -> tuple[config_lib.Qwen2Config, dict[str, Any]]:
  """Loads any supported checkpoint as jspec (config, params) on the default device.

  Args:
    path: an HF checkpoint directory (config.json + safetensors), a qwen2
      .gguf file, or a file written by `python -m convert` / `store.save`.
    dtype: params dtype: "float32", "bfloat16" or "float16".
    progress: show a progress bar over tensors.

  Returns:
    (Qwen2Config, {jspec path: jax array}) (`keys.expected_shapes` names them).

  Raises:
    ConvertError: the checkpoint is unreadable or does not match a Qwen2 model.
    config.ConfigError: its config asks for something jspec does not implement.
  """
  path = pathlib.Path(path)
  if store.is_jspec_file(store.resolve_path(path)):
    return store.load(path, dtype, put=jax.device_put)
  source = open_source(path)
  try:
    return assemble(source, dtype, put=jax.device_put, progress=progress)
  finally:
    source.close()


def _source_files(src: pathlib.Path) -> list[pathlib.Path]:
  """The files converting `src` reads: the GGUF itself, or an HF directory's config and weights."""
  if not src.is_dir():
    return [src]
  files = [src / "config.json", src / hf.INDEX, src / hf.SINGLE]
  try:
    files += hf._shard_files(src)  # pylint: disable=protected-access  (the index's shards)
  except ConvertError:
    pass  # reading the source reports it
  return files


def check_output(src, out) -> None:
  """Refuses an output that is the input, so that a conversion never replaces its own source.

  Args:
    src: the checkpoint to convert.
    out: the destination as given (a file, or a directory that gets
      jspec.safetensors).

  Raises:
    ConvertError: `out` resolves to a file the conversion reads, by its
      path, through symlinks or as a hard link.
  """
  dest = store.resolve_path(out)
  real = os.path.realpath(dest)
  for path in _source_files(pathlib.Path(src)):
    same = os.path.realpath(path) == real
    if not same and path.exists() and dest.exists():
      try:
        same = os.path.samefile(path, dest)
      except OSError:
        pass
    if same:
      named = f"{out}" if dest == pathlib.Path(out) else f"{out} ({dest})"
      raise ConvertError(f"output {named} is the input {path}: converting would replace the "
                         "checkpoint it reads; choose another output file")


def convert_checkpoint(src, out, dtype: Any = "float32", progress: bool = False) -> pathlib.Path:
  """Converts a checkpoint into a jspec file, writing each tensor as it is converted.

  The file is laid out from the source's header first (`store.save_streamed`),
  so the host holds a tensor or two at a time, never the model; the file is
  the one `store.save` writes from `assemble`'s tensors.

  Args:
    src: an HF checkpoint directory or a .gguf file.
    out: destination file, or an existing directory (gets jspec.safetensors).
    dtype: params dtype: "float32", "bfloat16" or "float16".
    progress: show a progress bar over tensors.

  Returns:
    The path written.

  Raises:
    ConvertError: an unusable source, or an output that is the source
      (`check_output`).
  """
  keys.resolve_dtype(dtype)  # fail before the slow part
  check_output(src, out)  # before reading anything
  source = open_source(src)
  try:
    cfg = source.config

    def fill(put):
      assembler = keys.Assembler(cfg, dtype, source=str(source.path), sink=put,
                                 tied_head="lm_head.weight" in source.names)
      _feed(source, assembler, dtype, progress)
      assembler.finish()

    return store.save_streamed(out, cfg, _forms(source, dtype), fill)
  finally:
    source.close()
