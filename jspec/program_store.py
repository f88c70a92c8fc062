"""Traced programs kept on disk (`jax.export`), so that a second process skips tracing.

JAX's persistent compilation cache keeps compiled executables, but a new
process finds its executable only after tracing and lowering the Python
program again, to compute the cache key (a large share of a second
process's start: docs/decisions.md, "Program store"). This store keeps each lowered program as a serialized
`jax.export.Exported` beside the XLA cache, keyed by everything the program
is traced from: jspec's source, the JAX/jaxlib/flax versions and the JAX
settings that change tracing, the backend, the static settings and the
argument shapes. A process that finds one deserializes it and compiles `Exported.call`, which the XLA cache then answers.

The first process lowers through the same `Exported.call`, so both
processes compile the same module and the XLA cache key matches.

Weight loading is untouched: only programs (StableHLO) are stored, never
arrays or Python objects, and reading one runs no code.

The store is only an optimisation, so nothing in it may break a run: each
entry carries the sha256 of its program, and an entry that fails that
check, or fails to deserialize, lower or compile, is warned about once,
traced again and replaced. A store directory that cannot be created or
written (a regular file or a dangling symlink in its place, a read-only
cache) is warned about once, and programs are traced without it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
from jax import export

from convert import config as config_lib
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import decode
from jspec import greedy_head
from jspec import weights

_SUBDIR = "jspec-programs"  # inside the XLA cache dir (JAX only reads its *-cache files)
# An entry is this line, the sha256 of the serialized program in hex and a
# newline, then the program: a damaged entry is told apart before
# `export.deserialize` reads it.
_MAGIC = b"jspec-program 1\n"
_DIGEST_LEN = 64
_warned: set = set()  # what `warn_once` has warned about in this process


def warn_once(key: Any, message: str) -> None:
  """Warns (RuntimeWarning) the first time `key` comes up: a cache problem is told once.

  Args:
    key: what the warning is about (a path, or a path and a kind of problem).
    message: the warning.
  """
  if key in _warned:
    return
  _warned.add(key)
  warnings.warn(message, RuntimeWarning, stacklevel=3)


def _one_line(err: BaseException) -> str:
  """An exception as `Type: message` on one line (XLA's messages span many)."""
  return f"{type(err).__name__}: {' '.join(str(err).split())}"[:500]


def _register_pytrees() -> None:
  """Lets `Exported` name jspec's pytree nodes in its calling convention."""
  for cls in (decode.State, decode.Knobs, cache_lib.KVCache, greedy_head.GreedyHead,
              *weights.LEAVES):
    # Their auxdata is JSON: registered dataclasses (`weights`, `greedy_head`)
    # carry their static fields' values (plain numbers), chex dataclasses
    # (`decode`, `cache`) their field names.
    export.register_pytree_node_serialization(
        cls, serialized_name=f"jspec.{cls.__name__}",
        serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
        deserialize_auxdata=lambda data: tuple(json.loads(data)))


_register_pytrees()


def caching_on() -> bool:
  """Whether compiled programs are kept between processes (JSPEC_XLA_CACHE=0 turns it off).

  Returns:
    False only when JSPEC_XLA_CACHE is "0"; both the XLA executable cache
    (`programs.enable_persistent_cache`) and this store follow it.
  """
  return os.environ.get("JSPEC_XLA_CACHE", "1") != "0"


def store_dir() -> Optional[pathlib.Path]:
  """Where programs are kept: `<XLA cache dir>/jspec-programs`, or None when off.

  It follows the XLA cache (`programs.enable_persistent_cache`): a stored
  program saves only tracing, so without the executable cache it is not
  worth writing. JSPEC_XLA_CACHE=0 turns both off.

  Returns:
    The directory (not created yet), or None.
  """
  if not caching_on():
    return None
  xla_dir = jax.config.jax_compilation_cache_dir
  return pathlib.Path(xla_dir) / _SUBDIR if xla_dir else None


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
  """sha256 of every file a traced program depends on: jspec's sources and library versions.

  Returns:
    Hex digest; it changes whenever any jspec module or the JAX stack does.
  """
  h = hashlib.sha256()
  for name in ("jax", "jaxlib", "flax"):
    h.update(f"{name}={importlib.metadata.version(name)}\n".encode())
  package = pathlib.Path(__file__).resolve().parent
  config_source = pathlib.Path(config_lib.__file__).resolve()  # the model config is traced too
  for path in sorted([*package.glob("*.py"), *package.glob("*.cc"), *package.glob("*.h"),
                      config_source]):
    h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
  return h.hexdigest()


# JAX settings that change what tracing produces without changing any argument.
# (How each model runs is part of the static settings: `decode.Spec`'s archs.)
_TRACE_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                 "jax_threefry_partitionable", "jax_numpy_dtype_promotion")


def _aval(x: Any) -> Any:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
  return repr(x)


def program_key(name: str, args: Sequence[Any], static: dict) -> str:
  """The store key of one program.

  Args:
    name: the program ("prefill", "run").
    args: its positional arguments (arrays or `jax.ShapeDtypeStruct`s).
    static: its static keyword arguments (reprs must be deterministic:
      frozen dataclasses of plain values, like `decode.Spec`).

  Returns:
    A hex string naming the stored file.
  """
  leaves, tree = jax.tree.flatten(args)
  device = jax.devices()[0]
  parts = [source_digest(), name, jax.default_backend(), device.device_kind,
           repr(sorted(static.items())), str(tree), repr([_aval(x) for x in leaves])]
  parts += [f"{flag}={getattr(jax.config, flag, None)}" for flag in _TRACE_CONFIG]
  if jax.default_backend() == "cpu":
    # Which CPU kernels a trace calls depends on the host (a cache directory
    # can move to a machine without AVX-512, whose library lacks VNNI's).
    parts.append(f"cpu_kernels={cpu_kernels.available()},{cpu_kernels.int8_kind()}")
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


def _entry(exported: export.Exported) -> bytes:
  """The stored form of a program: `_MAGIC`, its sha256, then the serialized program."""
  payload = bytes(exported.serialize())
  return _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    if path.is_dir() and not path.is_symlink():
      path.rmdir()  # an empty directory in the entry's place; a full one fails below
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


def _store(path: pathlib.Path, exported: export.Exported) -> None:
  """Writes an entry; a store that cannot be written is warned about once and left as it is."""
  try:
    _write_atomic(path, _entry(exported))
  except OSError as err:
    warn_once((path.parent, "write"), f"cannot write the program store {path.parent} "
              f"({_one_line(err)}); tracing programs without storing them")


def _read(path: pathlib.Path) -> Optional[export.Exported]:
  """The stored program at `path`, or None (missing, or unreadable: warned, then replaced)."""
  if not path.exists():
    return None
  try:
    data = path.read_bytes()
    head = len(_MAGIC) + _DIGEST_LEN + 1
    if not data.startswith(_MAGIC) or data[head - 1:head] != b"\n":
      raise ValueError("not a jspec program entry")
    payload = memoryview(data)[head:]
    if hashlib.sha256(payload).hexdigest().encode() != data[len(_MAGIC):head - 1]:
      raise ValueError("its sha256 does not match its contents (damaged)")
    return export.deserialize(bytearray(payload))
  except Exception as err:  # a truncated, damaged or foreign file: trace again and overwrite it
    warn_once((path, "read"), f"ignoring the unreadable stored program {path} "
              f"({_one_line(err)}); tracing it again")
    return None


def _usable(directory: pathlib.Path) -> bool:
  """Whether the store directory exists or can be made (warned once when it cannot)."""
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as err:  # a regular file or a dangling symlink in its place, a read-only cache
    warn_once((directory, "directory"), f"cannot use the program store {directory} "
              f"({_one_line(err)}); tracing programs without storing them")
    return False
  return True


def _calling(name: str, exported: export.Exported, args: Sequence[Any],
             donate_argnums: tuple[int, ...]) -> tuple[jax.stages.Lowered, Callable]:
  """Lowers the jitted call of an exported program (what both a stored and a traced one compile)."""

  def program(*args):
    return exported.call(*args)

  program.__name__ = program.__qualname__ = name  # "jit_run" in XLA dumps and cache files
  call = jax.jit(program, donate_argnums=donate_argnums)
  return call.lower(*args), call


def lower(name: str, fn: Callable, args: Sequence[Any], static: dict,
          donate_argnums: tuple[int, ...] = (),
          trace: bool = False) -> tuple[jax.stages.Lowered, Callable, bool]:
  """Lowers `fn(*args, **static)`, from the store when it holds the program.

  Args:
    name: the program's name (part of the key).
    fn: a `jax.jit`-wrapped function.
    args: positional arguments (arrays or `jax.ShapeDtypeStruct`s).
    static: static keyword arguments of `fn`.
    donate_argnums: positions of `args` whose buffers the program may reuse
      (as `fn`'s own donation; `Exported.call` does not carry it).
    trace: trace even if the store holds the program, and replace its entry.

  Returns:
    (lowered program, the jitted callable it came from (for `clear_cache`),
    whether it was read from the store). With the store off or unusable
    this is `fn.lower(*args, **static)`.
  """
  directory = store_dir()
  if directory is None or not _usable(directory):
    return fn.lower(*args, **static), fn, False
  path = directory / f"{name}-{program_key(name, args, static)}.jaxexport"
  exported = None if trace else _read(path)
  if exported is not None:
    try:
      lowered, call = _calling(name, exported, args, donate_argnums)
      return lowered, call, True
    except Exception as err:  # deserialized, but its module is damaged: trace it again
      warn_once((path, "lower"), f"ignoring the stored program {path}, which does not lower "
                f"({_one_line(err)}); tracing it again")
  # jspec's own CPU kernel is a custom call export cannot vouch for; the
  # key holds its source (`source_digest`), so a stored program only ever
  # runs against the kernel it was traced with.
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in cpu_kernels.TARGETS]
  exported = export.export(jax.jit(functools.partial(fn, **static)), disabled_checks=checks)(*args)
  _store(path, exported)
  lowered, call = _calling(name, exported, args, donate_argnums)
  return lowered, call, False


def compile_program(name: str, fn: Callable, args: Sequence[Any], static: dict,
                    donate_argnums: tuple[int, ...] = ()) -> tuple[Any, Callable, bool]:
  """Compiles `fn(*args, **static)` via `lower`; a stored program that fails is traced again.

  Args:
    name: the program's name (part of the key).
    fn: a `jax.jit`-wrapped function.
    args: positional arguments (arrays or `jax.ShapeDtypeStruct`s).
    static: static keyword arguments of `fn`.
    donate_argnums: positions of `args` whose buffers the program may reuse.

  Returns:
    (compiled program, the jitted callable it came from (for `clear_cache`),
    whether it was read from the store).
  """
  lowered, call, stored = lower(name, fn, args, static, donate_argnums)
  if not stored:
    return lowered.compile(), call, False
  try:
    return lowered.compile(), call, True
  except Exception as err:  # a damaged module that still lowered: trace it again
    call.clear_cache()
    path = store_dir() / f"{name}-{program_key(name, args, static)}.jaxexport"
    warn_once((path, "compile"), f"ignoring the stored program {path}, which does not compile "
              f"({_one_line(err)}); tracing it again")
  lowered, call, _ = lower(name, fn, args, static, donate_argnums, trace=True)
  return lowered.compile(), call, False
