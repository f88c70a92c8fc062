"""A prepared model kept on disk and mapped back without a copy, so a second process skips the load.

`jspec.bundle.prepare` turns a checkpoint's tensors into the stored forms the
kernels read (panels, int8 blocks, the int8 draft). That costs seconds a
load, and reading the converted file costs more. This module writes the
prepared params once, each array at a 64-byte aligned offset, and maps them
back: `jax.device_put(..., may_alias=True)` then hands XLA the mapped pages
themselves on CPU, so a load reads nothing until a forward touches it, and
the pages are shared with the OS page cache.

The file is a valid safetensors file (a reader that ignores the
`__pad__/...` tensors sees every array by its params path); its metadata
records the tree (which typed leaf holds which arrays, `jspec.weights`),
the config, the backend and a key: a file made under other settings, on
another host's kernels or by another version of jspec is never read. Only
arrays and JSON are read: no code runs from the file.

The mapping is private (copy-on-write): a program that wrote to a weight
would change its own copy, never the file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import mmap
import os
import pathlib
import struct
from typing import Any

import jax
import numpy as np

import convert
from convert import config as config_lib
from convert import store
from jspec import bundle as bundle_lib
from jspec import cpu_kernels
from jspec import greedy_head
from jspec import model
from jspec import program_store
from jspec import weights

FORMAT = "jspec-prepared"
FORMAT_VERSION = "2"  # 2: k-quant block scales factored (`cpu_kernels.pack_factored`)
ALIGN = 64  # bytes: XLA's CPU client aliases host memory aligned to this, and copies otherwise

# Typed leaves the tree may name; anything else in a file is refused.
_LEAVES = {cls.__name__: cls for cls in (*weights.LEAVES, greedy_head.GreedyHead)}
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jax.numpy.bfloat16, "I8": np.int8,
           "U8": np.uint8, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class PreparedError(ValueError):
  """A prepared file that cannot be used: damaged, truncated, or made for something else."""


def key(source: str, role: str, dtype: str, settings: bundle_lib.Settings) -> str:
  """What a prepared file must have been made for: the checkpoint, the choices, the host, the code.

  Args:
    source: what the model is made from (the sha256 of its converted file).
    role: "target" or "draft".
    dtype: the storage asked for (`jspec.load`'s dtype for this role).
    settings: the load-time settings.

  Returns:
    A hex digest.
  """
  parts = {"source": source, "role": role, "dtype": dtype,
           "settings": dataclasses.asdict(settings), "backend": jax.default_backend(),
           "kernels": cpu_kernels.available(), "int8": cpu_kernels.int8_kind(),
           "code": program_store.source_digest(), "convert": _convert_digest(),
           "format": FORMAT_VERSION}
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _convert_digest() -> str:
  """sha256 of the converter's sources: they decide the tensors a prepared file was made from."""
  h = hashlib.sha256()
  for path in sorted(pathlib.Path(convert.__file__).resolve().parent.glob("*.py")):
    h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
  return h.hexdigest()


def _describe(tree: Any, name: str, arrays: dict[str, np.ndarray]) -> Any:
  """The JSON description of a params subtree; its arrays go into `arrays` under their names."""
  if tree is None:
    return None
  if isinstance(tree, dict):
    return {"dict": {k: _describe(v, f"{name}/{k}" if name else k, arrays)
                     for k, v in tree.items()}}
  if type(tree).__name__ in _LEAVES and isinstance(tree, _LEAVES[type(tree).__name__]):
    fields, static = {}, {}
    for f in dataclasses.fields(tree):
      value = getattr(tree, f.name)
      if not f.metadata.get("static", False):  # `jax.tree_util.register_dataclass`
        fields[f.name] = _describe(value, f"{name}:{f.name}", arrays)
      else:
        static[f.name] = value
    return {"leaf": type(tree).__name__, "fields": fields, "static": static}
  if hasattr(tree, "shape") and hasattr(tree, "dtype"):
    arrays[name] = np.asarray(tree)  # a view of a CPU jax array's buffer, not a copy
    return {"array": name}
  raise PreparedError(f"cannot store a {type(tree).__name__} in a prepared file")


def save(path: pathlib.Path, prepared: bundle_lib.Model, file_key: str) -> pathlib.Path:
  """Writes a prepared model, whole or not at all (a temporary beside it, fsynced, renamed).

  Args:
    path: destination.
    prepared: the model `bundle.prepare` returned.
    file_key: `key(...)` of what it was made from.

  Returns:
    path.
  """
  arrays: dict[str, np.ndarray] = {}
  tree = _describe(prepared.params, "", arrays)
  meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "key": file_key,
          "tree": json.dumps(tree), "config": json.dumps(prepared.cfg.to_dict(), sort_keys=True),
          "backend": json.dumps(dataclasses.asdict(prepared.backend))}
  # The header is padded so that the data starts at a multiple of ALIGN, and
  # each array at a multiple of ALIGN past that; padding tensors fill the
  # gaps (safetensors allows no holes).
  entries, order, offset = {}, [], 0
  for name, a in arrays.items():
    if a.dtype not in _NAMES:
      raise PreparedError(f"cannot store {name!r} of dtype {a.dtype}")
    gap = -offset % ALIGN
    if gap:
      pad = f"__pad__/{len(order)}"
      entries[pad] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
      order.append((pad, None))
      offset += gap
    entries[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                     "data_offsets": [offset, offset + a.nbytes]}
    order.append((name, a))
    offset += a.nbytes
  header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
  header = header.ljust(len(header) + (-(8 + len(header)) % ALIGN), b" ")

  def write(tmp: str) -> None:
    with open(tmp, "wb") as f:
      f.write(struct.pack("<Q", len(header)))
      f.write(header)
      for name, a in order:
        if a is None:
          f.write(b"\0" * (entries[name]["data_offsets"][1] - entries[name]["data_offsets"][0]))
        else:
          f.write(memoryview(np.ascontiguousarray(a)).cast("B"))

  return store.write_file_atomic(path, write)


def _rebuild(spec: Any, arrays: dict[str, Any]) -> Any:
  if spec is None:
    return None
  if not isinstance(spec, dict) or len(spec) not in (1, 3):
    raise PreparedError(f"its tree holds {str(spec)[:60]!r}")
  if "dict" in spec:
    return {k: _rebuild(v, arrays) for k, v in spec["dict"].items()}
  if "array" in spec:
    if spec["array"] not in arrays:
      raise PreparedError(f"its tree names an array {spec['array']!r} it does not hold")
    return arrays[spec["array"]]
  cls = _LEAVES.get(spec.get("leaf"))
  if cls is None:
    raise PreparedError(f"its tree names an unknown leaf type {spec.get('leaf')!r}")
  return cls(**{k: _rebuild(v, arrays) for k, v in spec["fields"].items()}, **spec["static"])


def load(path: pathlib.Path, file_key: str) -> bundle_lib.Model:
  """Maps a prepared model back: its arrays alias the file's pages on CPU.

  Args:
    path: a file `save` wrote.
    file_key: the key it must carry.

  Returns:
    The prepared `bundle.Model`.

  Raises:
    PreparedError: not such a file, made for another key, or damaged.
  """
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      (n,) = struct.unpack("<Q", f.read(8))
      if n > min(size - 8, 100_000_000):
        raise PreparedError(f"its header length {n} runs past the file")
      header = json.loads(f.read(n))
      mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
  except (OSError, struct.error, ValueError) as e:
    raise PreparedError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
  meta = header.pop("__metadata__", {}) if isinstance(header, dict) else {}
  if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
    raise PreparedError(f"{path}: not a prepared file of this version")
  if meta.get("key") != file_key:
    raise PreparedError(f"{path}: made for other settings, another host or another jspec")
  try:
    views, end = {}, 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
      start, stop = entry["data_offsets"]
      dtype = np.dtype(_DTYPES[entry["dtype"]])
      shape = tuple(int(d) for d in entry["shape"])
      if start != end or stop - start != dtype.itemsize * int(np.prod(shape)):
        raise PreparedError(f"tensor {name!r} is not where its size says")
      end = stop
      if name.startswith("__pad__/"):
        continue
      views[name] = np.frombuffer(mapped, dtype, int(np.prod(shape)), 8 + n + start).reshape(shape)
    if 8 + n + end != size:
      raise PreparedError(f"its tensors end at byte {8 + n + end} of {size}")
    # One call for all of them: a call per array costs more than the aliasing itself.
    arrays = dict(zip(views, jax.device_put(list(views.values()), may_alias=True)))
    params = _rebuild(json.loads(meta["tree"]), arrays)
    cfg = config_lib.Qwen2Config.from_dict(json.loads(meta["config"]))
    backend = model.Backend(**json.loads(meta["backend"]))
  except PreparedError as e:
    raise PreparedError(f"{path}: {e}") from None
  except (KeyError, TypeError, ValueError) as e:
    raise PreparedError(f"{path}: damaged ({type(e).__name__}: {e})") from None
  return bundle_lib.Model(cfg, params, backend)
