"""Reads an HF checkpoint directory: config.json and safetensors shards.

Tensors are read one at a time through `safetensors.safe_open`, which maps the
file and parses nothing but its JSON header, so no code from the checkpoint
ever runs. Pickle checkpoints (`pytorch_model.bin`, `*.pt`) are refused:
unpickling executes whatever the file says.

bfloat16 tensors come back as numpy arrays of `ml_dtypes.bfloat16` (safetensors
uses it when it is installed, and jax depends on it).
"""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import numpy as np
import safetensors

from convert import keys
from convert import config as config_lib

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# safetensors dtype names of the float tensors a checkpoint may hold.
_DTYPES = {"F32": keys.DTYPES["float32"], "BF16": keys.DTYPES["bfloat16"],
           "F16": keys.DTYPES["float16"]}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_checkpoint_dir(path: pathlib.Path) -> bool:
  """Whether `path` looks like an HF checkpoint directory (holds config.json).

  Args:
    path: any path.

  Returns:
    True for a directory with a config.json.
  """
  return path.is_dir() and (path / "config.json").is_file()


def _shard_files(root: pathlib.Path) -> list[pathlib.Path]:
  """The safetensors files of a checkpoint, from its index or the single file."""
  index = root / INDEX
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise keys.ConvertError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") \
          from None
    shards = [root / name for name in dict.fromkeys(weight_map.values())]
    for shard in shards:
      if not shard.is_file():
        raise keys.ConvertError(f"{index}: lists shard {shard.name!r}, which is not in {root}")
    return shards
  if (root / SINGLE).is_file():
    return [root / SINGLE]
  pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
  if pickles:
    raise keys.ConvertError(
        f"{root}: holds only pickle checkpoints ({', '.join(pickles)}); pickle files are not "
        "loaded because unpickling runs code. Convert them to safetensors first (e.g. "
        "transformers' save_pretrained(dir, safe_serialization=True) on a trusted machine)")
  raise keys.ConvertError(f"{root}: no {SINGLE}, {INDEX} or other *.safetensors file")


class Source:
  """An HF checkpoint directory, opened: its config and its tensors by name.

  Attributes:
    config: the Qwen2Config from config.json.
    names: HF tensor names in file order.
    path: the directory.
  """

  def __init__(self, path):
    """Args:
      path: an HF checkpoint directory (config.json + safetensors).
    """
    self.path = pathlib.Path(path)
    if not self.path.is_dir():
      raise keys.ConvertError(f"{self.path}: not a directory")
    self.config = config_lib.from_hf_json(self.path)
    self._files = {}  # shard path -> open safe_open handle
    self._where = {}  # tensor name -> shard path
    for shard in _shard_files(self.path):
      handle = self._open(shard)
      for name in handle.keys():
        if name in self._where:
          raise keys.ConvertError(f"{self.path}: tensor {name!r} appears twice, in "
                                  f"{self._where[name].name} and {shard.name}")
        self._where[name] = shard
    self.names = list(self._where)

  def _open(self, shard: pathlib.Path):
    try:
      handle = safetensors.safe_open(str(shard), framework="numpy")
    except Exception as e:  # safetensors raises its own SafetensorError and OSError
      raise keys.ConvertError(f"{shard}: not a readable safetensors file, truncated or "
                              f"corrupted ({type(e).__name__}: {e})") from None
    self._files[shard] = handle
    return handle

  def label(self, name: str) -> str:
    """The tensor's name in the file (the HF name itself).

    Args:
      name: an HF tensor name from `names`.

    Returns:
      The same name.
    """
    return name

  def form(self, name: str, exact: bool = False) -> Optional[np.dtype]:
    """The dtype `read` returns for a tensor, from the file's header.

    Args:
      name: an HF tensor name from `names`.
      exact: unused, as for `read`.

    Returns:
      Its numpy dtype, or None for a dtype `keys.DTYPES` does not name.
    """
    shard = self._where[name]
    kind = self._files[shard].get_slice(name).get_dtype()
    return _DTYPES.get(kind)

  def read(self, name: str, exact: bool = False) -> np.ndarray:
    """Reads one tensor.

    Args:
      name: an HF tensor name from `names`.
      exact: unused: a safetensors tensor is always returned as stored.

    Returns:
      The tensor as stored (HF orientation, its own dtype).
    """
    shard = self._where[name]
    try:
      return self._files[shard].get_tensor(name)
    except Exception as e:
      raise keys.ConvertError(f"{shard}: cannot read tensor {name!r} "
                              f"({type(e).__name__}: {e})") from None

  def close(self) -> None:
    """Releases the file handles."""
    self._files.clear()
