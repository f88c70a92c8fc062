"""Cache faults: each kind of cache file, damaged each way, then the next run.

The kinds: a known model's converted weights file, its stamp and its
tokenizer cache (in JSPEC_CACHE, read by `jspec.load`), and a stored
program and an XLA cache entry (in the XLA cache directory, read by
`generate`). The damage: truncated; bytes flipped in the middle with the
size and mtime kept; a directory in its place; a dangling symlink in its
place; its directory read-only. A cache only saves time, so the next run
must give the tokens of a clean cache (a damaged file is rebuilt, or
passed over with a warning), or fail with one clear line.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import warnings

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

import jspec
import test_load
import test_program_store
import tiny
from jspec import programs as programs_lib
from jspec import cpu_kernels
from jspec import fetch
from jspec import loading
from jspec import program_store

DAMAGE = ("truncate", "flip", "directory", "dangling-symlink", "read-only")
WEIGHT_KINDS = ("weights", "stamp", "tokenizer")
PROGRAM_KINDS = ("program", "xla-entry")
PROMPT = test_load.PROMPT


def _cases(kinds):
  """Every (kind, damage): one damage per kind in the fast tier (CI), each a different one, the rest slow."""
  return [pytest.param(kind, damage, id=f"{kind}-{damage}",
                       marks=() if damage == DAMAGE[(i + 1) % len(DAMAGE)] else pytest.mark.slow)
          for i, kind in enumerate(kinds) for damage in DAMAGE]


def _flip(path, count=64):
  """Flips the low bit of each letter and digit in `count` middle bytes, keeping size and mtime.

  Text files (the stamp, the tokenizer cache) mostly stay valid JSON this
  way, with other values in them: only a hash tells.
  """
  st = path.stat()
  with open(path, "r+b") as f:
    f.seek(st.st_size // 2)
    data = f.read(count)
    f.seek(st.st_size // 2)
    f.write(bytes(b ^ 1 if chr(b).isalnum() else b for b in data))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@contextlib.contextmanager
def _damaged(paths, damage, root):
  """Damages every file in `paths` for the block (a read-only directory is writable again after)."""
  undo = None
  for path in paths:
    if damage == "truncate":
      path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif damage == "flip":
      _flip(path)
    elif damage == "directory":
      path.unlink()
      path.mkdir()
    elif damage == "dangling-symlink":
      path.unlink()
      path.symlink_to(root / "gone" / path.name)
  if damage == "read-only":
    undo = test_program_store._read_only(paths[0].parent)
    if undo is None:
      pytest.skip("no way to make a directory read-only for root here (chattr failed)")
  try:
    yield
  finally:
    if undo is not None:
      undo()


@pytest.fixture(scope="module")
def known(tmp_path_factory, make_hf_model, write_gguf):
  """A known model "fake-target" (fake chunk packages) and a clean cache: (cache, token ids)."""
  root = tmp_path_factory.mktemp("known")
  site = root / "site"
  site.mkdir()
  gguf = write_gguf(root / "t.gguf", make_hf_model(seed=4, **test_load.TARGET_SIZES))
  source = test_load._fake_source(site, "fake-target", gguf)
  # The XLA cache and the CPU kernels where the rest of the tests keep theirs, not in this cache.
  programs_lib.enable_persistent_cache()
  cpu_kernels.available()
  with pytest.MonkeyPatch.context() as mp:
    mp.syspath_prepend(str(site))
    importlib.invalidate_caches()
    mp.setattr(fetch, "MODELS", {"fake-target": source})
    mp.setattr(fetch, "ALIASES", {})
    mp.setattr(fetch, "PAIRS", {})
    mp.setenv("JSPEC_CACHE", str(root / "clean"))
    bundle = jspec.load("fake-target", progress=False)
    ids = jspec.generate(bundle, PROMPT, max_new_tokens=8, method="target").token_ids
    yield root / "clean", ids


def _weight_file(cache, kind):
  converted = loading.converted_path(cache / "fake-target.gguf", "exact")
  return {"weights": converted, "stamp": converted.with_name(converted.name + ".stamp"),
          "tokenizer": cache / "fake-target.tokenizer.json"}[kind]


@pytest.mark.parametrize("kind,damage", _cases(WEIGHT_KINDS))
def test_a_damaged_model_cache_file_is_rebuilt(known, kind, damage, tmp_path, monkeypatch,
                                               capsys):
  clean, ids = known
  cache = tmp_path / "cache"
  shutil.copytree(clean, cache, symlinks=True)
  monkeypatch.setenv("JSPEC_CACHE", str(cache))
  with _damaged([_weight_file(cache, kind)], damage, tmp_path):
    bundle = jspec.load("fake-target", progress=False)
  assert jspec.generate(bundle, PROMPT, max_new_tokens=8, method="target").token_ids == ids
  err = capsys.readouterr().err
  assert "Traceback" not in err and all(line.startswith("jspec: ") for line in err.splitlines())
  # Rebuilt, not just passed over: the next load is quiet and converts nothing.
  test_load._no_conversion(monkeypatch)
  again = jspec.load("fake-target", progress=False)
  assert jspec.generate(again, PROMPT, max_new_tokens=8, method="target").token_ids == ids
  assert capsys.readouterr().err == ""


def _point_xla_cache_at(directory):
  """The XLA cache (and so the program store) in `directory`, as a new process would find it."""
  jax.config.update("jax_compilation_cache_dir", str(directory))
  compilation_cache.reset_cache()
  program_store._warned.clear()
  programs_lib.release()


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
  """An XLA cache with a stored prefill and run program in it: (directory, bundle, token ids)."""
  saved = {name: getattr(jax.config, name) for name in (
      "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("JSPEC_XLA_CACHE", "1")
    mp.setattr(program_store, "_warned", set())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # tiny programs too
    clean = tmp_path_factory.mktemp("programs") / "xla"
    _point_xla_cache_at(clean)
    bundle = tiny.pair(5)
    ids = jspec.generate(bundle, tiny.prompt(1, 9), max_new_tokens=12, method="target").token_ids
    try:
      yield clean, bundle, ids
    finally:
      for name, value in saved.items():
        jax.config.update(name, value)
      compilation_cache.reset_cache()
      programs_lib.release()


def _program_files(cache, kind):
  if kind == "program":
    return sorted((cache / "jspec-programs").glob("*.jaxexport"))
  return sorted([*cache.glob("jit_prefill-*-cache"), *cache.glob("jit_run-*-cache")])


@pytest.mark.parametrize("kind,damage", _cases(PROGRAM_KINDS))
def test_a_damaged_compiled_program_is_compiled_again(programs, kind, damage, tmp_path):
  clean, bundle, ids = programs
  cache = tmp_path / "xla"
  shutil.copytree(clean, cache, symlinks=True)
  files = _program_files(cache, kind)
  assert len(files) == 2  # prefill and run
  _point_xla_cache_at(cache)
  with _damaged(files, damage, tmp_path), warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    out = jspec.generate(bundle, tiny.prompt(1, 9), max_new_tokens=12, method="target")
  assert out.token_ids == ids
  ours = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
  assert len(ours) <= 2 and all("tracing it again" in m for m in ours), ours
  if kind == "program":  # each entry was replaced: the next process reads it without a word
    programs_lib.release()
    stored = programs_lib.PROGRAMS.stored
    with warnings.catch_warnings():
      warnings.simplefilter("error", RuntimeWarning)
      again = jspec.generate(bundle, tiny.prompt(1, 9), max_new_tokens=12, method="target")
    assert again.token_ids == ids and programs_lib.PROGRAMS.stored == stored + 2
