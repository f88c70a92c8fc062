"""jspec's own checkpoint file: params and config in one safetensors file.

Tensors are named by their params path (`layers/0/attn/q/w`) and
already in jspec orientation and dtype; the config is JSON in the file's
metadata. Loading one therefore only maps the file and copies tensors out,
with no dequantizing, transposing or key mapping, and runs no code from it.

A save writes a temporary file in the destination's directory and renames it
over the destination (`os.replace` is atomic on POSIX), so an interrupted save
leaves the previous file, or nothing, never half a file. `save_streamed` writes
the same file without ever holding the params together: it lays the file out
from what each param will be, then writes each at its place as it is made. A load checks the
names, shapes and dtypes against the config and turns a truncated or corrupted
file into a ConvertError.
"""

from __future__ import annotations

import collections.abc
import json
import math
import mmap
import os
import pathlib
import struct
import tempfile
import weakref
from typing import Any, Callable, Optional

import numpy as np
import safetensors
import safetensors.numpy

from convert import config as config_lib
from convert import gguf_blocks
from convert import keys

FORMAT = "jspec"
FORMAT_VERSION = "3"  # 2: jspec.model's NNX param paths; 3: int8 blocks (`gguf_blocks`)
# The file name used when the destination given is a directory.
DEFAULT_NAME = "jspec.safetensors"


def resolve_path(path) -> pathlib.Path:
  """Where a save to `path` goes: `path` itself, or `path/jspec.safetensors` for a directory.

  Args:
    path: a file path or an existing directory.

  Returns:
    The file path.
  """
  path = pathlib.Path(path)
  return path / DEFAULT_NAME if path.is_dir() else path


def _read_metadata(path: pathlib.Path) -> Optional[dict[str, str]]:
  """The safetensors `__metadata__` of a file, or None if it is not a safetensors file."""
  try:
    with open(path, "rb") as f:
      (size,) = struct.unpack("<Q", f.read(8))
      if size > 100_000_000:
        return None
      header = json.loads(f.read(size))
  except (OSError, struct.error, ValueError):
    return None
  meta = header.get("__metadata__") if isinstance(header, dict) else None
  return meta if isinstance(meta, dict) else None


def is_jspec_file(path) -> bool:
  """Whether a file is a checkpoint written by `save`.

  Args:
    path: any path.

  Returns:
    True for a safetensors file whose metadata says format "jspec".
  """
  path = pathlib.Path(path)
  return path.is_file() and (_read_metadata(path) or {}).get("format") == FORMAT


def _names(tensors_or_blocks: dict[str, Any]) -> dict[str, Any]:
  """The file's tensors for `save`: int8 blocks as their q, scale and offset under names of their own."""
  out = {}
  for path, value in tensors_or_blocks.items():
    if isinstance(value, gguf_blocks.Blocks):
      out[path + ":q"], out[path + ":scale"] = value.q, value.scale
      if value.offset is not None:
        out[path + ":offset"] = value.offset
    else:
      out[path] = value
  return out


def _check(cfg: config_lib.Qwen2Config, shapes: dict[str, tuple], dtypes: dict[str, Any],
           blocks: dict[str, int], source: str) -> None:
  """Raises unless the file's tensors are exactly the params of `cfg`, each of its shape.

  Args:
    cfg: the config.
    shapes: file tensor name -> shape.
    dtypes: file tensor name -> dtype name.
    blocks: jspec path -> block size, for the matrices stored as int8 blocks.
    source: a name for error messages.
  """
  want, hf = keys.expected_shapes(cfg), keys.hf_shapes(cfg)
  expected = {}
  for p in want:
    if p in blocks:
      out, inp = hf[p]
      b = blocks[p]
      if not isinstance(b, int) or b < 1 or inp % b:
        raise keys.ConvertError(f"{source}: tensor {p!r} has blocks of {b!r}: expected a size "
                                f"dividing its {inp} inputs")
      expected[p + ":q"] = hf[p]
      expected[p + ":scale"] = (out, inp // b)
      if p + ":offset" in shapes:
        expected[p + ":offset"] = (out, inp // b)
    else:
      expected[p] = want[p]
  missing = [p for p in expected if p not in shapes]
  extra = [p for p in shapes if p not in expected]
  if missing or extra:
    raise keys.ConvertError(f"{source}: tensors do not match the config: missing {missing[:5]}, "
                            f"unexpected {extra[:5]}")
  for p, shape in shapes.items():
    if tuple(shape) != expected[p]:
      raise keys.ConvertError(f"{source}: tensor {p!r} has shape {tuple(shape)}, "
                              f"expected {expected[p]} from the config")
    kind = str(dtypes[p]).lower()
    ok = (("int8", "i8") if p.endswith(":q") else
          ("float32", "f32") if ":" in p else ("float32", "f32", "bfloat16", "bf16", "float16", "f16"))
    if kind not in ok:
      raise keys.ConvertError(f"{source}: tensor {p!r} is {kind}: expected {ok[0]}")


def save(path, cfg: config_lib.Qwen2Config, tensors: dict[str, Any]) -> pathlib.Path:
  """Writes tensors and config to one safetensors file, atomically.

  Args:
    path: destination file (or an existing directory: `path/jspec.safetensors`).
    cfg: the model config.
    tensors: jspec path -> tensor (numpy or jax arrays; one dtype), as
      `convert.assemble` returns them.

  Returns:
    The path written.

  Raises:
    ConvertError: the params do not match the config.
  """
  path = resolve_path(path)
  blocks = {p: x.block for p, x in tensors.items() if isinstance(x, gguf_blocks.Blocks)}
  # np.asarray of a jax array on CPU is a view of its buffer, not a copy.
  tensors = {p: np.asarray(x) for p, x in _names(tensors).items()}
  _check(cfg, {p: x.shape for p, x in tensors.items()},
         {p: x.dtype for p, x in tensors.items()}, blocks, str(path))
  return write_atomic(path, tensors, _metadata(cfg, blocks))


def _metadata(cfg: config_lib.Qwen2Config, blocks: dict[str, int]) -> dict[str, str]:
  """The `__metadata__` of a jspec file: format, version, config and block sizes."""
  return {"format": FORMAT, "format_version": FORMAT_VERSION,
          "config": json.dumps(cfg.to_dict(), sort_keys=True), "blocks": json.dumps(blocks)}


def layout(cfg: config_lib.Qwen2Config,
           forms: dict[str, Any]) -> tuple[dict[str, tuple[np.dtype, tuple]], dict[str, int]]:
  """The tensors of the file `save` would write, from what each param will be before it exists.

  Args:
    cfg: the model config.
    forms: jspec path -> the param's dtype, or a `gguf_blocks.Form` for int8
      blocks, for every path of `keys.expected_shapes(cfg)`.

  Returns:
    ({file tensor name: (dtype, shape)}, {jspec path: block size}), named and
    shaped as `save` names and checks them.
  """
  hf = keys.hf_shapes(cfg)
  tensors, blocks = {}, {}
  for path, shape in keys.expected_shapes(cfg).items():
    form = forms[path]
    if isinstance(form, gguf_blocks.Form):
      out, inp = hf[path]
      blocks[path] = form.block
      tensors[path + ":q"] = (np.dtype(np.int8), (out, inp))
      parts = [":scale"] + ([":offset"] if form.offset else [])
      for part in parts:
        tensors[path + part] = (np.dtype(np.float32), (out, inp // form.block))
    else:
      tensors[path] = (np.dtype(form), tuple(shape))
  return tensors, blocks


# safetensors' names for the dtypes of a jspec file, in the order it lays
# tensors out: by dtype (its enum, descending), then by name.
_SAFETENSORS_DTYPES = {keys.DTYPES["float32"]: "F32", keys.DTYPES["bfloat16"]: "BF16",
                       keys.DTYPES["float16"]: "F16", np.dtype(np.int8): "I8"}


def _header(tensors: dict[str, tuple[np.dtype, tuple]],
            metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
  """The bytes before a safetensors file's data, as `safetensors.numpy.save_file` lays them out.

  Args:
    tensors: name -> (dtype, shape).
    metadata: string -> string.

  Returns:
    (the 8-byte length and the space-padded JSON header, {name: (start, stop)}
    in bytes from the end of the header).
  """
  rank = {dtype: i for i, dtype in enumerate(_SAFETENSORS_DTYPES)}
  order = sorted(tensors, key=lambda name: (rank[tensors[name][0]], name))
  entries, spans, start = {"__metadata__": metadata}, {}, 0
  for name in order:
    dtype, shape = tensors[name]
    stop = start + dtype.itemsize * math.prod(shape)
    entries[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": [int(d) for d in shape],
                     "data_offsets": [start, stop]}
    spans[name] = (start, stop)
    start = stop
  text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
  text += b" " * (-len(text) % 8)
  return struct.pack("<Q", len(text)) + text, spans


def save_streamed(path, cfg: config_lib.Qwen2Config, forms: dict[str, Any],
                  fill: Callable[[Callable[[str, Any], None]], None]) -> pathlib.Path:
  """Writes the file `save` would, one param at a time as `fill` makes them, atomically.

  The header comes first from `forms`, so that each param is written at its
  place as soon as it is made and only the params `fill` holds at once are
  ever alive, not the model.

  Args:
    path: destination file (or an existing directory: `path/jspec.safetensors`).
    cfg: the model config.
    forms: jspec path -> dtype or `gguf_blocks.Form`, as for `layout`.
    fill: called once as fill(put); calls put(jspec path, tensor) for every
      param, each once, a numpy array or `gguf_blocks.Blocks` of the form
      `forms` gave it.

  Returns:
    The path written.

  Raises:
    ConvertError: the params do not match the config or `forms`, or `fill`
      did not give every one; nothing is left behind.
  """
  path = resolve_path(path)
  tensors, blocks = layout(cfg, forms)
  _check(cfg, {p: shape for p, (_, shape) in tensors.items()},
         {p: dtype for p, (dtype, _) in tensors.items()}, blocks, str(path))
  header, spans = _header(tensors, _metadata(cfg, blocks))

  def write(tmp: str) -> None:
    written = set()
    with open(tmp, "r+b") as f:
      f.write(header)
      f.truncate(len(header) + max((stop for _, stop in spans.values()), default=0))

      def put(param: str, value: Any) -> None:
        block = value.block if isinstance(value, gguf_blocks.Blocks) else None
        if block != blocks.get(param):
          raise keys.ConvertError(f"{path}: param {param!r} is not in the form planned for it")
        for name, array in _names({param: value}).items():
          array = np.asarray(array)
          if name not in tensors or name in written:
            raise keys.ConvertError(f"{path}: tensor {name!r} was not planned or came twice")
          if (array.dtype, tuple(array.shape)) != tensors[name]:
            raise keys.ConvertError(f"{path}: tensor {name!r} is {array.dtype} "
                                    f"{tuple(array.shape)}, planned as {tensors[name][0]} "
                                    f"{tensors[name][1]}")
          f.seek(len(header) + spans[name][0])
          f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
          written.add(name)

      fill(put)
    if written != set(tensors):
      missing = sorted(set(tensors) - written)
      raise keys.ConvertError(f"{path}: {len(missing)} tensor(s) never written: {missing[:5]}")

  return write_file_atomic(path, write)


def write_atomic(path: pathlib.Path, tensors: dict[str, np.ndarray],
                 metadata: dict[str, str]) -> pathlib.Path:
  """Writes a safetensors file whole or not at all: a temporary beside it, fsynced, renamed.

  Args:
    path: destination.
    tensors: name -> C-contiguous array.
    metadata: string -> string.

  Returns:
    path.
  """
  return write_file_atomic(
      path, lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata=metadata))


def write_file_atomic(path: pathlib.Path, write: Callable[[str], None]) -> pathlib.Path:
  """Makes a file whole or not at all: `write` fills a temporary beside it, then fsync and rename.

  Args:
    path: destination.
    write: writes the whole file to the path it is given.

  Returns:
    path.
  """
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  os.close(fd)
  try:
    write(tmp)
    with open(tmp, "rb") as f:  # on disk before the rename makes it visible
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
    os.replace(tmp, path)
  except BaseException:  # KeyboardInterrupt too: never leave the temporary behind
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  return path


def load(path, dtype: Any = None,
         put: Optional[Callable[[np.ndarray], Any]] = None,
         mapped: bool = False) -> tuple[config_lib.Qwen2Config, Any]:
  """Reads a file written by `save`.

  Args:
    path: the file (or a directory holding jspec.safetensors).
    dtype: cast the params to this dtype (None: keep the stored one).
    put: applied to each tensor as it is read (e.g. `jax.device_put`).
    mapped: read nothing yet: return a mapping that makes each tensor when
      it is looked up, as a view of its own private (copy-on-write) memory
      map of the file (cast or widened, if asked, into a new array). Nothing
      is read until a view is used, and the pages it made resident leave the
      process with it, so a caller that converts one tensor at a time and
      drops each holds one tensor of the file, never all of them
      (`jspec.loading`). Each lookup makes a new view: keep it, not the
      mapping's entry.

  Returns:
    (config, {jspec path: tensor}): a dict, or with `mapped` a read-only
    mapping.

  Raises:
    ConvertError: not a jspec file, truncated, corrupted, or tensors that do
      not match its config.
  """
  path = resolve_path(path)
  if not path.is_file():
    raise keys.ConvertError(f"{path}: no such file")
  put = put or (lambda x: x)
  try:
    handle = safetensors.safe_open(str(path), framework="numpy")
  except Exception as e:  # SafetensorError on a short or garbled file
    raise keys.ConvertError(f"{path}: not a readable safetensors file, truncated or corrupted "
                            f"({type(e).__name__}: {e})") from None
  meta = handle.metadata() or {}
  if meta.get("format") != FORMAT:
    raise keys.ConvertError(f"{path}: not a jspec checkpoint (metadata format="
                            f"{meta.get('format')!r}, expected {FORMAT!r})")
  try:
    cfg = config_lib.Qwen2Config.from_dict(json.loads(meta["config"]))
  except (KeyError, json.JSONDecodeError, TypeError) as e:
    raise keys.ConvertError(f"{path}: config in metadata is missing or invalid "
                            f"({type(e).__name__}: {e})") from None
  try:
    blocks = json.loads(meta.get("blocks", "{}"))
    if not isinstance(blocks, dict):
      raise TypeError(f"a {type(blocks).__name__}, not an object")
  except (json.JSONDecodeError, TypeError) as e:
    raise keys.ConvertError(f"{path}: its block sizes in metadata are invalid ({e})") from None
  names = list(handle.keys())
  shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in names}
  dtypes = {n: handle.get_slice(n).get_dtype() for n in names}
  _check(cfg, shapes, dtypes, blocks, str(path))
  cast = keys.resolve_dtype(dtype) if dtype is not None else None
  del handle

  def read(name):
    try:
      # A handle per tensor: its memory map (and the file pages it made
      # resident) goes away with it, so peak RSS stays near the params'
      # own bytes instead of params + the whole mapped file.
      with safetensors.safe_open(str(path), framework="numpy") as one:
        return one.get_tensor(name)
    except Exception as e:
      raise keys.ConvertError(f"{path}: cannot read tensor {name!r}, the file is truncated or "
                              f"corrupted ({type(e).__name__}: {e})") from None

  if mapped:
    read = _Views(path, shapes)

  def param(name):
    if name in blocks:
      value = gguf_blocks.Blocks(read(name + ":q"), read(name + ":scale"),
                                 read(name + ":offset") if name + ":offset" in shapes else None,
                                 blocks[name])
      if cast is not None:  # a float dtype asked for: widen, exactly
        value = value.widen()  # [out, in], as HF holds it
        value = value.T if name in keys.transposed(cfg) else value
        return put(np.ascontiguousarray(value, dtype=cast))
      return value
    array = read(name)
    if cast is not None and array.dtype != cast:
      array = array.astype(cast)
    return put(array)

  if mapped:
    return cfg, _Lazy(list(keys.expected_shapes(cfg)), param)
  return cfg, {name: param(name) for name in keys.expected_shapes(cfg)}


# safetensors dtype names of the tensors `_check` admits.
_DTYPES = {"F32": keys.DTYPES["float32"], "BF16": keys.DTYPES["bfloat16"],
           "F16": keys.DTYPES["float16"], "I8": np.dtype(np.int8)}


class _Views:
  """A jspec file's tensors as views of private memory maps, one map per tensor.

  The file is opened once, so every view comes from the file that was
  checked even if another process renames a new one over its name; the
  header is checked against the file's size here, so a truncated file fails
  before any tensor is used.
  """

  def __init__(self, path: pathlib.Path, shapes: dict[str, tuple]):
    self._path = path
    self._fd = os.open(path, os.O_RDONLY)
    weakref.finalize(self, os.close, self._fd)
    try:
      size = os.fstat(self._fd).st_size
      with os.fdopen(os.dup(self._fd), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, 100_000_000):
          raise ValueError(f"header length {n} runs past the file")
        header = json.loads(f.read(n))
      self._entries = {}
      for name in shapes:
        entry = header[name]
        start, stop = (int(x) for x in entry["data_offsets"])
        dtype = _DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        if shape != tuple(shapes[name]) or stop - start != dtype.itemsize * math.prod(shape):
          raise ValueError(f"tensor {name!r} is not where its size says")
        if not 0 <= start <= stop <= size - 8 - n:
          raise ValueError(f"tensor {name!r} runs past the end of the file")
        self._entries[name] = (8 + n + start, dtype, shape)
    except (OSError, struct.error, ValueError, KeyError, TypeError) as e:
      raise keys.ConvertError(f"{path}: not a readable jspec file, truncated or corrupted "
                              f"({type(e).__name__}: {e})") from None

  def __call__(self, name: str) -> np.ndarray:
    begin, dtype, shape = self._entries[name]
    count = math.prod(shape)
    if not count:
      return np.zeros(shape, dtype)
    base = begin - begin % mmap.ALLOCATIONGRANULARITY
    try:
      pages = mmap.mmap(self._fd, begin - base + count * dtype.itemsize, flags=mmap.MAP_PRIVATE,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
    except (OSError, ValueError) as e:
      raise keys.ConvertError(f"{self._path}: cannot map tensor {name!r} "
                              f"({type(e).__name__}: {e})") from None
    # The view holds the map; the map goes (unmapped) with the last view of it.
    return np.frombuffer(pages, dtype, count, begin - base).reshape(shape)


class _Lazy(collections.abc.Mapping):
  """A read-only mapping whose values are made by a function each time they are looked up."""

  def __init__(self, names: list[str], make: Callable[[str], Any]):
    self._names, self._make = names, make

  def __getitem__(self, name: str) -> Any:
    if name not in self._names:
      raise KeyError(name)
    return self._make(name)

  def __contains__(self, name: object) -> bool:
    return name in self._names

  def __iter__(self):
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)
